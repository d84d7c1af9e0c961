"""Training storage in an S3-compatible object store (``--dest s3://BUCKET/PREFIX``), verified by the store.

The run's layout under PREFIX is an rsync destination's: ``samples/<key>.safetensors`` and
``manifest.jsonl`` (one ``op: add`` line per sample, ``file: samples/<key>.safetensors``; rewritten
after each batch, once its samples are verified: the manifest is written last). boto3 speaks S3.

Verification is the store's own, with S3's SHA256 checksums:

- a sample of at most one 64 MiB range goes in one PUT carrying ``x-amz-checksum-sha256``, the
  sha256 of its bytes; a larger one in a multipart upload of 64 MiB parts, each carrying its part's
  sha256. The store refuses a body that does not match (BadDigest), and for the multipart object it
  computes the composite checksum, the sha256 of the parts' sha256 digests: exactly the capture
  writer's ranged digest (``sha256r64m:``, :func:`hs_patch.samples.files.ranged`). So the store checks our
  own digest; the digest of the bytes read here is compared with the manifest's before the upload
  is completed (a local file damaged since it was written never ships);
- then a HEAD: size and checksum must match the manifest line before the sample counts as shipped.

This module holds the store's primitives (:class:`Bucket`); :mod:`hs_patch.host.shipping.bucket_link`
drives them for the shipper.
"""

from __future__ import annotations

import base64
import configparser
import copy
import hashlib
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hs_patch.host.shipping import at_destination
from hs_patch.host.shipping.link import ConfigError, LinkError
from hs_patch.samples.files import RANGE, RANGED, ranged

SCHEME = "s3://"
MANIFEST = "manifest.jsonl"
SAMPLES = "samples"
SINGLE_PUT_MAX = 5 << 30  # S3's limit for one PUT (a plain-sha256 sample goes whole: its digest is of the whole)
ADDRESSING = ("auto", "path", "virtual")
CREDENTIALS_NAME = "s3"  # $CREDENTIALS_DIRECTORY/s3: the file systemd's LoadCredential= hands the shipper unit

# error codes that waiting does not cure (credentials, permissions, the bucket)
CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "AuthorizationHeaderMalformed", "InvalidSecurity", "TokenRefreshRequired"}
AUTH_CODES = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403", "401"}
BUCKET_CODES = {"NoSuchBucket", "InvalidBucketName", "PermanentRedirect", "IllegalLocationConstraintException"}
DIGEST_CODES = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidChecksum"}


class Refused(LinkError):
    """The store refused what waiting cannot cure (credentials, permissions, no such bucket): exit 1."""

    @property
    def permanent(self) -> bool:
        return True


class DigestRefused(Exception):
    """The store refused a body for its checksum: the bytes it got are not the bytes hashed here."""


class Raced(Exception):
    """A conditional write lost: another shipper wrote the object since it was looked at."""


@dataclass(frozen=True)
class BucketDest:
    bucket: str
    prefix: str  # without leading or trailing '/'; "" is the bucket's root

    host = None  # not an SSH destination

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def sample_key(self, file: str) -> str:
        return self.key(f"{SAMPLES}/{file}")


def parse_url(text: str) -> BucketDest:
    """``s3://BUCKET[/PREFIX]``; ConfigError saying what is wrong otherwise."""
    if not text.startswith(SCHEME):
        raise ConfigError(f"{text!r} is not an s3:// URL")
    bucket, _, prefix = text[len(SCHEME):].partition("/")
    prefix = prefix.strip("/")
    ok = 3 <= len(bucket) <= 63 and all(c.islower() or c.isdigit() or c in ".-" for c in bucket)
    if not ok or bucket[0] in ".-" or bucket[-1] in ".-":
        raise ConfigError(f"--dest {text!r}: {bucket!r} is not a bucket name (3 to 63 lower-case letters, digits, "
                          "'.' and '-'); give s3://BUCKET/PREFIX")
    if "//" in prefix or any(p in (".", "..") for p in prefix.split("/")) or "\0" in prefix:
        raise ConfigError(f"--dest {text!r}: the prefix must be plain names separated by single '/'")
    return BucketDest(bucket, prefix)


@dataclass
class S3Options:
    endpoint: str | None = None      # None: boto3's own (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)
    region: str | None = None        # None: boto3's own (AWS_REGION, AWS_DEFAULT_REGION, ~/.aws/config), else us-east-1
    addressing: str = "auto"         # path: https://host/bucket/key; virtual: https://bucket.host/key
    credentials: str | None = None   # an AWS shared-credentials file ([default]); None: boto3's chain
    concurrency: int = 8             # parts and objects in flight (each holds up to 64 MiB here)
    ca_bundle: str | None = None     # CA certificates for an endpoint with a private CA

    def check(self) -> None:
        if self.addressing not in ADDRESSING:
            raise ConfigError(f"--s3-addressing {self.addressing!r}: one of {', '.join(ADDRESSING)}")
        if not 1 <= self.concurrency <= 64:
            raise ConfigError("--s3-concurrency must be between 1 and 64")
        if self.endpoint and not self.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"--s3-endpoint {self.endpoint!r}: give http://HOST[:PORT] or https://HOST[:PORT]")
        if self.endpoint and "@" in self.endpoint.partition("//")[2].partition("/")[0]:
            raise ConfigError("--s3-endpoint must not hold credentials: give them in a credentials file "
                              "(--s3-credentials) or the environment")
        for name in ("credentials", "ca_bundle"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"--s3-{name.replace('_', '-')} {path} is not a readable file")


def default_credentials() -> str | None:
    """The credentials file systemd hands the shipper unit (LoadCredential=s3:...), if any."""
    d = os.environ.get("CREDENTIALS_DIRECTORY")
    path = Path(d) / CREDENTIALS_NAME if d else None
    return str(path) if path is not None and path.is_file() else None


def read_credentials(path: str) -> dict[str, str]:
    """The keys of an AWS shared-credentials file's [default] section (or its only one); never printed."""
    cp = configparser.ConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as f:
            cp.read_file(f)
    except (OSError, configparser.Error) as e:
        raise ConfigError(f"--s3-credentials {path}: cannot read it as an AWS credentials file "
                          f"({type(e).__name__})") from None
    sections = cp.sections()
    name = "default" if "default" in sections else (sections[0] if len(sections) == 1 else "")
    sec = cp[name] if name else {}
    keys = {k: sec.get(k, "").strip() for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")}
    if not keys["aws_access_key_id"] or not keys["aws_secret_access_key"]:
        raise ConfigError(f"--s3-credentials {path}: needs aws_access_key_id and aws_secret_access_key in a "
                          "[default] section")
    return {k: v for k, v in keys.items() if v}


def make_client(opts: S3Options, attempts: int = 3) -> Any:
    """A boto3 S3 client: bounded timeouts and retries (outages are the shipper's to ride out), no payload
    hashing by botocore (the SHA256 checksum header, signed, stands for the body and the store checks it)."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(**(read_credentials(opts.credentials) if opts.credentials else {}))
    config = Config(connect_timeout=20, read_timeout=120, retries={"max_attempts": attempts, "mode": "standard"},
                    max_pool_connections=opts.concurrency + 4, tcp_keepalive=True,
                    request_checksum_calculation="when_required", response_checksum_validation="when_required",
                    s3={"addressing_style": opts.addressing, "payload_signing_enabled": False})
    region = opts.region or session.region_name or "us-east-1"
    return session.client("s3", endpoint_url=opts.endpoint, region_name=region, config=config,
                          verify=opts.ca_bundle if opts.ca_bundle else None)


def b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def error_code(e: BaseException) -> tuple[str, int | None]:
    resp = getattr(e, "response", None) or {}
    return str((resp.get("Error") or {}).get("Code") or ""), (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")


def store_error(e: BaseException, what: str, dest: BucketDest, endpoint: str) -> BaseException:
    """What the shipper makes of a failed call: an outage it waits out (LinkError), a refusal (Refused),
    a body the store refused for its checksum (DigestRefused), or ``e`` itself (a bug: a traceback)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    where = f"{what} at {endpoint} ({dest})"
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return Refused(f"{where}: no S3 credentials: give --s3-credentials FILE (the sample_shipping role installs "
                       "one for the shipper unit) or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    if isinstance(e, ClientError):
        code, status = error_code(e)
        said = f"{where}: the store answered {status} {code}".rstrip()
        if code in DIGEST_CODES:
            return DigestRefused(said)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
            return Raced(said)
        if "quota" in code.lower() or code in ("EntityTooLarge", "StorageFull", "XMinioStorageFull"):
            return LinkError(f"{said}: the store is full or the bucket over its quota; free space or raise the "
                             "quota there, nothing is lost meanwhile (retried by itself)")
        if code in BUCKET_CODES or (code == "404" and what == "checking the bucket"):
            return Refused(f"{said}: bucket {dest.bucket!r} does not exist there (or is elsewhere): create it "
                           "(the shipper never creates buckets) or fix --dest / --s3-endpoint / --s3-region")
        if code in CREDENTIAL_CODES:
            return Refused(f"{said}: the store does not accept these credentials (the access key id is unknown "
                           "there, or the secret key is not its own): fix --s3-credentials (the sample_shipping role "
                           "installs them from the vault)")
        if code in AUTH_CODES or status in (401, 403):
            return Refused(f"{said}: the credentials are wrong, or lack a permission the shipper needs on bucket "
                           f"{dest.bucket!r} (docs/shipping.md, 'Shipping to an S3 bucket', has the policy), or that "
                           "bucket does not exist (a store answers 403 for a bucket the credentials may not see)")
        if status is None or status >= 500 or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable",
                                                       "InternalError", "RequestTimeTooSkewed"):
            return LinkError(f"{said} ({(e.response.get('Error') or {}).get('Message') or 'no message'}; a failing "
                             "store, or one that is full or over a quota, answers so): retried by itself")
        return Refused(f"{said}: {(e.response.get('Error') or {}).get('Message') or 'refused'}")
    if isinstance(e, BotoCoreError) or isinstance(e, (ConnectionError, TimeoutError)):
        return LinkError(f"{where}: {e}")
    return e


def head_holds(h: dict[str, Any] | None, size: int, sha256: str) -> bool:
    """Whether a HEAD's answer (None: no such object) is an object of ``size`` bytes with the manifest's digest."""
    return h is not None and h.get("ContentLength") == size and checksum_matches(h.get("ChecksumSHA256"), size, sha256)


def checksum_matches(stored: str | None, size: int, sha256: str) -> bool:
    """Whether the store's checksum of an object of ``size`` bytes (HEAD's ``ChecksumSHA256``: the base64
    sha256 of the body, or of its parts' digests with ``-N`` for a multipart upload) is the manifest's
    digest: a plain sha256, or a ranged one (one range: sha256 of the body's sha256; more: the composite)."""
    if not stored:
        return False
    text, dash, parts = stored.partition("-")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return False
    if sha256.startswith(RANGED):
        want = sha256[len(RANGED):]
        if dash:
            return parts.isdigit() and int(parts) == max(1, -(-size // RANGE)) and raw.hex() == want
        return size <= RANGE and hashlib.sha256(raw).hexdigest() == want
    return not dash and raw.hex() == sha256


class Bucket:
    """The store's primitives for one destination (thread-safe: one boto3 client, used from many threads)."""

    def __init__(self, dest: BucketDest, opts: S3Options):
        self.dest, self.opts = dest, opts
        self.s3 = make_client(opts)
        self.s3_once = make_client(opts, attempts=1)  # reads whose failures the caller judges itself
        self.endpoint = self.s3.meta.endpoint_url

    def under(self, name: str) -> Bucket:
        """The same store and clients, for PREFIX/name (a fleet host's part of a run)."""
        sub = copy.copy(self)
        sub.dest = BucketDest(self.dest.bucket, self.dest.key(name))
        return sub

    def call(self, what: str, fn: Callable[..., Any], **kw: Any) -> Any:
        try:
            return fn(**kw)
        except Exception as e:  # converted: an outage, a refusal, a digest refused, or raised as it is
            raise store_error(e, what, self.dest, self.endpoint) from None

    def check_bucket(self) -> None:
        """The bucket exists and these credentials may list its prefix (Refused or LinkError otherwise)."""
        self.call("checking the bucket", self.s3.list_objects_v2, Bucket=self.dest.bucket,
                  Prefix=self.dest.key(""), MaxKeys=1)

    def head(self, key: str) -> dict[str, Any] | None:
        """HEAD with the stored checksum; None if there is no such object."""
        from botocore.exceptions import ClientError
        try:
            return self.s3.head_object(Bucket=self.dest.bucket, Key=key, ChecksumMode="ENABLED")
        except ClientError as e:
            if error_code(e)[0] in ("404", "NoSuchKey", "NotFound"):
                return None
            raise store_error(e, f"HEAD {key}", self.dest, self.endpoint) from None
        except Exception as e:
            raise store_error(e, f"HEAD {key}", self.dest, self.endpoint) from None

    def list_samples(self) -> dict[str, dict[str, Any]]:
        """Every object under PREFIX/samples/: its key -> Size and ETag (one request per 1000)."""
        out: dict[str, dict[str, Any]] = {}
        kw: dict[str, Any] = {"Bucket": self.dest.bucket, "Prefix": self.dest.key(SAMPLES + "/")}
        while True:
            page = self.call("listing the samples", self.s3.list_objects_v2, **kw)
            for o in page.get("Contents") or []:
                out[o["Key"]] = {"Size": o.get("Size"), "ETag": o.get("ETag")}
            if not page.get("IsTruncated"):
                return out
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def read_back(self, key: str, like: str, tries: int = 2) -> tuple[int, str] | str:
        """(size, digest) of an object read back whole, of the kind of ``like`` (as files.file_digest); or why
        the store cannot give it back: it answers the GET with an error, twice, while it answers a HEAD of
        it (SeaweedFS answers 500 for a stored chunk that fails its own CRC). A store that does not answer
        at all is an outage (LinkError), never a reason to call a sample damaged."""
        from botocore.exceptions import ClientError
        said = "unreadable"
        for _ in range(tries):
            try:
                r = self.s3_once.get_object(Bucket=self.dest.bucket, Key=key)
                return digest_stream(r["Body"], like)
            except ClientError as e:
                code, status = error_code(e)
                if status is None or status < 500:
                    raise store_error(e, f"GET {key}", self.dest, self.endpoint) from None
                said = f"the store cannot read it back ({status} {code}: its own check of the stored bytes?)"
            except Exception as e:
                raise store_error(e, f"GET {key}", self.dest, self.endpoint) from None
        if self.head(key) is None:
            return "missing"
        return said

    # ------------------------------------------------------------------ the manifest

    def read_manifest(self) -> tuple[dict[str, dict[str, Any]], str | None]:
        """The manifest's live entries by key and its ETag (None: there is none yet)."""
        from botocore.exceptions import ClientError
        key = self.dest.key(MANIFEST)
        try:
            r = self.s3.get_object(Bucket=self.dest.bucket, Key=key)
            body = r["Body"].read()
        except ClientError as e:
            if error_code(e)[0] in ("NoSuchKey", "404"):
                return {}, None
            raise store_error(e, f"reading {key}", self.dest, self.endpoint) from None
        except Exception as e:
            raise store_error(e, f"reading {key}", self.dest, self.endpoint) from None
        try:
            return at_destination.entries_of(body.splitlines()), r["ETag"]
        except ValueError as e:
            raise Refused(f"{self.dest}/{MANIFEST}: {e}: repair it (hs-extract fetch "
                          "reads it too) before shipping more into it") from None

    def update_manifest(self, change: Callable[[dict[str, dict[str, Any]]], bool], tries: int = 30) -> int:
        """Apply ``change`` to the manifest's entries (it returns whether it changed them) and write it back
        only if nobody wrote it meanwhile (If-Match on its ETag; If-None-Match for a first one): shippers
        sharing a prefix (a reassigned shard and its host back) never lose each other's lines. Returns the
        number of entries."""
        from botocore.exceptions import ClientError
        key = self.dest.key(MANIFEST)
        for _ in range(tries):
            entries, etag = self.read_manifest()
            if not change(entries):
                return len(entries)
            body = at_destination.manifest_bytes(entries)
            cond = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            try:
                self.s3.put_object(Bucket=self.dest.bucket, Key=key, Body=body, ContentType="application/x-ndjson",
                                   ChecksumSHA256=b64(hashlib.sha256(body).digest()), **cond)
                return len(entries)
            except ClientError as e:
                if error_code(e)[0] not in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                    raise store_error(e, f"writing {key}", self.dest, self.endpoint) from None
            except Exception as e:
                raise store_error(e, f"writing {key}", self.dest, self.endpoint) from None
            time.sleep(random.uniform(0.05, 0.5))  # another shipper wrote it: read theirs, add ours again
        raise LinkError(f"{self.dest}/{MANIFEST} changed under each of {tries} writes: another shipper keeps "
                        "writing it; retried by itself")


def digest_stream(body: Any, like: str) -> tuple[int, str]:
    """(size, digest) of a stream, ranged (64 MiB ranges) if ``like`` is, else a plain sha256."""
    h, digests, size = hashlib.sha256(), [], 0
    ranges = like.startswith(RANGED)
    while True:
        chunk = body.read(min(8 << 20, RANGE - size % RANGE))
        if not chunk:
            break
        size += len(chunk)
        h.update(chunk)
        if ranges and size % RANGE == 0:
            digests.append(h.digest())
            h = hashlib.sha256()
    if not ranges:
        return size, h.hexdigest()
    if size % RANGE or not digests:
        digests.append(h.digest())
    return size, ranged(digests)
