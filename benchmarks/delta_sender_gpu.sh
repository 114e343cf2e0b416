#!/bin/bash
# The delta sender on the 1-GPU host, before and after, in one device call: the sender tests on the GPU,
# benchmarks/delta_phases.py (this tree's script) over the old code and the new, then the nixl-1gpu delta bench
# (previous version on the GPU) on the new code and, time left, on the old. Carry .nixlwhl/nixl_cu13_cp312_ucx.tar.xz
# and a folder $SRC (default .nixlwhl/hI) with old.tar.gz and new.tar.gz (git archive of each commit), so nobody's
# uncommitted edits travel. Logs under $OUT: run.log, phases-{old,new}.json, bench-{new,old}.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SRC=${SRC:-.nixlwhl/hI}
T0=$(date +%s)
LOG=$OUT/run.log
el() { echo $(( $(date +%s) - T0 )); }
rm -rf /tmp/hI_site /tmp/hI_old /tmp/hI_new && mkdir -p /tmp/hI_site /tmp/hI_old /tmp/hI_new
tar -xJf .nixlwhl/nixl_cu13_cp312_ucx.tar.xz -C /tmp/hI_site || exit 3
tar -xzf $SRC/old.tar.gz -C /tmp/hI_old && tar -xzf $SRC/new.tar.gz -C /tmp/hI_new || exit 4
{ python3 -c "import sys,torch,triton;print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  echo "old $(cat $SRC/old.commit 2>/dev/null) new $(cat $SRC/new.commit 2>/dev/null)"; } 2>&1 | tee -a $LOG
cd /tmp/hI_new
echo "--- tests $(el) s" | tee -a $LOG
PYTHONPATH=/tmp/hI_site:/tmp/hI_new timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_delta_sender.py >> $LOG 2>&1
echo "tests rc=$?" | tee -a $LOG; tail -n 2 $LOG
phases() {  # $1: old or new (the weightsync it imports); the script is this tree's
  echo "--- phases $1 $(el) s" | tee -a $LOG
  PYTHONPATH=/tmp/hI_site:/tmp/hI_$1 timeout "$2" python3 /tmp/hI_new/benchmarks/delta_phases.py --model qwen3-8b \
    --steps ${PSTEPS:-3} --out $OUT/phases-$1.json >> $LOG 2>&1
  echo "phases $1 rc=$?" | tee -a $LOG
}
bench() {  # $1: old or new
  echo "--- bench $1 $(el) s" | tee -a $LOG
  cd /tmp/hI_$1
  PYTHONPATH=/tmp/hI_site:/tmp/hI_$1 timeout "$2" python3 -m weightsync bench --scenario nixl-1gpu --model qwen3-8b \
    --steps 10 --baselines "" --timeout 100 --delta --delta-previous device --json > $OUT/bench-$1.json 2>> $LOG
  echo "bench $1 rc=$?" | tee -a $LOG
  cd /tmp/hI_new
}
phases old ${PHASE_LIMIT:-80}
phases new ${PHASE_LIMIT:-80}
bench new ${BENCH_LIMIT:-110}
left=$(( ${TOTAL:-260} - $(el) ))
if [ $left -gt 75 ]; then bench old $(( left - 10 )); else echo "no time left for the old bench" | tee -a $LOG; fi
echo "--- done $(el) s" | tee -a $LOG
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for which in ("old", "new"):
    try:
        r = json.load(open(f"{out}/phases-{which}.json"))
    except Exception as e:
        print("phases", which, "none:", e); continue
    for f in r["fractions"]:
        print(f"phases {which} {f['fraction']:.3f} {f['kinds']}: encode {f['sender_encode_s']*1e3:.1f} ms "
              f"{[round(x*1e3,1) for x in f['sender_encode_all_s']]} {({k: round(v*1e3,1) for k, v in f['sender_phases_s'].items()})} "
              f"apply {f['receiver_fetch_apply_s']*1e3:.1f} proof {f['receiver_proof_s']*1e3:.1f} "
              f"exact {f['exact_after_apply']} proven {f['proven_before_apply']}")
for which in ("new", "old"):
    try:
        r = [json.loads(x) for x in open(f"{out}/bench-{which}.json") if x.startswith('{"scenario"')][-1]
    except Exception as e:
        print("bench", which, "none:", e); continue
    d = r.get("delta", {})
    print("bench", which, "full", round(r["median_seconds"] * 1e3, 1), "ms verified", r.get("verified"),
          "delta verified", d.get("verified"), [e[-300:] for e in r.get("errors", [])])
    for run in d.get("runs", []):
        print("  errors", [e[-800:] for e in run["errors"]])
        for row in run.get("rows", []):
            print(f"  {row['fraction']:.3%}: median {row['median_seconds']*1e3:.1f} ms p90 {row['p90_seconds']*1e3:.1f} "
                  f"full reads {row['full_reads']}", {k: round(v*1e3, 1) for k, v in row["phase_median_seconds"].items()})
PY
