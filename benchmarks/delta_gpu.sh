#!/bin/bash
# weightsync bench --delta on the 1-GPU host (nixl-1gpu, qwen3-8b): the full steps, then delta steps at each
# change fraction with the previous version on the GPU and in pinned host memory. NIXL for CUDA 13 is carried
# as .nixlwhl/nixl_cu13_cp312_ucx.tar.xz; a committed tree may be carried as .nixlwhl/src.tar.gz (git archive
# HEAD) so that nobody's uncommitted edits travel into the measurement. Pass WEIGHTSYNC_COMMIT as a literal.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/site && tar -xJf .nixlwhl/nixl_cu13_cp312_ucx.tar.xz -C /tmp/site || exit 3
if [ -f .nixlwhl/src.tar.gz ]; then
  mkdir -p /tmp/src && tar -xzf .nixlwhl/src.tar.gz -C /tmp/src || exit 4
  cd /tmp/src
fi
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
{ python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nproc; free -g | head -2; echo "commit ${WEIGHTSYNC_COMMIT:-?}"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout "${BENCH_LIMIT:-460}" python3 -m weightsync bench --scenario nixl-1gpu --model "${MODEL:-qwen3-8b}" \
  --steps "${STEPS:-10}" --baselines "" --timeout "${BENCH_TIMEOUT:-100}" --delta \
  --delta-previous "${PREVIOUS:-both}" ${FRACTIONS:+--change-fraction $FRACTIONS} --json \
  > "$OUT/bench.json" 2> "$OUT/bench.err"
echo "bench rc=$? in $(( $(date +%s) - T0 )) s"
grep -v "NIXL INFO\|UCX  WARN" "$OUT/bench.err" | grep -v "^\s*$" | tail -c 2500
python3 - <<'PY'
import json, os
try:  # the workers' UCX and NIXL lines share stdout: the result is the line that starts with {"scenario"
    r = [json.loads(x) for x in open(os.environ["OUT"] + "/bench.json") if x.startswith('{"scenario"')][-1]
except Exception as e:
    raise SystemExit(f"no JSON: {e}")
print({k: r.get(k) for k in ("scenario", "bytes_moved", "median_seconds", "ceiling_bytes_per_s", "floor_seconds",
                             "efficiency", "verified")})
for e in r.get("errors", []):
    print(e[-2000:])
d = r.get("delta", {})
print("delta verified", d.get("verified"))
for run in d.get("runs", []):
    print(run["previous"], "errors", [e[-1500:] for e in run["errors"]], "device kept",
          run.get("sender_device_bytes"), "host grew", run.get("sender_host_growth_bytes"), "first step",
          run.get("first_step_bytes"), run.get("first_step_seconds"), "peak", run.get("peak_transient_bytes"))
    for row in run.get("rows", []):
        print(f"  {row['fraction']:.3%}: {row['bytes_moved'] / 1e6:.1f} MB ({row['bytes_ratio_to_full']:.4f}), "
              f"median {row['median_seconds'] * 1e3:.1f} ms p90 {row['p90_seconds'] * 1e3:.1f} ms "
              f"(x{row['seconds_ratio_to_full']:.2f} of full), floor {(row['floor_seconds'] or 0) * 1e3:.2f} ms, "
              f"full reads {row['full_reads']}")
        print("   ", {k: round(v * 1e3, 1) for k, v in row["phase_median_seconds"].items()})
PY
