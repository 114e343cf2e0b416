#!/bin/bash
# Delta over nixl on the 1-GPU host with integrity=1 (nixl-1gpu, qwen3-0.6b, previous version on the GPU, 1% change):
# a smoke run of the codec stage's integrity path on CUDA. From a committed tree: $SRC/src.tar.gz (git archive) and
# $SRC/commit (default SRC=.snap_h3, carried); NIXL from .nixlwhl as in benchmarks/delta_gpu.sh. Run at ee3209a (as
# .snap_h3/gpu.sh): benchmarks/results/2026-12-02-h200x1-qwen3-0.6b-nixl-1gpu-delta-integrity1-ee3209a.json
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD; T0=$(date +%s); SRC=${SRC:-.snap_h3}
mkdir -p /tmp/h3s /tmp/h3src && tar -xJf .nixlwhl/nixl_cu13_cp312_ucx.tar.xz -C /tmp/h3s && tar -xzf $SRC/src.tar.gz -C /tmp/h3src || exit 3
cd /tmp/h3src && export PYTHONPATH=/tmp/h3s:/tmp/h3src
{ echo "commit $(cat $ROOT/$SRC/commit)"; python3 -c "import torch;print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } 2>&1 | tee $OUT/env.txt
timeout ${LIMIT:-80} python3 -m weightsync bench --scenario nixl-1gpu --model ${MODEL:-qwen3-0.6b} --steps ${STEPS:-3} \
  --baselines "" --timeout 40 --delta --delta-previous device --change-fraction 0.01 --integrity 1 --json \
  > $OUT/bench.json 2> $OUT/bench.err
echo "bench rc=$? in $(( $(date +%s) - T0 )) s"
grep -v "NIXL INFO\|UCX  WARN" $OUT/bench.err | grep -v "^\s*$" | tail -c 1500
python3 - <<'PY'
import json, os
try:
    r = [json.loads(x) for x in open(os.environ["OUT"] + "/bench.json") if x.startswith('{"scenario"')][-1]
except Exception as e:
    raise SystemExit(f"no JSON: {e}")
print({k: r.get(k) for k in ("scenario", "model", "bytes_moved", "median_seconds", "verified", "integrity")})
for e in r.get("errors", []):
    print("error", e[-1500:])
d = r.get("delta", {})
print("delta verified", d.get("verified"))
for run in d.get("runs", []):
    print(run["previous"], "errors", [e[-1500:] for e in run["errors"]])
    for row in run.get("rows", []):
        print(f"  {row['fraction']:.3%}: {row['bytes_moved'] / 1e6:.1f} MB ({row['bytes_ratio_to_full']:.4f}), "
              f"median {row['median_seconds'] * 1e3:.1f} ms, full reads {row['full_reads']}",
              {k: round(v * 1e3, 1) for k, v in row["phase_median_seconds"].items()})
PY
