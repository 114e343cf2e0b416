#!/bin/bash
# One device call on the 1-GPU host with the SGLang GPU kit (issue 22): the colo-1gpu bench (qwen3-8b, the real
# SGLang receiver beside the faithful one, each with its floor measured in the same run), the overhead A/B (quiet
# updates against pause/flush/continue, in one engine), then `make test-gpu` with the kit on the path, its tests
# spread over xdist workers. Run from the repo root on the device, carrying .sgkit, .nixlwhl and .snap_sglang
# (src.tar.gz: `git archive` of the commit, commit: its hash, *.whl: pytest-xdist and execnet):
#   bash .snap_sglang/sglang_gpu.sh      (results under $OUT; STAGES="bench overhead colo test" picks stages;
#                                         the default: bench overhead test; SCENARIOS=colo-1gpu,nixl-1gpu and
#                                         BENCH_STEPS=N for the bench, RECEIVERS=sglang,sglang:late,faithful its
#                                         arms (:late: the call after written); *_LIMIT: each stage's seconds; TEST_ARGS:
#                                         more pytest arguments, e.g. -k to pick tests)
# Build the snapshot of a commit first:  git archive --format=tar.gz -o .snap_sglang/src.tar.gz HEAD &&
#   git rev-parse --short HEAD > .snap_sglang/commit && cp benchmarks/sglang_gpu.sh .snap_sglang/
# (go.sh sets S: this script's own folder variable is SNAP.)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$PWD; SNAP=$R/.snap_sglang; W=/tmp/ws; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
rm -rf $W && mkdir -p $W /tmp/nixlsite /tmp/xd && tar -xzf $SNAP/src.tar.gz -C $W || exit 3
tar -xJf $R/.nixlwhl/nixl_cu13_cp312_ucx.tar.xz -C /tmp/nixlsite || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/xd $SNAP/*.whl || exit 5
. $R/.sgkit/go.sh
export PYTHONPATH=/tmp/nixlsite:/tmp/xd:$PYTHONPATH WEIGHTSYNC_COMMIT=$(cat $SNAP/commit) WEIGHTSYNC_GPU_OUT=$OUT/test-gpu
python3 -c "import sys,torch,sglang;print(sys.version.split()[0], torch.__version__, sglang.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd $W
has() { case " ${STAGES:-bench overhead test} " in *" $1 "*) return 0;; esac; return 1; }
if has bench; then
echo "== $(el) s bench ${SCENARIOS:-colo-1gpu} (sglang, faithful)"
stage bench "${BENCH_LIMIT:-140}" python3 benchmarks/sglang_gpu.py bench --out $OUT --scenarios ${SCENARIOS:-colo-1gpu} \
  --steps ${BENCH_STEPS:-5} --receivers ${RECEIVERS:-sglang,faithful} > $OUT/bench.log 2>&1
grep "\[bench\]" $OUT/bench.log | cut -c1-400
fi
if has overhead; then
echo "== $(el) s overhead A/B"
stage overhead "${OVERHEAD_LIMIT:-80}" python3 benchmarks/sglang_gpu.py overhead --out $OUT > $OUT/overhead.log 2>&1
grep "workers ms\|FAILED" $OUT/overhead.log | cut -c1-600
fi
if has colo; then
echo "== $(el) s colo: llama (co-located 3 steps, NIXL 2, bad input, validate, killed trainers), qwen3 co-located"
stage colo "${COLO_LIMIT:-420}" python3 benchmarks/sglang_gpu.py colo --out $OUT/colo --models ${COLO_MODELS:-llama,qwen3} > $OUT/colo.log 2>&1
grep "step .* <- seed\|FAILED\|verified\|refused\|killed-" $OUT/colo.log | cut -c1-300 | tail -n 40
fi
if has test; then
echo "== $(el) s make test-gpu (SGLang kit on the path, -n ${WORKERS:-6})"
# one kit on the path: a vLLM kit an earlier call installed on this warm machine (/tmp/site, which make test-gpu puts
# first) would load this kit's FlashInfer and fail its JIT build (seen at 7db2dbb, 2026-12-06); set aside, not deleted
if [ -f /tmp/site/vllm/__init__.py ]; then rm -rf /tmp/site.vllm-kit; mv /tmp/site /tmp/site.vllm-kit; echo "vLLM kit in /tmp/site set aside"; fi
# -v: each test's name as it ends (a stage cut by its time limit still says which passed)
PYTEST_ADDOPTS="-v -n ${WORKERS:-6} --dist loadgroup --durations=15 ${TEST_ARGS:-}" stage testgpu "${TEST_LIMIT:-420}" make test-gpu > $OUT/test-gpu.log 2>&1
echo "test-gpu at $(el) s"; grep -v "Benchmark\|warner" $OUT/test-gpu.log | grep "FAILED\|ERROR\|node down\|crashed\|passed\|failed\|s call" | cut -c1-240 | tail -n 60
fi
ps -eo pid,etime,cmd | grep -c "sglang\|python3" || true
