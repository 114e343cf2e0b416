#!/bin/bash
# Issue 35's proofs on the 1-GPU host in one device call, with the MoE vLLM kit carried as .vgpu-moe
# (`MOE=1 bash ../shared/vllm-gpu-kit/BUILD.sh .vgpu-moe`: vLLM 0.26, its MoE ops, FlashMLA, DeepGEMM, and the
# compressed-tensors/loguru wheels FP8 needs). Stages, each in its own session under a time limit, results in $OUT:
#   moe   : benchmarks/fp8_vllm_gpu.py --model tiny-qwen3-moe-fp8 (co-located, bit-exact to fresh engines)
#   bench : weightsync bench --scenario colo-1gpu --receiver vllm --quant fp8 on $MODEL (default
#           moonlight-16b-a3b: bf16 then block FP8 into a real vLLM, verified, the device-copy ceiling beside)
#   test  : make test-gpu's pytest with the kit on the path
# STAGES (default "moe bench test"), MODEL, STEPS, and *_LIMIT (seconds) set the call.
set -u
. .vgpu-moe/go.sh
export PYTHONPATH=$PWD/benchmarks/vllm_kit_stubs:$PYTHONPATH:$PWD VLLM_DEEP_GEMM_WARMUP=skip
python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# the device copy's .git can be stale (2026-12-08: results said 3156b18 for a tree at 1b96b8a plus edits): write
# `git describe --always --dirty > .commit` here before the call, and the results carry it
export WEIGHTSYNC_COMMIT=${WEIGHTSYNC_COMMIT:-$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)}
echo "commit $WEIGHTSYNC_COMMIT"
for st in ${STAGES:-moe bench test}; do
  case $st in
    moe)   stage moe "${MOE_LIMIT:-200}" python3 benchmarks/fp8_vllm_gpu.py --out $OUT/moe --model tiny-qwen3-moe-fp8 \
             --transports colocated > $OUT/moe.log 2>&1; tail -n 15 $OUT/moe.log ;;
    bench) stage bench "${BENCH_LIMIT:-330}" python3 -m weightsync bench --scenario colo-1gpu --receiver vllm \
             --quant fp8 --model "${MODEL:-moonlight-16b-a3b}" --steps "${STEPS:-3}" --baselines "" --timeout 120 \
             --json > $OUT/bench.json 2> $OUT/bench.err; tail -c 1500 $OUT/bench.err
           python3 benchmarks/summary.py $OUT/bench.json 2>&1 | head -20 ;;
    test)  stage test "${TEST_LIMIT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
             > $OUT/test-gpu.log 2>&1; tail -n 25 $OUT/test-gpu.log ;;
  esac
done
