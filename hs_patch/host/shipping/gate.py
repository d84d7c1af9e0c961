"""The shipping key's forced command, run ON the training storage host: only what the shipper runs.

The sample_shipping role installs this file and ``at_destination.py`` (root-owned) on the
storage host and authorizes the GPU host's shipping key with
``restrict,command="python3 .../gate.py ROOT"``. sshd then runs this instead of whatever
the client asked for (``$SSH_ORIGINAL_COMMAND``), and it lets through exactly:

- ``rsync --server`` RECEIVING into ``ROOT/<dirs>/.incoming/`` with the options
  ``hs_patch.host.shipping.link.Link.send`` uses (``-t``, ``-R``, ``-I``, ``--timeout``,
  ``--bwlimit``, ``--partial-dir .rsync-partial``, ``--compare-dest ../samples``): no
  ``--sender`` (nothing is read back), no links, devices, owners or deletes;
- ``python3 -c SOURCE`` when SOURCE is byte for byte the ``at_destination.py`` installed
  next to this file (the verify-and-commit step), for a request whose ``root`` is under ROOT;
  the installed copy runs, not the text sent;
- ``df -Pk PATH`` for PATH under ROOT (fab's preflight: free space);
- ``rsync --version`` (the role's connection check).

Anything else is refused (exit 1, a one-line reason on stderr). Standard library only.
"""
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VERIFY = os.path.join(HERE, "at_destination.py")
MAX_REQUEST = 16 << 20
SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@+-]{0,127}$")
RSYNC_FLAGS = set("tRIv")  # --times, --relative (--files-from), --ignore-times, -v
RSYNC_VALUE_OPTS = {"--partial-dir": ".rsync-partial", "--compare-dest": "../samples"}
RSYNC_NUMBER_OPTS = ("--timeout", "--bwlimit")
RSYNC_EXACT = ("-@-1",)  # --modify-window=-1: mtimes compared to the nanosecond (rsync >= 3.1.3)


class Refused(Exception):
    pass


def under(root, path, *, incoming=False):
    """``path`` normalized, if it is ROOT or below it (each part plain; ``.incoming`` last if asked)."""
    if not path.startswith("/") or "\0" in path:
        raise Refused("path %r is not absolute" % path)
    norm = posixpath.normpath(path)
    parts = norm.split("/")
    if ".." in path.split("/") or not (norm == root or norm.startswith(root.rstrip("/") + "/")):
        raise Refused("path %r is outside %s" % (path, root))
    rest = parts[len(root.rstrip("/").split("/")):]
    if incoming and (len(rest) < 2 or rest[-1] != ".incoming"):
        raise Refused("rsync may only write into DIR/.incoming/ under %s, not %r" % (root, path))
    for part in rest[:-1] if incoming else rest:
        if not SAFE_PART.match(part):
            raise Refused("path part %r of %r is not a plain name" % (part, path))
    return norm


def check_rsync(root, args):
    """Validate ``rsync --server ARGS`` (what rsync's client runs for a push) and return argv."""
    if args[:1] != ["--server"]:
        raise Refused("not an rsync server command")
    positional, i = [], 1
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if a.startswith("--"):
            if name in RSYNC_VALUE_OPTS:
                if not eq:
                    i += 1
                    value = args[i] if i < len(args) else ""
                if value != RSYNC_VALUE_OPTS[name]:
                    raise Refused("rsync %s %r is not the shipper's" % (name, value))
            elif name in RSYNC_NUMBER_OPTS and eq and value.isdigit():
                pass
            else:
                raise Refused("rsync option %r is not one the shipper uses" % a)
        elif a in RSYNC_EXACT:
            pass
        elif a.startswith("-"):
            flags, _, caps = a[1:].partition("e")  # -tRe.LsfxCIvu: flags, then -e's protocol capabilities
            if not flags or not set(flags) <= RSYNC_FLAGS or not re.match(r"^[.A-Za-z]*$", caps):
                raise Refused("rsync flags %r: only -%s" % (a, "".join(sorted(RSYNC_FLAGS))))
        else:
            positional.append(a)
        i += 1
    if len(positional) != 2 or positional[0] != ".":
        raise Refused("not an rsync push into one directory")
    under(root, positional[1], incoming=True)
    return ["rsync"] + args


def check_verify(root, source):
    """Run the installed verify step when ``source`` is exactly it; the request's root must be under ROOT."""
    with open(VERIFY, encoding="utf-8") as f:
        if source != f.read():
            raise Refused("the verify step sent is not the one installed in %s: re-run the shipping role "
                          "(ansible-playbook playbooks/shipping.yml) so both ends run the same hs-patch" % HERE)
    data = sys.stdin.buffer.read(MAX_REQUEST + 1)
    if len(data) > MAX_REQUEST:
        raise Refused("verify request larger than %d bytes (give hs-extract ship a smaller --batch-files)"
                      % MAX_REQUEST)
    try:
        req = json.loads(data)
        under(root, os.path.expanduser(req["root"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise Refused("verify request without a valid root")
    proc = subprocess.run([sys.executable, VERIFY], input=data, stdout=sys.stdout.buffer, stderr=sys.stderr.buffer)
    return proc.returncode


def main(argv):
    if len(argv) != 2 or not argv[1].startswith("/"):
        print("hs-ingest-gate: usage: gate.py ROOT (from the forced command in authorized_keys)", file=sys.stderr)
        return 2
    root = posixpath.normpath(argv[1])
    line = os.environ.get("SSH_ORIGINAL_COMMAND", "")
    try:
        try:
            words = shlex.split(line)
        except ValueError:
            raise Refused("unparsable command")
        if words == ["rsync", "--version"]:
            os.execv(shutil.which("rsync") or "/usr/bin/rsync", words)
        if words[:2] == ["rsync", "--server"]:
            cmd = check_rsync(root, words[1:])
            os.execv(shutil.which("rsync") or "/usr/bin/rsync", cmd)
        if len(words) == 3 and words[0] in ("python3", "python") and words[1] == "-c":
            return check_verify(root, words[2])
        if len(words) == 3 and words[:2] == ["df", "-Pk"]:
            os.execv(shutil.which("df") or "/bin/df", ["df", "-Pk", under(root, words[2])])
        raise Refused("not a command the shipper runs")
    except Refused as e:
        shown = line if len(line) < 200 else line[:200] + "..."
        print("hs-ingest-gate: refused %r: %s. This key may only run the hs-patch shipper's rsync, verify and "
              "df under %s." % (shown, e, root), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
