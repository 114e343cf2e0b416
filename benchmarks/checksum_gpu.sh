#!/bin/bash
# The Triton checksum on the 1-GPU host: its rate against the torch reductions (benchmarks/checksum_speed.py),
# the checksum tests, the integrity bench (colo-1gpu, every step checked) and the delta bench (nixl-1gpu, previous
# version on the GPU), in one device call. Carry .nixlwhl (NIXL as in delta_gpu.sh, and src.tar.gz = git archive
# HEAD, so nobody's uncommitted edits travel). Logs under $OUT: run.log, speed.json, integrity-{1,0}.json, bench.*.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD
mkdir -p /tmp/site && tar -xJf .nixlwhl/nixl_cu13_cp312_ucx.tar.xz -C /tmp/site || exit 3
mkdir -p /tmp/src && tar -xzf .nixlwhl/src.tar.gz -C /tmp/src || exit 4
cd /tmp/src
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
LOG=$OUT/run.log
el() { echo $(( $(date +%s) - T0 )); }
echo "commit ${WEIGHTSYNC_COMMIT:-?}; $(python3 -c 'import triton; print("triton", triton.__version__)')" | tee -a $LOG
echo "--- speed $(el) s" | tee -a $LOG
timeout 110 python3 benchmarks/checksum_speed.py --out $OUT/speed.json >> $LOG 2>&1; echo "speed rc=$?" | tee -a $LOG
grep -v "^{" $LOG | tail -n 14
echo "--- tests $(el) s" | tee -a $LOG
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_checksum.py tests/test_checksum_fast.py >> $LOG 2>&1
echo "tests rc=$?" | tee -a $LOG; tail -n 3 $LOG
bench_integrity() {  # $1: 1 = the Triton kernel, 0 = the torch reductions
  echo "--- integrity fast=$1 $(el) s" | tee -a $LOG
  WEIGHTSYNC_FAST_CHECKSUM=$1 timeout "$2" python3 -m weightsync bench --scenario colo-1gpu --model qwen3-8b --steps 10 \
    --baselines "" --timeout 100 --integrity 1 --json > $OUT/integrity-$1.json 2>> $LOG
  echo "integrity fast=$1 rc=$?" | tee -a $LOG
  python3 -c "
import json,sys
r=[json.loads(x) for x in open('$OUT/integrity-$1.json') if x.startswith('{')][-1]
print({k: r.get(k) for k in ('scenario','median_seconds','min_seconds','max_seconds','efficiency','verified','errors')})
print({k: round(v*1e3,2) for k,v in (r.get('phase_median_seconds') or {}).items()})" 2>&1 | tail -c 1500
}
bench_integrity 1 120
echo "--- delta $(el) s" | tee -a $LOG
cd $ROOT && PREVIOUS=device BENCH_LIMIT=${DELTA_LIMIT:-170} bash benchmarks/delta_gpu.sh 2>&1 | tail -c 3500
cd /tmp/src
left=$(( ${TOTAL:-400} - $(el) ))
if [ $left -gt 70 ]; then bench_integrity 0 $left; else echo "no time left for the torch-path integrity run"; fi
echo "--- done $(el) s" | tee -a $LOG
