"""What ``fab`` needs to know about a GPU host, asked of Ansible itself.

Ansible's own ``InventoryManager`` and ``VariableManager`` read the inventory, in this
process, exactly as ``ansible-playbook -i SOURCE`` would: a file or a directory (or a
comma-separated host list), ``group_vars/`` and ``host_vars/`` files or directories
(``.yml``, ``.yaml``, ``.json``), vault-encrypted values (with the vault password that
``ansible.cfg``, ``$ANSIBLE_VAULT_PASSWORD_FILE``, ``--vault-password-file`` or
``--ask-vault-pass`` gives), extra variables (``--extra-vars``, Ansible's ``-e`` syntax:
``k=v``, JSON/YAML or ``@file``) over everything, and Jinja values rendered with the
host's own variables. So fab and the playbooks cannot disagree about a host.

The inventory is, in order: ``--inventory``, ``$HS_INVENTORY``, the one ``ansible.cfg`` or
``$ANSIBLE_INVENTORY`` names, else this repository's ``inventory/``.

Connection: ``ansible_host``, ``ansible_port``, ``ansible_user``,
``ansible_ssh_private_key_file`` (or ``ansible.cfg``'s ``remote_user``/``remote_port``/
``private_key_file``), ``UserKnownHostsFile`` from ``ansible_ssh_common_args``/
``ansible_ssh_extra_args``. fab needs root on the GPU host (systemctl, the run dirs), as
the playbooks do (``become: true``): a non-root SSH user becomes root with sudo
(``ansible_become_method`` must be sudo, ``ansible_become_user`` root), with
``ansible_become_password`` when the inventory holds one (vault it), else ``sudo -n``.

:func:`load` gives one host's :class:`Target`, :func:`load_group` every host of a group
(for ``fab extract --hosts GROUP``). One :class:`Inventory` answers both without
re-reading the files.
"""

from __future__ import annotations

import functools
import getpass
import os
import re
import shlex
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import yaml

from hs_patch import names
REPO = Path(__file__).resolve().parents[2]
REPO_INVENTORY = REPO / "inventory"


class ConfigError(ValueError):
    """The inventory or an option is unusable; the message says what to fix."""


@functools.lru_cache(maxsize=None)
def role_default(role: str, var: str) -> Any:
    """``var``'s default in the role's ``defaults/main.yml``: what the role uses when the inventory
    does not set it, so fab falls back to the same value, defined once."""
    return yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())[var]


@dataclass
class Target:
    host: str                       # address fab connects to (ansible_host, else the inventory name)
    name: str = ""                  # inventory name
    user: str = "root"
    port: int = 22
    key_file: str | None = None
    known_hosts: str | None = None
    become: bool = False            # sudo to root (the SSH user is not root)
    become_password: str | None = field(default=None, repr=False)
    # hs_* knobs (inventory/group_vars/gpu_hosts.yml documents each)
    venv: str = "/opt/hs-patch/venv"
    service: str = field(default_factory=lambda: str(role_default("sglang_service", "sglang_service_name")))
    service_user: str = "sglang"
    server_port: int = 30000
    api_key_file: str = "/var/lib/sglang/api-key"
    model_path: str = "/models/Kimi-K2.5"
    dump_dir: str = "/dev/shm/hs_capture"
    capture_layers: list[int] = field(default_factory=lambda: [2, 30, 58])
    capture_final: str = "both"
    gpu_count: int = 8
    gpu_model: str = "NVIDIA RTX PRO 6000 Blackwell"
    ship_enabled: bool = True
    storage_alias: str = "hs-storage"
    storage_dir: str = "/srv/hs-samples"
    s3_url: str = ""                # s3://BUCKET/PREFIX: ship there instead of the storage host (hs_patch.control.storage)
    s3_endpoint: str = ""
    s3_region: str = ""
    s3_addressing: str = "auto"
    s3_concurrency: int = 8
    s3_credentials_file: str = field(default_factory=lambda: str(role_default("sample_shipping",
                                                                               "sample_shipping_s3_credentials_file")))
    state_root: str = "/var/lib/hs-patch/runs"
    samples_root: str = "/dev/shm/hs-runs"
    trust_remote_code: bool = True
    # where the services role installs the host checks (its gpu-ready wrapper)
    check_dir: str = field(default_factory=lambda: str(role_default("sglang_service", "sglang_service_check_dir")))

    def state_dir(self, run: str) -> str:
        return f"{self.state_root}/{run}"

    def samples_dir(self, run: str) -> str:
        return f"{self.samples_root}/{run}/samples"

    def bin(self, name: str) -> str:
        return f"{self.venv}/bin/{name}"


# inventory variable -> Target field (the first variable found wins for a field)
_KNOBS = {
    "hs_venv": "venv", "sglang_service_name": "service", "hs_service_user": "service_user",
    "hs_server_port": "server_port", "hs_server_api_key_file": "api_key_file", "hs_model_path": "model_path",
    "hs_dump_dir": "dump_dir", "hs_capture_layers": "capture_layers", "hs_capture_final": "capture_final",
    "hs_gpu_count": "gpu_count", "hs_gpu_model": "gpu_model", "hs_ship_enabled": "ship_enabled",
    "sample_shipping_ssh_alias": "storage_alias", "hs_storage_dir": "storage_dir",
    "hs_runs_state_root": "state_root", "hs_runs_samples_root": "samples_root",
    "ansible_port": "port", "ansible_ssh_port": "port",
    "ansible_ssh_private_key_file": "key_file", "ansible_private_key_file": "key_file",
    "hs_known_hosts_file": "known_hosts", "sglang_service_check_dir": "check_dir",
    "hs_s3_url": "s3_url", "hs_s3_endpoint": "s3_endpoint", "hs_s3_region": "s3_region",
    "hs_s3_addressing": "s3_addressing", "hs_s3_concurrency": "s3_concurrency",
    "sample_shipping_s3_credentials_file": "s3_credentials_file",
}
# names that reach command lines on the host: refused unless plain (remote.py quotes them too)
_NAMES = {"service": re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,100}$"),
          "service_user": re.compile(r"^[a-z_][a-z0-9_-]{0,31}$"),
          "storage_alias": re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$"),
          "s3_url": re.compile(r"^(|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9_.@+=-]+)*/?)$"),
          "s3_endpoint": re.compile(r"^(|https?://[A-Za-z0-9.:\[\]-]+(/[A-Za-z0-9_./-]*)?)$"),
          "s3_region": re.compile(r"^[a-z0-9-]{0,40}$"), "s3_addressing": re.compile(r"^(auto|path|virtual)$")}
_PATHS = ("venv", "dump_dir", "model_path", "storage_dir", "state_root", "samples_root", "api_key_file", "check_dir",
          "s3_credentials_file")
_UNIT_PATHS = ("dump_dir", "state_root", "samples_root")  # in the job units' ReadWritePaths= (remote.unit_hardening)


def default_source() -> str:
    """--inventory's default: $HS_INVENTORY, ansible.cfg's or $ANSIBLE_INVENTORY's, else inventory/."""
    if os.environ.get("HS_INVENTORY"):
        return os.environ["HS_INVENTORY"]
    from ansible import constants as C

    value, origin = C.config.get_config_value_and_origin("DEFAULT_HOST_LIST")
    if origin != "default" and value:
        return ",".join(value) if isinstance(value, list) else str(value)
    return str(REPO_INVENTORY)


def _check_source(source: str) -> None:
    if "," in source:  # Ansible's host list ("a,b,") or several sources
        for part in filter(None, (p.strip() for p in source.split(","))):
            if "/" in part and not Path(part).exists():
                raise ConfigError(f"no inventory at {part}: pass --inventory FILE|DIR or set HS_INVENTORY")
        return
    if not Path(source).exists():
        raise ConfigError(f"no inventory at {source}: pass --inventory FILE|DIR (a hosts.yml or the directory "
                          "holding it) or set HS_INVENTORY")


class Inventory:
    """One read of an Ansible inventory (with its vault secrets and extra vars)."""

    def __init__(self, source: str | None = None, *, extra_vars: Sequence[str] = (),
                 vault_password_files: Sequence[str] = (), ask_vault_pass: bool = False):
        from ansible import constants as C
        from ansible import context
        from ansible.cli import CLI
        from ansible.errors import AnsibleError
        from ansible.inventory.manager import InventoryManager
        from ansible.module_utils.common.collections import ImmutableDict
        from ansible.parsing.dataloader import DataLoader
        from ansible.parsing.vault import VaultSecretsContext
        from ansible.utils import vars as ansible_vars
        from ansible.vars.manager import VariableManager

        self.source = source or default_source()
        self.overrides: dict[str, Any] = {}  # applied to every target (fab's --known-hosts)
        _check_source(self.source)
        for f in vault_password_files:
            if not Path(f).is_file():
                raise ConfigError(f"--vault-password-file {f} is not a file")
        self._loader = DataLoader()
        try:
            secrets = CLI.setup_vault_secrets(self._loader, vault_ids=list(C.DEFAULT_VAULT_IDENTITY_LIST),
                                              vault_password_files=list(vault_password_files),
                                              ask_vault_pass=ask_vault_pass, auto_prompt=False,
                                              initialize_context=False)
            self._loader.set_vault_secrets(secrets)
            # values decrypt lazily through one process-wide context (set once; a later Inventory updates it)
            current = VaultSecretsContext.current(optional=True)
            if current is None:
                VaultSecretsContext.initialize(VaultSecretsContext(secrets))
            else:
                current.secrets = secrets
            # Ansible's own -e parser reads the CLI context; it caches its result on the function.
            # Each value alone first, so a bad one is named as what it is, not as the inventory
            for value in extra_vars:
                context.CLIARGS = ImmutableDict(extra_vars=(value,), inventory=(self.source,))
                ansible_vars.load_extra_vars.__dict__.pop("extra_vars", None)
                try:
                    ansible_vars.load_extra_vars(self._loader)
                except AnsibleError as e:
                    raise ConfigError(f"--extra-vars {value!r}: {_first_line(e)} (give k=v, a JSON/YAML mapping or "
                                      "@FILE, as ansible-playbook -e takes them)") from None
            context.CLIARGS = ImmutableDict(extra_vars=tuple(extra_vars), inventory=(self.source,))
            ansible_vars.load_extra_vars.__dict__.pop("extra_vars", None)
            self._inventory = InventoryManager(loader=self._loader, sources=[self.source])
            self._vars = VariableManager(loader=self._loader, inventory=self._inventory)
        except AnsibleError as e:
            raise ConfigError(f"inventory {self.source}: {_first_line(e)}") from None
        finally:
            ansible_vars.load_extra_vars.__dict__.pop("extra_vars", None)
        names = [h.name for h in self._inventory.get_hosts("all")]
        if not names:
            raise ConfigError(f"inventory {self.source} lists no hosts (ansible-inventory -i {self.source} --graph "
                              "shows what Ansible reads there)")

    # ------------------------------------------------------------------ hosts and groups
    def host_names(self) -> list[str]:
        return [h.name for h in self._inventory.get_hosts("all")]

    def group_names(self) -> list[str]:
        return sorted(self._inventory.groups)

    def target(self, host: str, **overrides: Any) -> Target:
        """The target for ``host``: an inventory name, or the ``ansible_host`` of exactly one."""
        h = self._inventory.get_host(host)
        if h is None:
            matches = [x for x in self._inventory.get_hosts("all") if str(self._render(x, "ansible_host")) == host]
            if len(matches) != 1:
                why = "is not in" if not matches else f"is the address of {len(matches)} hosts in"
                raise ConfigError(f"host {host!r} {why} inventory {self.source} (hosts there: "
                                  f"{', '.join(self.host_names())})")
            h = matches[0]
        return self._target(h, overrides)

    def group(self, name: str, **overrides: Any) -> list[Target]:
        """Every host of an inventory group (children included), in inventory order; ConfigError when two of its
        names are one machine (one address and port): each would take a shard, and the second's job, under the
        same unit names, would be taken for the first's and never start."""
        if name not in self._inventory.groups:
            raise ConfigError(f"group {name!r} is not in inventory {self.source} (groups there: "
                              f"{', '.join(self.group_names())})")
        targets = [self._target(h, overrides) for h in self._inventory.groups[name].get_hosts()]
        seen: dict[tuple[str, int], str] = {}
        for t in targets:
            other = seen.setdefault((t.host, t.port), t.name)
            if other != t.name:
                raise ConfigError(f"group {name!r}: {other} and {t.name} are one machine ({t.host}:{t.port}); "
                                  "keep one of them in the group")
        return targets

    # ------------------------------------------------------------------ variables
    def _host_vars(self, h: Any) -> dict[str, Any]:
        cache = self.__dict__.setdefault("_cache", {})
        if h.name not in cache:
            cache[h.name] = self._vars.get_vars(host=h)
        return cache[h.name]

    def _render(self, h: Any, var: str, default: Any = None) -> Any:
        """The variable as a play would see it: from every layer, vault decrypted, Jinja rendered."""
        from ansible.errors import AnsibleError
        from ansible.template import Templar

        hv = self._host_vars(h)
        if var not in hv:
            return default
        try:
            return Templar(loader=self._loader, variables=hv).template(hv[var])
        except AnsibleError as e:
            hint = (" (the inventory holds vault-encrypted values: give --vault-password-file FILE or "
                    "--ask-vault-pass, or set vault_password_file in ansible.cfg)") if "vault" in str(e).lower() else ""
            raise ConfigError(f"{h.name}: cannot read {var}: {_first_line(e)}{hint}") from None

    def _target(self, h: Any, overrides: dict[str, Any]) -> Target:
        from ansible import constants as C

        t = Target(host=str(self._render(h, "ansible_host", h.name)), name=h.name)
        types = {f.name: f.type for f in fields(Target)}
        done: set[str] = set()
        for var, attr in _KNOBS.items():
            value = self._render(h, var)
            if value is None or attr in done:
                continue
            done.add(attr)
            setattr(t, attr, _coerce(h.name, var, value, types[attr]))
        user = self._render(h, "ansible_user") or self._render(h, "ansible_ssh_user") or C.DEFAULT_REMOTE_USER
        t.user = str(user or getpass.getuser())
        if "port" not in done and C.DEFAULT_REMOTE_PORT:
            t.port = int(C.DEFAULT_REMOTE_PORT)
        if "key_file" not in done and C.DEFAULT_PRIVATE_KEY_FILE:
            t.key_file = str(C.DEFAULT_PRIVATE_KEY_FILE)
        if t.known_hosts is None:  # hs_known_hosts_file unset or "" (its default)
            t.known_hosts = _known_hosts_from_args(" ".join(
                str(self._render(h, v) or "") for v in ("ansible_ssh_common_args", "ansible_ssh_extra_args")))
        if t.user != "root":
            self._become(h, t)
        for k, v in {**self.overrides, **overrides}.items():
            if v is not None:
                setattr(t, k, v)
        for attr in _PATHS:
            value = str(getattr(t, attr))
            if not value.startswith("/") or "\n" in value:
                raise ConfigError(f"{h.name}: {attr} = {value!r} must be an absolute path")
            if attr in _UNIT_PATHS and any(ch.isspace() for ch in value):
                raise ConfigError(f"{h.name}: {attr} = {value!r} holds whitespace: the run's sandbox lists it in "
                                  "systemd's ReadWritePaths=, which splits there; choose a path without")
        for attr, pattern in _NAMES.items():
            if not pattern.match(str(getattr(t, attr))):
                raise ConfigError(f"{h.name}: {attr} = {getattr(t, attr)!r} is not a valid name ({pattern.pattern})")
        return t

    def _become(self, h: Any, t: Target) -> None:
        from ansible import constants as C

        method = self._render(h, "ansible_become_method") or C.DEFAULT_BECOME_METHOD or "sudo"
        as_user = self._render(h, "ansible_become_user") or C.DEFAULT_BECOME_USER or "root"
        if method != "sudo" or as_user != "root":
            raise ConfigError(f"{h.name}: fab becomes root with sudo when ansible_user ({t.user}) is not root; "
                              f"the inventory says ansible_become_method={method}, ansible_become_user={as_user}. "
                              "Use sudo to root, or connect as root")
        t.become = True
        for var in ("ansible_become_password", "ansible_become_pass", "ansible_sudo_pass"):
            pw = self._render(h, var)
            if pw:
                t.become_password = str(pw)
                break


def _coerce(host: str, var: str, value: Any, kind: Any) -> Any:
    from ansible.module_utils.parsing.convert_bool import boolean

    try:
        if kind in ("int", int):
            return int(value)
        if kind in ("bool", bool):
            return boolean(value, strict=True)
        if kind in ("list[int]",):
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError("not a list")
            return [int(x) for x in value]
        if kind in ("str | None",):
            return str(value) if value not in ("", None) else None
        return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{host}: {var} = {value!r}: {e}") from None


def _known_hosts_from_args(args: str) -> str | None:
    """``UserKnownHostsFile`` from ssh arguments as Ansible passes them (``-o K=V``, ``-oK=V``, ``-o 'K V'``)."""
    try:
        words = shlex.split(args)
    except ValueError:
        return None
    opts = [w[2:] if w.startswith("-o") and len(w) > 2 else nxt
            for w, nxt in zip(words, words[1:] + [""]) if w.startswith("-o")]
    for opt in opts:
        key, _, value = opt.replace("=", " ", 1).partition(" ")
        if key.lower() == "userknownhostsfile" and value.strip():
            return value.strip().split()[0]
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load(host: str, inventory: str | None = None, *, extra_vars: Sequence[str] = (),
         vault_password_files: Sequence[str] = (), ask_vault_pass: bool = False, **overrides: Any) -> Target:
    """The target for ``host`` (an inventory name or address), with ``overrides`` applied."""
    inv = Inventory(inventory, extra_vars=extra_vars, vault_password_files=vault_password_files,
                    ask_vault_pass=ask_vault_pass)
    return inv.target(host, **overrides)


def load_group(group: str, inventory: str | None = None, *, extra_vars: Sequence[str] = (),
               vault_password_files: Sequence[str] = (), ask_vault_pass: bool = False,
               **overrides: Any) -> list[Target]:
    """Every host of ``group`` with its variables (``fab extract --hosts GROUP``)."""
    inv = Inventory(inventory, extra_vars=extra_vars, vault_password_files=vault_password_files,
                    ask_vault_pass=ask_vault_pass)
    return inv.group(group, **overrides)


def check_run_name(run: str) -> str:
    """:func:`hs_patch.names.check_run_name` (the one rule, shared with hs-extract), as a ConfigError."""
    try:
        return names.check_run_name(run)
    except names.RunNameError as e:
        raise ConfigError(str(e)) from None
