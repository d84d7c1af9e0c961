"""fab's options: one short flag per option in every task, and a bad value said in one line.

Invoke gives each task's options the first free letter of their names, task by task, so one
option got different letters in different tasks (``--hosts`` was ``-o`` in ``extract`` and
``-s`` in ``status``, where ``-s`` was ``--server-timeout`` or ``--server`` elsewhere), and a
value its type refuses (``--limit abc``) ended in a traceback. Tasks made with
``@task(klass=FabTask)`` take their letters from :data:`SHORT` and report such a value as a
parse error: one line saying what to give. A mistyped task or option (``fab extrct``,
``--hots``) is answered with the nearest one (:func:`suggest_nearest`).
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Optional

from fabric.tasks import Task
from invoke.exceptions import ParseError
from invoke.parser import Argument

# option (the task function's parameter) -> its short flag, the same in every task
SHORT = {
    "host": "h", "hosts": "o", "inventory": "i", "extra_vars": "e", "vault_password_file": "v",
    "ask_vault_pass": "a", "known_hosts": "k", "run": "r", "dataset": "d", "limit": "l", "regenerate": "g",
    "remote_dataset": "m", "interval": "n", "detach": "t", "server_timeout": "w", "server": "s", "once": "p",
    "dead_after": "u", "max_tokens": "x",
}


class _CheckedArgument(Argument):
    def set_value(self, value: Any, cast: bool = True) -> None:
        try:
            super().set_value(value, cast)
        except ValueError:
            kind = "a whole number" if self.kind is int else f"a {getattr(self.kind, '__name__', 'value')}"
            raise ParseError(f"--{self.name.replace('_', '-')} takes {kind}, not {value!r}") from None


class FabTask(Task):
    """A fab task whose options have the short flags of :data:`SHORT` and parse errors in one line."""

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        opts = super().arg_opts(name, default, taken_names)
        opts["names"] = opts["names"][:1] + ([SHORT[name]] if name in SHORT else [])
        return opts

    def get_arguments(self, ignore_unknown_help: Optional[bool] = None) -> list[Argument]:
        args = super().get_arguments(ignore_unknown_help)
        for arg in args:  # Invoke builds plain Arguments; ours only adds the one-line refusal
            arg.__class__ = _CheckedArgument
        return args


_UNKNOWN = re.compile(r"No idea what '(.+)' is!$")


def suggest_nearest() -> None:
    """Make fab's 'No idea what 'extrct' is!' name the nearest task (or, for an option, the nearest option of
    the task): Invoke's parser says only that. Its parser is reached through the one method it raises with
    (``ParseMachine.error``); an Invoke without it keeps its own words."""
    from invoke.parser import parser

    machine = getattr(parser, "ParseMachine", None)
    plain = getattr(machine, "error", None)
    if plain is None or getattr(plain, "nearest", False):
        return

    def error(self: Any, msg: str) -> None:
        m = _UNKNOWN.match(msg)
        if m:
            token = m.group(1)
            if token.startswith("-"):
                known = [n for n in getattr(self.context, "flags", {}) if n.startswith("--")]
                where = f"fab --help {self.context.name} lists its options" if getattr(self.context, "name", None) \
                    else "fab --help lists the options"
            else:
                known = [n for n in self.contexts if "." not in n]
                where = "fab --list shows the tasks"
            near = difflib.get_close_matches(token, known, n=1, cutoff=0.75)
            msg += (f" Did you mean {near[0]!r}? " if near else " ") + f"({where})"
        plain(self, msg)

    error.nearest = True  # type: ignore[attr-defined]
    machine.error = error
