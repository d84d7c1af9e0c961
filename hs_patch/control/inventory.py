"""What ``fab`` needs to know about a GPU host, read from the Ansible inventory.

The inventory (``inventory/`` by default, or ``HS_INVENTORY``/``--inventory``) is the one
place where hosts and knobs live: ``hosts.yml`` gives the connection (``ansible_user``,
``ansible_port``, ``ansible_ssh_private_key_file``), ``group_vars/*.yml`` and
``host_vars/<host>.yml`` the ``hs_*`` settings the roles were deployed with (venv, server
port, dump directory, storage target...). Values that are Jinja templates are ignored.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator

import yaml

from hs_patch import names


class ConfigError(ValueError):
    """The inventory or an option is unusable; the message says what to fix."""


@dataclass
class Target:
    host: str
    user: str = "root"
    port: int = 22
    key_file: str | None = None
    known_hosts: str | None = None
    # hs_* knobs (inventory/group_vars/gpu_hosts.yml documents each)
    venv: str = "/opt/hs-patch/venv"
    service: str = "sglang"
    service_user: str = "sglang"
    server_port: int = 30000
    model_path: str = "/models/Kimi-K2.5"
    dump_dir: str = "/dev/shm/hs_capture"
    capture_layers: list[int] = field(default_factory=lambda: [2, 30, 58])
    capture_final: str = "both"
    gpu_count: int = 8
    gpu_model: str = "NVIDIA RTX PRO 6000 Blackwell"
    ship_enabled: bool = True
    storage_alias: str = "hs-storage"
    storage_dir: str = "/srv/hs-samples"
    state_root: str = "/var/lib/hs-patch/runs"
    samples_root: str = "/dev/shm/hs-runs"
    trust_remote_code: bool = True

    def state_dir(self, run: str) -> str:
        return f"{self.state_root}/{run}"

    def samples_dir(self, run: str) -> str:
        return f"{self.samples_root}/{run}/samples"

    def bin(self, name: str) -> str:
        return f"{self.venv}/bin/{name}"


# inventory variable -> Target field
_KNOBS = {
    "hs_venv": "venv", "sglang_service_name": "service", "hs_service_user": "service_user",
    "hs_server_port": "server_port", "hs_model_path": "model_path", "hs_dump_dir": "dump_dir",
    "hs_capture_layers": "capture_layers", "hs_capture_final": "capture_final", "hs_gpu_count": "gpu_count",
    "hs_gpu_model": "gpu_model", "hs_ship_enabled": "ship_enabled", "sample_shipping_ssh_alias": "storage_alias",
    "hs_storage_dir": "storage_dir", "hs_runs_state_root": "state_root", "hs_runs_samples_root": "samples_root",
    "ansible_user": "user", "ansible_port": "port", "ansible_ssh_private_key_file": "key_file",
    "hs_known_hosts_file": "known_hosts",
}


def inventory_dir(explicit: str | None = None) -> Path:
    d = Path(explicit or os.environ.get("HS_INVENTORY") or Path(__file__).resolve().parents[2] / "inventory")
    if not (d / "hosts.yml").is_file():
        raise ConfigError(f"no inventory at {d}/hosts.yml: pass --inventory DIR or set HS_INVENTORY")
    return d


def _walk(group: dict[str, Any], name: str) -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    """(host, host vars, groups it is in) for every host under an inventory group."""
    for host, hvars in (group.get("hosts") or {}).items():
        yield host, hvars or {}, [name]
    for child, sub in (group.get("children") or {}).items():
        for host, hvars, groups in _walk(sub or {}, child):
            yield host, hvars, [name, *groups]


def _yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of variables")
    return data


def load(host: str, inventory: str | None = None, **overrides: Any) -> Target:
    """The target for ``host`` (an inventory name or address), with ``overrides`` applied."""
    inv = inventory_dir(inventory)
    hosts = {h: (v, g) for h, v, g in _walk(_yaml(inv / "hosts.yml").get("all", {}), "all")}
    if host not in hosts:
        raise ConfigError(f"host {host!r} is not in {inv}/hosts.yml (hosts there: {', '.join(hosts) or 'none'})")
    hvars, groups = hosts[host]
    merged: dict[str, Any] = {}
    for g in groups:
        merged.update(_yaml(inv / "group_vars" / f"{g}.yml"))
    merged.update(_yaml(inv / "host_vars" / f"{host}.yml"))
    merged.update(hvars)
    t = Target(host=str(merged.get("ansible_host", host)))
    types = {f.name: f.type for f in fields(Target)}
    for var, attr in _KNOBS.items():
        value = merged.get(var)
        if value is None or (isinstance(value, str) and "{{" in value):
            continue
        setattr(t, attr, int(value) if types[attr] == "int" else value)
    for k, v in overrides.items():
        if v is not None:
            setattr(t, k, v)
    for path_attr in ("venv", "dump_dir", "model_path", "storage_dir", "state_root", "samples_root"):
        if not str(getattr(t, path_attr)).startswith("/"):
            raise ConfigError(f"{path_attr} = {getattr(t, path_attr)!r} must be an absolute path")
    return t


def check_run_name(run: str) -> str:
    """:func:`hs_patch.names.check_run_name` (the one rule, shared with hs-extract), as a ConfigError."""
    try:
        return names.check_run_name(run)
    except names.RunNameError as e:
        raise ConfigError(str(e)) from None
