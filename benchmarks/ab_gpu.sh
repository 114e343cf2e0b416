#!/bin/bash
# Before/after on the 1-GPU host in one device call: colo-1gpu and nixl-1gpu (qwen3-8b, faithful receiver),
# the old and the new tree interleaved (old, new, old, new), then `make test-gpu` on the new tree. Carry
# .nixlwhl with nixl_cu13_cp312_ucx.tar.xz (NIXL as in delta_gpu.sh) and old.tar.gz / new.tar.gz (git archive
# of each commit, with old.commit / new.commit), so that nobody's uncommitted edits travel. Results under $OUT.
# MODEL (default qwen3-8b), EXTRA (more bench arguments, e.g. "--quant fp8": bf16 then FP8 in one run),
# SCENARIOS (default "colo-1gpu nixl-1gpu"), ROUNDS, STEPS, BENCH_LIMIT and TEST_LIMIT (seconds) set the call.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
W=.nixlwhl
rm -rf /tmp/ab_site /tmp/ab_old /tmp/ab_new && mkdir -p /tmp/ab_site /tmp/ab_old /tmp/ab_new
tar -xJf $W/nixl_cu13_cp312_ucx.tar.xz -C /tmp/ab_site || exit 3
tar -xzf $W/old.tar.gz -C /tmp/ab_old && tar -xzf $W/new.tar.gz -C /tmp/ab_new || exit 4
python3 -c "import sys,torch,triton;print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "old $(cat $W/old.commit) new $(cat $W/new.commit)"
bench() {  # $1 old|new, $2 scenario, $3 tag
  cd /tmp/ab_$1
  WEIGHTSYNC_COMMIT=$(cat $ROOT/$W/$1.commit) PYTHONPATH=/tmp/ab_site:/tmp/ab_$1 \
    timeout "${BENCH_LIMIT:-75}" python3 -m weightsync bench --scenario $2 --model "${MODEL:-qwen3-8b}" \
    --steps "${STEPS:-5}" --baselines "" --timeout 60 ${EXTRA:-} --json > $OUT/$2-$1-$3.json 2> /tmp/ab_err
  echo "== $(el) s $1 $2 #$3 rc=$?"
  python3 /tmp/ab_new/benchmarks/summary.py $OUT/$2-$1-$3.json 2>&1 | head -4 || tail -c 800 /tmp/ab_err
  cd $ROOT
}
for tag in $(seq 1 ${ROUNDS:-1}); do
  for scenario in ${SCENARIOS:-colo-1gpu nixl-1gpu}; do
    for side in old new; do bench $side $scenario $tag; done
  done
done
echo "--- test-gpu $(el) s"
cd /tmp/ab_new && NCCL_NVLS_ENABLE=0 PYTHONPATH=/tmp/ab_site:/tmp/ab_new timeout "${TEST_LIMIT:-200}" \
  python3 -m pytest -q -m gpu -p no:cacheprovider -rs > $OUT/test-gpu.log 2>&1
echo "test-gpu rc=$? at $(el) s"; tail -n 25 $OUT/test-gpu.log
