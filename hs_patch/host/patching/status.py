"""``hs-patch status`` and ``hs-patch check-args``: what the installed SGLang, the capture
settings and a server command line amount to (the patch itself: :mod:`hs_patch.host.patching.patcher`)."""

from __future__ import annotations

from typing import Any

from hs_patch.engine.flags import REQUIRED_FLAGS, args_violations
from hs_patch.engine.releases import RELEASES
from hs_patch.host.patching import patcher
from hs_patch.host.patching.nearest import nearest
from hs_patch.server import config


def status(site: str | None, model: str | None = None) -> dict[str, Any]:
    t = patcher.inspect_target(site)
    try:
        capture: dict[str, Any] = config.from_env().as_dict()
    except config.ConfigError as e:
        capture = {"error": str(e)}
    release = t.release.version if t.release else None
    res = {"action": "status", "release": release, "installed_version": t.installed_version,
           "state": t.state, "site": str(t.site), "files": [t.describe()],
           "backup": str(t.backup) if t.backup.exists() else None, "capture": capture,
           "required_server_flags": REQUIRED_FLAGS.get(release or "", []),
           "serving": serving_ids(capture.get("layers"), release or t.installed_version, model),
           "message": f"SGLang {release or t.installed_version or '?'}: {t.state}"}
    if t.state == "outdated":
        res["message"] += (" (patched by an earlier hs-patch: its hook calls no longer match, the hook refuses every "
                           "pass; run hs-patch apply to upgrade the patch)")
    try:
        patcher.check_version(t)
    except patcher.Refused as e:  # apply and verify refuse it: status must not read as fine
        res["mixed_install"] = True
        res["message"] += " -- " + str(e).replace(" Nothing was written.", "") + " (apply and verify refuse it)"
    if t.state == "unknown":  # a release published after this hs-patch, or an edited file: what is nearest
        near = nearest(t.text)
        res["nearest"], res["hints"] = near.summary(), _unknown_hints(t)
        res["message"] += (f" (no supported release has this deepseek_v2.py: {patcher.SUPPORTED}; patching it is "
                           "refused)\n  " + "\n  ".join(res["hints"] + near.lines()))
    return res


def _unknown_hints(t: patcher.Target) -> list[str]:
    """What an unknown file most likely is, before the nearest release (which compares it as pristine)."""
    out = []
    if t.backup.exists():
        out.append(f"it was patched and then changed (the original is kept at {t.backup}): reinstall SGLang, then "
                   "run hs-patch apply")
    if "\r\n" in t.text:
        out.append("its lines end in CRLF (copied through Windows or an editor that converts?); every release's "
                   "file ends them in LF")
    return out


def check_args(site: str | None, release: str | None, args: list[str]) -> dict[str, Any]:
    """Check a server command line against the capture hook's rules (hs_patch.engine.flags)."""
    if release is None:
        t = patcher.inspect_target(site)
        if t.release is None:
            raise patcher.Refused(f"{t.path} is no supported release's file (hs-patch status says what it is), so "
                                  f"the flags capture needs are not known: give --release, one of {', '.join(RELEASES)}")
        release = t.release.version
    elif release not in RELEASES:  # the flags each release needs are known for these only: no silent pass
        raise patcher.Refused(f"SGLang {release} is not a supported release ({patcher.SUPPORTED}): the flags capture "
                              "needs on it are not known")
    problems = args_violations(args, release)
    return {"action": "check-args", "release": release, "problems": problems, "clean": not problems,
            "message": "server arguments compatible with capture" if not problems else
            "server arguments the capture hook cannot work with:\n  - " + "\n  - ".join(problems)}


def serving_ids(layers: Any, release: str | None, model: str | None) -> dict[str, Any]:
    """The drafter eagle_config that serves the captured layers on this release (hs_patch.engine.serving).
    Unset HS_CAPTURE_LAYERS means the model's own default, known only with ``--model``."""
    from hs_patch.engine import serving

    if not release:
        return {}
    n, arch = None, ""
    if model:
        from hs_patch.host.model_files import ModelFileError, model_info

        try:
            info = model_info(model)
            n, arch = info.num_hidden_layers, info.architecture
        except ModelFileError as e:
            return {"error": str(e)}
    if not layers:
        if n is None:
            return {"release": release, "note": "HS_CAPTURE_LAYERS unset: the model's default [2, n//2, n-3]; "
                                                "give --model DIR for the drafter's ids"}
        layers = config.default_layers(n)
        defaulted = {"layers_default": list(layers)}
    else:
        defaulted = {}
    try:
        ids = serving.eagle_ids(release, list(layers), n, arch)
    except serving.NotServable as e:
        return {"release": release, "refused": str(e)}
    return {"release": release, "eagle_aux_hidden_state_layer_ids": ids, "checked_with_model": n is not None,
            **defaulted}
