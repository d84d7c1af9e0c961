"""Checking on the syntax tree that a patched ``deepseek_v2.py`` has the capture hook where it must, and
nothing else changed (``hs-patch verify``, and after every apply).

Standard library only, like the patcher: it runs on hosts where importing SGLang or torch needs a GPU.
"""

from __future__ import annotations

import ast
import hashlib

from hs_patch.engine.families import LAYER_POINT
from hs_patch.engine.releases import PatchError, Release, pristine_text


class VerifyFailed(Exception):
    """The patch is absent or damaged (exit 3)."""


def _calls(node: ast.AST, dotted: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == dotted]


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for c in tree.body:
        if isinstance(c, ast.ClassDef) and c.name == cls:
            for f in c.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return f
    raise VerifyFailed(f"{cls}.{name} not found")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise VerifyFailed(f"the capture hook is not where it must be: {what}")


def check_patched(text: str, release: Release) -> None:
    """Check on the syntax tree that the hook sits where it must, and nothing else changed.

    - ``DeepseekV2Model.__init__`` attaches the hook only inside ``if ... HS_CAPTURE ...``,
      and imports ``hs_patch`` only there;
    - ``forward`` begins the pass before the layer loop, passes ``_hs.collector(i, ...)``
      as every layer's ``captured_last_layer_outputs``, captures the pre-norm state at the
      final norm, and finishes after the norm and before returning;
    - the decoder layer hands the hook what its attention reads right after its input step
      (the family's ``prepare``); the layer-point family's also captures ``residual`` there;
    - undoing the edits gives back the release's pristine file, byte for byte.
    """
    tree = ast.parse(text)
    init = _method(tree, "DeepseekV2Model", "__init__")
    attach = _calls(init, "_hs_attach")
    _need(len(attach) == 1 and ast.literal_eval(attach[0].args[2]) == release.version,
          "DeepseekV2Model.__init__ must call _hs_attach(self, config, release) once")
    guards = [n for n in ast.walk(init) if isinstance(n, ast.If) and "HS_CAPTURE" in ast.unparse(n.test)]
    _need(len(guards) == 1 and attach[0] in list(ast.walk(guards[0])), "_hs_attach must be under `if HS_CAPTURE`")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("hs_patch")]
    _need(len(imports) == 1 and imports[0] in list(ast.walk(guards[0])),
          "hs_patch may be imported only under `if HS_CAPTURE`")

    fwd = _method(tree, "DeepseekV2Model", "forward")
    begin = _calls(fwd, "self._hs_capture.begin")
    loops = [n for n in fwd.body if isinstance(n, ast.For) and ast.unparse(n.iter).startswith("range(normal_start")]
    _need(len(begin) == 1 and len(loops) == 1 and begin[0].lineno < loops[0].lineno,
          "forward must call self._hs_capture.begin once, before the layer loop")
    layer_calls = [c for c in _calls(loops[0], "layer")]
    _need(len(layer_calls) == 1, "the layer loop must call layer(...) once")
    kw = {k.arg: k.value for k in layer_calls[0].keywords}
    cap = kw.get("captured_last_layer_outputs")
    _need(cap is not None and any(ast.unparse(c.func) == "_hs.collector" and ast.unparse(c.args[0]) == "i"
                                  for c in ast.walk(cap) if isinstance(c, ast.Call)),
          "each layer must get captured_last_layer_outputs=_hs.collector(i, ...)")
    pre = [n for n in ast.walk(fwd) if isinstance(n, ast.Attribute) and ast.unparse(n) == "_hs.final_prenorm"]
    finish = _calls(fwd, "_hs.finish")
    returns = [n for n in ast.walk(fwd) if isinstance(n, ast.Return)]
    _need(pre and all(loops[0].end_lineno < n.lineno for n in pre), "_hs.final_prenorm must follow the layer loop")
    _need(len(finish) == 1 and max(n.lineno for n in pre) < finish[0].lineno < returns[-1].lineno
          and ast.unparse(finish[0].args[0]) == "hidden_states",
          "_hs.finish(hidden_states) must come after the final norm and before the last return")

    lfwd = _method(tree, "DeepseekV2DecoderLayer", "forward")
    prepare = release.family.prepare
    prep = [n for n in lfwd.body if isinstance(n, ast.Assign) and _calls(n, prepare)]
    idx = lfwd.body.index(prep[0]) if len(prep) == 1 else -1
    nxt = lfwd.body[idx + 1] if idx >= 0 else None
    attn = _calls(nxt, "captured_last_layer_outputs.hs_attn_input") if isinstance(nxt, ast.If) else []
    _need(len(attn) == 1 and ast.unparse(attn[0].args[0]) == "hidden_states",
          f"the decoder layer must hand the hook its attention's input right after {prepare.split('.')[-1]}")
    if release.family is LAYER_POINT:
        _need("captured_last_layer_outputs" in [a.arg for a in lfwd.args.args],
              "DeepseekV2DecoderLayer.forward must take captured_last_layer_outputs")
        _need(_calls(nxt, "captured_last_layer_outputs.capture")
              and ast.unparse(_calls(nxt, "captured_last_layer_outputs.capture")[0].args[0]) == "residual",
              "the decoder layer must capture `residual` right after prepare_attn")

    try:
        original = pristine_text(release, text)
    except PatchError as e:
        raise VerifyFailed(f"the patched lines were changed ({e})") from None
    _need(hashlib.sha256(original.encode("utf-8")).hexdigest() == release.pristine_sha256,
          f"code outside the patched lines differs from SGLang {release.version}'s deepseek_v2.py")
