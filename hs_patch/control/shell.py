"""Commands on the GPU host, as root, every argument quoted.

fab needs root there (systemctl, the run directories), like the playbooks (``become:
true``). :class:`Shell` wraps a fabric ``Connection``: when the inventory's SSH user is
not root, each command runs as ``sudo -- sh -c '<command>'`` (``sudo -n`` without a
password; with ``ansible_become_password`` sudo reads it from stdin, never from the
command line). Commands are argument lists (:func:`cmd` quotes each with
``shlex.quote``); the few shell constructs (``||``, ``2>/dev/null``) are joined
around already quoted pieces, so a host name, path or run name can never become shell
syntax on the host.
"""

from __future__ import annotations

import re
import secrets
import shlex
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from hs_patch.control.inventory import Target


class RemoteError(RuntimeError):
    """A remote step failed; the message says what to do."""


class StatusUnreadable(RemoteError):
    """The host answered, but a run's status could not be read there (the dashboards say so, not "no answer")."""


def silence(why: Any, seconds: float) -> str:
    """How a dashboard says a host or a row has given no status for ``seconds`` (``why``: the last failure)."""
    if isinstance(why, StatusUnreadable):
        return f"answers, but no status read for {seconds:.0f} s ({why})"
    return f"no answer for {seconds:.0f} s ({why})"


def cmd(*argv: Any) -> str:
    """One shell-safe command line: every argument quoted."""
    return shlex.join(str(a) for a in argv)


class Shell:
    """Run commands on ``target`` through ``conn`` (a fabric Connection, or a stand-in with
    ``.host``, ``.run(command, **kw)`` and ``.put(local, remote)``)."""

    def __init__(self, conn: Any, target: Target):
        self.conn = conn
        self.target = target
        self.host = target.host
        self._prompt = f"[hs-fab sudo {secrets.token_hex(4)}] "

    def wrap(self, command: str) -> str:
        """The command as the host's shell receives it (sudo to root when the user is not root)."""
        if not self.target.become:
            return command
        if self.target.become_password:
            return cmd("sudo", "-S", "-p", self._prompt, "-H", "--", "sh", "-c", command)
        return cmd("sudo", "-n", "-H", "--", "sh", "-c", command)

    def run(self, command: str | Sequence[Any], *, check: bool = False, timeout: int | None = 120,
            as_root: bool = True) -> Any:
        """Run ``command`` (an argument list, or a line built with :func:`cmd`); output hidden.
        ``check`` raises RemoteError on failure, and every command past ``timeout`` s does. ``as_root=False`` runs
        as the SSH user."""
        line = command if isinstance(command, str) else cmd(*command)
        kw: dict[str, Any] = {}
        if as_root and self.target.become and self.target.become_password:
            from invoke import FailingResponder

            kw["watchers"] = [FailingResponder(pattern=re.escape(self._prompt),
                                               response=self.target.become_password + "\n",
                                               sentinel="Sorry, try again.")]
        from invoke.exceptions import CommandTimedOut, Failure

        try:
            with self.connection_errors():
                r = self.conn.run(self.wrap(line) if as_root else line, hide=True, warn=True, in_stream=False,
                                  timeout=timeout, **kw)
        except CommandTimedOut:  # raised whatever warn says: a traceback to the operator without this
            raise RemoteError(f"on {self.host}: `{line}` did not finish within {timeout} s (the host or the "
                              "connection is slow or stuck); check the host, then run the same command again") from None
        except Failure as e:  # the sudo watcher's: sudo asked for the password again, having refused it
            raise RemoteError(f"on {self.host}: sudo refused ansible_become_password for {self.target.user} "
                              f"({type(e.reason).__name__}); correct it in the inventory (or its vault), or allow "
                              "NOPASSWD sudo") from None
        if as_root and self.target.become and r.failed and "a password is required" in (r.stderr or ""):
            raise RemoteError(f"on {self.host}: sudo asks {self.target.user} for a password: set "
                              "ansible_become_password in the inventory (vault it), or allow NOPASSWD sudo")
        if check and r.failed:
            raise RemoteError(f"on {self.host}: `{line}` failed ({r.exited}): {(r.stderr or r.stdout).strip()[-800:]}")
        return r

    @contextmanager
    def connection_errors(self) -> Iterator[None]:
        """A host that dies, reboots or drops the connection mid-command (Fabric opens it again for the next
        command, and that fails): a RemoteError saying so, not paramiko's traceback."""
        from paramiko.ssh_exception import SSHException

        try:
            yield
        except (SSHException, OSError, EOFError) as e:
            raise RemoteError(f"lost the connection to {self.host} ({type(e).__name__}: {e}): the host is down, "
                              "rebooting or unreachable; a job already started there goes on by itself: once it "
                              f"answers, `fab status --host {self.host}` shows it, and the same command can be run "
                              "again") from None

    def put(self, local: Path, remote: str, *, owner: str, mode: str = "0640") -> None:
        """Copy a local file to ``remote`` owned by ``owner`` (SFTP runs as the SSH user, so
        it lands in a private temp file first and root installs it). Opened here first: a local file that cannot
        be read is its own OSError, not taken for a lost connection."""
        with open(local, "rb") as f:
            tmp = self.run(["mktemp"], check=True, as_root=False).stdout.strip()
            if not tmp.startswith("/"):
                raise RemoteError(f"on {self.host}: mktemp gave {tmp!r}")
            try:
                with self.connection_errors():
                    self.conn.put(f, tmp)
                self.run(["install", "-o", owner, "-g", owner, "-m", mode, tmp, remote], check=True)
            finally:
                self.run(["rm", "-f", tmp], as_root=False)
