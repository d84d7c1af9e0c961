"""``hs-model``: place the served model on this host, verified, and check it later.

    hs-model fetch --dest DIR --source hub --repo ORG/NAME --revision COMMIT [--endpoint URL] [--token-file F]
    hs-model fetch --dest DIR --source http|rsync --url URL [--token-file F]
    hs-model verify DIR [--full]

Run by the model stage of site.yml (playbooks/model.yml), as root, with the venv's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from hs_patch.host.model import fetch as dl
from hs_patch.host.model.listing import (MANIFEST, Listing, ModelSourceError, hub_identity, hub_listing,
                                         manifest_listing)
from hs_patch.host.model.verify import Finding, check_dir, forget, readable_by_all, unchanged, write_records
from hs_patch.samples.files import quiet_when_stdout_closes

EXIT_OK, EXIT_SOURCE, EXIT_ROOM, EXIT_DAMAGED, EXIT_NOTHING = 0, 1, 2, 3, 5

DESCRIPTION = """\
Place a model on this host from its source and verify every file against the source's own
metadata (size and sha256, or the hub's git blob id), or verify a model directory again.

sources: hub (the Hugging Face hub, or a mirror of its API, at a pinned commit: huggingface_hub's
downloader, resumable file by file), http (a web server serving a verified model directory with its
hs-model-manifest.json: resumable within a file), rsync (host:/dir, rsync://host/module/dir or a local
path, with its manifest: resumable within a file).

A verified directory holds hs-model-manifest.json (every file's size and sha256: the directory can
serve as a mirror) and .hs-model-verified.json (sizes and times): a later fetch or verify that finds
every file unchanged since returns at once, without the network (--full reads every file again).
A damaged file is fetched once more; if the source sends it damaged again, it is removed and refused.

exit codes: 0 in place and verified, 1 the source failed (unreachable, unknown revision, bad manifest),
2 not enough free space (nothing downloaded), 3 a file is damaged or missing, 5 nothing to check
(verify: no manifest in the directory)
"""


def _token(path: str | None) -> str | None:
    if not path:
        return None
    text = Path(path).read_text().strip()
    return text or None


def _source_key(a: argparse.Namespace) -> str:
    return hub_identity(a.endpoint, a.repo, a.revision) if a.source == "hub" else f"{a.source} {a.url.rstrip('/')}"


def _listing(a: argparse.Namespace, token: str | None) -> Listing:
    if a.source == "hub":
        return hub_listing(a.repo, a.revision, endpoint=a.endpoint, token=token)
    return dl.http_manifest(a.url, token) if a.source == "http" else dl.rsync_manifest(a.url)


def _download(a: argparse.Namespace, root: Path, listing: Listing, names: list[str], token: str | None) -> None:
    if a.source == "hub":
        dl.hub_download(root, a.repo, a.revision, endpoint=a.endpoint, token=token, workers=a.workers)
    elif a.source == "http":
        dl.http_download(root, a.url, listing, names, token)
    else:
        dl.rsync_download(root, a.url, names)


def _drop(a: argparse.Namespace, root: Path, path: str) -> None:
    if a.source == "hub":
        dl.forget_hub_file(root, path)
    else:
        (root / path).unlink(missing_ok=True)


def fetch(a: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    started = time.monotonic()
    root = Path(a.dest)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    source = _source_key(a)
    same, when = unchanged(root, source)
    if same and not a.full:
        return EXIT_OK, {"changed": False, "message": f"{root}: in place from {source}, verified {when}, unchanged since"}
    token = _token(a.token_file)
    listing = _listing(a, token)
    need, free = dl.room(root, listing)
    if a.plan:
        return EXIT_OK, {"changed": need > 0, "message": f"{root}: {need / 2**30:.1f} GiB to download from {source} "
                         f"({free / 2**30:.1f} GiB free), then {len(listing.files)} file(s) to verify"}
    forget(root)
    _, missing = dl.missing_bytes(root, listing)
    if missing:
        _download(a, root, listing, missing, token)
    findings = check_dir(root, listing)
    bad = [f.path for f in findings if f.problem]
    if bad:  # fetched once more: a transfer can go wrong once; a source that sends it wrong twice is refused
        for path in bad:
            _drop(a, root, path)
        _download(a, root, listing, bad, token)
        again = {f.path: f for f in check_dir(root, listing, only=bad)}
        findings = [again.get(f.path, f) for f in findings]
    damaged: list[Finding] = [f for f in findings if f.problem]
    if damaged:
        for f in damaged:
            _drop(a, root, f.path)
        return EXIT_DAMAGED, {"changed": True, "message": f"{root}: {len(damaged)} file(s) do not match what {source} "
                              "says they are, twice, and were removed: " + "; ".join(
                                  f"{f.path}: {f.problem}" for f in damaged[:5]) + (" ..." if len(damaged) > 5 else "")
                              + ". The source serves them damaged (or its listing is wrong): check the mirror's copy "
                              f"(hs-model verify on it), then run the play again"}
    write_records(root, source, listing, findings)
    readable_by_all(root, listing)
    return EXIT_OK, {"changed": True, "message": f"{root}: {len(listing.files)} file(s), {listing.total / 2**30:.1f} "
                     f"GiB from {source}, {len(missing)} downloaded ({need / 2**30:.1f} GiB), every file verified "
                     f"(size and checksum) in {time.monotonic() - started:.0f}s"}


def verify(a: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    root = Path(a.dir)
    try:
        listing = manifest_listing((root / MANIFEST).read_text(), str(root / MANIFEST))
    except FileNotFoundError:
        return EXIT_NOTHING, {"changed": False, "message": f"{root} has no {MANIFEST}: nothing to check its files "
                              "against (a model placed by hand is checked by the services role's model check only)"}
    source = str(json.loads((root / ".hs-model-verified.json").read_text()).get("source", "")) \
        if (root / ".hs-model-verified.json").exists() else f"manifest {root}"
    same, when = unchanged(root, source)
    if same and not a.full:
        return EXIT_OK, {"changed": False, "message": f"{root}: verified {when}, unchanged since"}
    findings = check_dir(root, listing)
    damaged = [f for f in findings if f.problem]
    if damaged:
        forget(root)
        return EXIT_DAMAGED, {"changed": False, "message": f"{root}: {len(damaged)} file(s) do not match its "
                              f"{MANIFEST}: " + "; ".join(f"{f.path}: {f.problem}" for f in damaged[:5])
                              + ". Fetch the model again (hs_model_source) or copy those files again"}
    write_records(root, source, listing, findings)
    return EXIT_OK, {"changed": True, "message": f"{root}: {len(listing.files)} file(s) match its {MANIFEST}"}


@quiet_when_stdout_closes
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hs-model", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    f = sub.add_parser("fetch", help="place a model from its source, verified")
    f.add_argument("--dest", required=True, help="the model directory (hs_model_path)")
    f.add_argument("--source", required=True, choices=["hub", "http", "rsync"])
    f.add_argument("--repo", help="hub: ORG/NAME")
    f.add_argument("--revision", help="hub: the commit (40 hex characters)")
    f.add_argument("--endpoint", default="https://huggingface.co", help="hub: its address (or a mirror of its API)")
    f.add_argument("--url", help="http or rsync: where the mirror's copy of the directory is")
    f.add_argument("--token-file", help="a file holding the hub token (or the mirror's bearer token); never printed")
    f.add_argument("--workers", type=int, default=8, help="hub: files downloaded at once (default 8)")
    f.add_argument("--plan", action="store_true", help="list and check free space only; download nothing")
    f.add_argument("--full", action="store_true", help="read every file again even when unchanged since verified")
    v = sub.add_parser("verify", help="check a model directory against its hs-model-manifest.json")
    v.add_argument("dir")
    v.add_argument("--full", action="store_true", help="read every file again even when unchanged since verified")
    for p in (f, v):
        p.add_argument("--json", action="store_true", help="print one JSON object (for Ansible)")
    a = ap.parse_args(argv)
    # huggingface_hub reads these when first imported: no progress bars in a log, nothing sent but the download
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if a.command == "fetch" and a.source == "hub" and not (a.repo and a.revision):
        ap.error("--source hub needs --repo and --revision")
    if a.command == "fetch" and a.source != "hub" and not a.url:
        ap.error(f"--source {a.source} needs --url")
    try:
        rc, res = fetch(a) if a.command == "fetch" else verify(a)
    except ModelSourceError as e:
        rc, res = EXIT_SOURCE, {"changed": False, "message": str(e)}
    except dl.RoomError as e:
        rc, res = EXIT_ROOM, {"changed": False, "message": str(e)}
    res["rc"] = rc
    print(json.dumps(res) if a.json else res["message"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
