#!/bin/bash
# One device call with the vLLM GPU kit (vLLM 0.26): each JOBS entry scenario:receiver:tag[:late] (:late: the reader sends
# each step's call after the trainers' written, --call-after-written; default: real vLLM and
# faithful colo-1gpu, faithful nixl-1gpu, real vLLM again; qwen3-8b, STEPS timed steps each, every step verified), a
# summary line each, the JSON under $OUT; then the GPU tests when TEST=1. From the repo root on the device, carrying
# .vgpu (the kit), .nixlwhl (nixl_cu13_cp312_ucx.tar.xz) and .snap_vllm (src.tar.gz: git archive of a commit,
# commit: its hash; build them with
#   mkdir -p .snap_vllm && git archive --format=tar.gz -o .snap_vllm/src.tar.gz HEAD && git rev-parse --short HEAD > .snap_vllm/commit
# and run `bash benchmarks/vllm_kit_gpu.sh`).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$PWD; SNAP=$R/.snap_vllm; C=$(cat $SNAP/commit)
rm -rf /tmp/s /tmp/nx; mkdir -p /tmp/s /tmp/nx
tar -xzf $SNAP/src.tar.gz -C /tmp/s || exit 3
tar -xJf $R/.nixlwhl/nixl_cu13_cp312_ucx.tar.xz -C /tmp/nx || exit 4
. $R/.vgpu/go.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd /tmp/s
b() { # scenario receiver tag [late]
  PYTHONPATH=/tmp/nx:/tmp/s:/tmp/site WEIGHTSYNC_COMMIT=$C setsid -w timeout -k 10 ${BL:-150} python3 -m weightsync bench \
    --scenario $1 --model qwen3-8b --receiver $2 --steps ${STEPS:-20} --baselines "" --timeout 60 --json \
    ${4:+--call-after-written} > $OUT/$3.out 2> $OUT/$3.err
  echo "$3 rc=$?"
  grep '^{' $OUT/$3.out | tail -1 > $OUT/$3.json
  python3 -c "import json; r=json.load(open('$OUT/$3.json')); p=r.get('phase_median_seconds',{}); print(r['scenario'], r['receiver'], round(r['median_seconds']*1e3,2), 'floor', round(r['floor_seconds']*1e3,2), 'eff', round(r['efficiency'],3), 'verified', r['verified'], {k: round(v*1e3,3) for k,v in p.items() if k in ('reader.workers','reader.transport','reader.posting','reader.started','writer.written')})" || tail -5 $OUT/$3.err
}
for job in ${JOBS:-colo-1gpu:vllm:colo-vllm colo-1gpu:faithful:colo-faithful nixl-1gpu:faithful:nixl-faithful colo-1gpu:vllm:colo-vllm2}; do
  IFS=: read sc rc tag late <<< "$job"; b $sc $rc $tag $late
done
if [ "${TEST:-0}" = 1 ]; then
  cd /tmp/s && PYTHONPATH=/tmp/nx:$PYTHONPATH setsid -w timeout -k 10 ${TL:-240} python3 -m pytest -q -m gpu -p no:cacheprovider -rs > $OUT/test-gpu.log 2>&1
  echo "test-gpu rc=$?"; tail -3 $OUT/test-gpu.log
fi
