"""SpecForge's own capture for the closed loop (the anchor): its pinned SGLang 0.5.14 site and the
options of its capture script (prepare_hidden_states.py, in its repository) on one GPU shared with
the running trainings."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


SITE514_RECIPE = "kit 0.5.16 + site514.tar.xz + cuda.tile optional (1)"  # change it to rebuild /tmp/site514


def build_site514(kit: Path, delta: Path, dst: Path) -> Path:
    """SGLang 0.5.14 for SpecForge's capture: a hard-linked copy of the 0.5.16 kit site with sglang,
    sgl_kernel, flashinfer, tvm_ffi and transformers (and their dist-info) replaced by the carried 0.5.14
    delta (tests/gpu/loop/build_carry.sh). Made once per machine (``.ok`` holds the recipe)."""
    ok = dst / ".ok"
    if ok.exists() and ok.read_text() == SITE514_RECIPE:
        return dst
    shutil.rmtree(dst, ignore_errors=True)
    subprocess.run(["cp", "-al", str(kit), str(dst)], check=True)
    for pkg in ("sglang", "sgl_kernel", "flashinfer", "tvm_ffi", "transformers"):
        shutil.rmtree(dst / pkg, ignore_errors=True)
    for dist in dst.glob("*.dist-info"):
        if dist.name.split("-")[0].lower() in ("sglang", "sglang_kernel", "flashinfer_python", "apache_tvm_ffi",
                                                 "transformers"):
            shutil.rmtree(dist)
    # GNU tar unlinks a file before writing it: the kit's files the delta also has (tools/, triton_kernels/)
    # are replaced, never written through their hard links
    subprocess.run(["tar", "-C", str(dst), "-xJf", str(delta)], check=True)
    # flashinfer 0.6.12 imports cuda.tile (cuTile, not in the GPU image) at import time for one all-gather
    # kernel SpecForge's single-GPU capture never calls (the only cuda.tile import in the delta): optional
    f = dst / "flashinfer/comm/all_gather_matmul/all_gather_matmul.py"
    line = "from .all_gather_matmul_cutile import all_gather_matmul_cutile"
    out, found = [], 0
    for ln in f.read_text().splitlines():  # a new list: the file's lines are read once
        if ln.strip() == line:
            ind = ln[: len(ln) - len(ln.lstrip())]
            out += [f"{ind}try:", f"{ind}    {line}", f"{ind}except ImportError:",
                    f"{ind}    all_gather_matmul_cutile = None"]
            found += 1
        else:
            out.append(ln)
    if found != 1:
        raise RuntimeError(f"{f}: expected the line {line!r} once, found it {found} times: the delta is not "
                           "flashinfer 0.6.12; rebuild it with tests/gpu/loop/build_carry.sh")
    f.write_text("\n".join(out) + "\n")
    ok.write_text(SITE514_RECIPE)
    return dst


def prepare_args(target_dir: Path, sharegpt: Path, out: Path, draft_cfg: Path, cache: Path) -> list[str]:
    """SpecForge's prepare_hidden_states.py options for one GPU shared with the running trainings.

    - ``lfm``: SpecForge's template for ChatML without a system prompt, the target's; its token ids and
      loss masks equal our driver's (tests/gpu/test_closed_loop.py), so the features pair by token ids.
    - batch size 1: the script right-pads a batch with id 0 and captures the pads as tokens.
    - ``--max-length 2048`` (longer than any chat here) also sizes the KV pool: max_total_tokens =
      batch size x max length = 2048 tokens, whatever the fraction.
    - mem fraction 0.8: SGLang 0.5.14 budgets from the memory FREE when it starts (what
      init_torch_distributed measures, SpecForge's override too), after the other processes: it needs
      free_now - (1 - f) x free_at_start > 0 once the weights are loaded, so f only bounds how much the
      trainings started just before may grow meanwhile (0.3 allowed 30% of what was free); the pool
      stays 2048 tokens (about 20 MB here) whatever f is.
    - triton attention: the backend our capture and the EAGLE-3 servers use on this GPU (the kit strips
      FlashAttention-3; flashinfer's attention would JIT-compile for minutes)."""
    return ["--target-model-path", str(target_dir), "--data-path", str(sharegpt), "--output-path", str(out),
            "--chat-template", "lfm", "--max-length", "2048", "--tp-size", "1", "--batch-size", "1",
            "--draft-model-config", str(draft_cfg), "--sglang-attention-backend", "triton",
            "--sglang-mem-fraction-static", "0.8", "--cache-dir", str(cache), "--num-io-threads", "8"]
