"""What a model's files should be: their sizes and checksums, from the source's own metadata.

- the Hugging Face hub: the tree listing at a commit (``HfApi.list_repo_tree``, recursive):
  an LFS file's size and sha256, a git file's size and git blob id (sha1 of
  ``"blob <size>\\0" + content``);
- a mirror: its ``hs-model-manifest.json`` (:data:`MANIFEST`), which ``hs-model fetch``
  writes into every model directory it verified, so a verified directory, copied or served
  as it is, is a mirror.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Mapping

MANIFEST = "hs-model-manifest.json"
FORMAT = "hs-model-manifest/1"
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# Not model files: huggingface_hub's bookkeeping in a local_dir, our own records, partial downloads.
LOCAL_ONLY = (".cache/", ".hs-model-", MANIFEST)


class ModelSourceError(RuntimeError):
    """The source cannot say what the files are (unreachable, unknown revision, bad manifest): the message
    says what to do."""


@dataclass(frozen=True)
class FileSpec:
    """One file of the model as its source describes it: the size and at least one checksum."""

    size: int
    sha256: str = ""
    git_sha1: str = ""


@dataclass(frozen=True)
class Listing:
    """Every file of a model at one version of one source (``identity`` names both, for the records)."""

    identity: str
    files: Mapping[str, FileSpec]

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files.values())


def hub_identity(endpoint: str, repo: str, revision: str) -> str:
    return f"hub {endpoint.rstrip('/')} {repo}@{revision}"


def hub_listing(repo: str, revision: str, *, endpoint: str, token: str | None = None) -> Listing:
    """The hub's tree listing of ``repo`` at the commit ``revision`` (huggingface_hub, any version since 0.20)."""
    if not COMMIT.match(revision):
        raise ModelSourceError(f"revision {revision!r} is not a commit (40 hex characters): pin the commit you "
                               "validated, as the hub's branches move (hs_model_revision)")
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile
    except ImportError as e:
        raise ModelSourceError(f"huggingface_hub is not importable here ({e}): SGLang's install brings it into the "
                               "venv; with a wheelhouse, the wheelhouse must hold it") from None
    try:
        entries = list(HfApi(endpoint=endpoint, token=token or False).list_repo_tree(
            repo, revision=revision, recursive=True))
    except Exception as e:  # noqa: BLE001 - any failure to list is the finding, said with the source
        raise ModelSourceError(f"{endpoint} could not list {repo} at {revision}: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''} (the repository name, the revision, "
                               "the network to the hub, and a token for a gated or private repository)") from None
    files = {}
    for e in entries:
        if not isinstance(e, RepoFile):
            continue
        if e.lfs is not None:
            files[e.path] = FileSpec(int(e.size), sha256=str(e.lfs.sha256))
        else:
            files[e.path] = FileSpec(int(e.size), git_sha1=str(e.blob_id))
    if not files:
        raise ModelSourceError(f"{endpoint} lists no file in {repo} at {revision}")
    return Listing(hub_identity(endpoint, repo, revision), files)


def manifest_listing(text: str, where: str) -> Listing:
    """The listing a manifest holds (``where``: the manifest's URL or path, for the messages)."""
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, not {FORMAT!r}")
        files = {}
        for path, spec in doc["files"].items():
            if not isinstance(path, str) or path.startswith("/") or ".." in path.split("/") or not path:
                raise ValueError(f"file name {path!r} leaves the model directory")
            files[path] = FileSpec(int(spec["size"]), sha256=str(spec.get("sha256") or ""),
                                   git_sha1=str(spec.get("git_sha1") or ""))
            if not (files[path].sha256 or files[path].git_sha1) or files[path].size < 0:
                raise ValueError(f"{path}: no checksum or a negative size")
        return Listing(str(doc["identity"]), files)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelSourceError(f"{where} is not a usable model manifest ({e}): write it with hs-model fetch or "
                               "hs-model verify on a verified copy") from None


def manifest_text(listing: Listing) -> str:
    """A manifest for ``listing`` (every file with its sha256 once verified: see verify.write_records)."""
    files: dict[str, Any] = {}
    for path, spec in sorted(listing.files.items()):
        files[path] = {k: v for k, v in asdict(spec).items() if v != ""}
    return json.dumps({"format": FORMAT, "identity": listing.identity, "files": files}, indent=1) + "\n"


def is_model_file(path: str) -> bool:
    """False for the files a model directory holds that are not the model's (records, caches, partials)."""
    return not any(path == p or path.startswith(p) for p in LOCAL_ONLY)
