"""fab's checks of a GPU host before a run starts there (:func:`preflight`).

Each :class:`Check` names what it looked at, what it found and, failed, what to do; ``fab extract`` prints them
all and starts nothing while one fails.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from hs_patch.control import storage
from hs_patch.control.inventory import Target
from hs_patch.control.remote import (APART_FIX, HIGH_WATER_PCT, MAX_SAMPLE_TOKENS, SANDBOX, as_service_user,
                                     last_json, shared_dir)
from hs_patch.control.shell import Shell, cmd
from hs_patch.engine.flags import args_violations


# A preflight finding. The readiness scripts on the host print the same fields as JSON and carry their
# own Check: they run there alone, and the control node imports no host code.
@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def preflight(c: Shell, t: Target, *, estimated_bytes: int | None, bytes_per_token: int,
              need_gpus: bool = True, max_tokens: int = MAX_SAMPLE_TOKENS) -> list[Check]:
    """Check the host can run an extraction; each failed check says what to do."""
    checks: list[Check] = []
    r = c.run(["true"])
    checks.append(Check("ssh", r.ok, f"{t.user}@{t.host}:{t.port}" + (" (sudo to root)" if t.become else ""),
                        "check the inventory's ansible_user/port/key (and sudo for a non-root user)"))
    if not r.ok:
        return checks
    r = c.run([t.bin("hs-patch"), "verify", "--json"])
    res = last_json(r.stdout)
    checks.append(Check("patch", r.ok, res.get("message") or res.get("error") or r.stderr.strip(),
                        "run ansible-playbook site.yml (it installs SGLang and applies the patch)"))
    if need_gpus:
        r = c.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
        names = [x.strip() for x in r.stdout.splitlines() if x.strip()] if r.ok else []
        good = [n for n in names if t.gpu_model in n]  # hs_gpu_model: a part of the name nvidia-smi prints
        checks.append(Check("gpus", r.ok and len(good) == t.gpu_count == len(names),
                            f"{len(names)} GPU(s): {', '.join(sorted(set(names))) or r.stderr.strip() or 'none'}",
                            f"expected {t.gpu_count} x {t.gpu_model}: check the driver (nvidia-smi) or hs_gpu_count/"
                            "hs_gpu_model in the inventory"))
        checks.append(_gpu_ready(c, t))
    checks.append(_server_flags(c, t))
    checks.append(_api_key(c, t))
    r = c.run("cd / && " + cmd(*as_service_user(t, "find", t.model_path, "-maxdepth", "1", "!", "-readable")))
    unreadable = r.stdout.split()
    has_config = c.run(["test", "-f", f"{t.model_path}/config.json"]).ok
    checks.append(Check("model", r.ok and not unreadable and has_config,
                        f"{t.model_path} readable by {t.service_user}" if r.ok and not unreadable else
                        f"{t.model_path}: not readable by {t.service_user}: {' '.join(unreadable)[:200] or r.stderr.strip()}",
                        f"put the model there and let {t.service_user} read it (chmod -R a+rX {t.model_path})"))
    # room for the run, or at least for its largest possible sample (the driver pauses
    # sending at 80% use and the shipper frees space as it goes)
    need = max(64 << 20, min(estimated_bytes or 0, bytes_per_token * max_tokens))
    shared = shared_dir(t)
    checks.append(Check("dirs", shared is not None, f"capture dir {t.dump_dir} and samples root {t.samples_root}"
                        + (f" both under {shared}" if shared else " apart"), APART_FIX))
    for label, path in (("dump space", t.dump_dir), ("samples space", t.samples_root)):
        space = _space(c, path)
        free = space[1] if space else None
        if label == "samples space" and not t.ship_enabled and estimated_bytes:
            # nothing ships the samples away: the whole run stays there, and the driver pauses for good once the
            # filesystem is HIGH_WATER_PCT used
            room = None if space is None else space[1] - space[0] * (100 - HIGH_WATER_PCT) // 100
            checks.append(Check(label, room is not None and room >= estimated_bytes,
                                f"{_gb(room)} for {path} below the driver's high water ({HIGH_WATER_PCT}% used), "
                                f"{_gb(estimated_bytes)} estimated for the run, which stays there (shipping is off)",
                                f"shipping is off (hs_ship_enabled: false): free {_gb(estimated_bytes - (room or 0))} "
                                "more there, run fewer lines (--limit), or ship to training storage (hs_storage_host "
                                "or hs_s3_url, then ansible-playbook site.yml --tags shipping)"))
            continue
        checks.append(Check(label, free is not None and free >= need, f"{_gb(free)} free for {path}",
                            f"free at least {_gb(need)} there (one sample of {max_tokens} tokens)"))
    if t.ship_enabled and t.s3_url:
        ok, said = storage.preflight_bucket(c, t, [f"--property={p}" for p in SANDBOX]
                                            + storage.credential_properties(c, t))
        checks.append(Check("storage", ok, said, "fix the bucket, its endpoint or the credentials (hs_s3_* in the "
                            "inventory and the vault; ansible-playbook site.yml --tags shipping installs them)"))
    elif t.ship_enabled:
        # ssh joins its arguments into one line the far shell reads: hand it one quoted line
        r = c.run(as_service_user(t, "ssh", "-o", "BatchMode=yes", "--", t.storage_alias,
                                   cmd("df", "-Pk", t.storage_dir)), timeout=60)
        free = int(r.stdout.splitlines()[-1].split()[3]) * 1024 if r.ok and r.stdout.strip() else None
        ok = free is not None and (estimated_bytes is None or free >= estimated_bytes)
        checks.append(Check("storage", ok, f"{t.storage_alias}:{t.storage_dir}: {_gb(free)} free, "
                            f"{_gb(estimated_bytes)} estimated for what this run still ships" if r.ok else (r.stderr.strip() or r.stdout.strip())[-300:],
                            "fix the storage target (ansible-playbook site.yml configures it) or free space there"))
    return checks


def _gpu_ready(c: Shell, t: Target) -> Check:
    """The JIT toolchain and the all-GPU NCCL all-reduce (skipped while the server holds the GPUs), through the
    services role's gpu-ready wrapper in ``sglang_service_check_dir`` (hs_patch/host/readiness/gpu_ready.py with
    the server unit's user and environment: the same check the role and the unit's ExecStartPre run)."""
    if c.run(["systemctl", "is-active", "--quiet", f"{t.service}.service"]).ok:
        return Check("gpu ready", True, f"{t.service} is running (its own start checked the GPUs)")
    gpu_ready = f"{t.check_dir}/gpu-ready"
    r = c.run([gpu_ready, "caches", "jit", "nccl", "--json"], timeout=900)
    found = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if not found:
        return Check("gpu ready", False, (r.stderr or r.stdout).strip()[-300:] or f"{gpu_ready} gave nothing",
                     "run ansible-playbook site.yml (the services role installs the check)")
    bad = [x for x in found if not x["ok"] and not x.get("warn")]
    return Check("gpu ready", not bad, "; ".join(f"{x['name']}: {x['detail']}" for x in (bad or found))[-900:],
                 bad[0]["fix"] if bad else "")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server_flags(c: Shell, t: Target) -> Check:
    r = c.run(["systemctl", "cat", f"{t.service}.service"])
    if not r.ok:
        return Check("server unit", False, r.stderr.strip(), "run ansible-playbook site.yml (services role)")
    unit = r.stdout
    status = last_json(c.run([t.bin("hs-patch"), "status", "--json"]).stdout)
    words = shlex.split(next((x for x in unit.splitlines() if x.startswith("ExecStart=")), "").partition("=")[2])
    problems = args_violations(words, status.get("release"))
    listen = words[words.index("--host") + 1] if "--host" in words[:-1] else "127.0.0.1"
    exposed = not _is_loopback(listen)
    env_ok = "HS_CAPTURE=1" in unit and f"HS_CAPTURE_DIR={t.dump_dir}" in unit
    ok = not problems and env_ok and not exposed
    detail = f"capture on, flags compatible, listening on {listen}" if ok else \
        (f"{'; '.join(problems) or 'flags ok'}; capture env {'ok' if env_ok else 'missing'}, "
         f"listening on {listen}{' (not loopback)' if exposed else ''}")
    return Check("server flags", ok, detail, f"set them in the services role (sglang_service_*) and re-run site.yml;"
                                             f" HS_CAPTURE_DIR must be {t.dump_dir}; the server listens on loopback "
                                             "only (sglang_service_host)")


def _api_key(c: Shell, t: Target) -> Check:
    """The server's API key file, readable by the service user (the driver sends the key)."""
    r = c.run(as_service_user(t, "test", "-r", t.api_key_file))
    mode = c.run(["stat", "-c", "%a %U", t.api_key_file]).stdout.strip()
    ok = r.ok and mode.split()[:1] in (["600"], ["400"])
    return Check("api key", ok, f"{t.api_key_file} ({mode or 'missing'})",
                 f"run ansible-playbook site.yml (the services role writes the key, mode 0600, owner "
                 f"{t.service_user}; hs_server_api_key_file must name it)")


def _space(c: Shell, path: str) -> tuple[int, int] | None:
    """(size, available) bytes of the filesystem holding ``path`` (or its parent, before it exists)."""
    r = c.run(cmd("df", "-Pk", path) + " 2>/dev/null || " + cmd("df", "-Pk", str(Path(path).parent)))
    try:
        fields = r.stdout.splitlines()[-1].split()
        return int(fields[1]) * 1024, int(fields[3]) * 1024
    except (IndexError, ValueError):
        return None


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"
