#!/bin/bash
# The delta sender on the 1-GPU host, two commits A and B in one device call: the sender tests on B's tree, then
# for each leg benchmarks/delta_phases.py (B's script, over that leg's weightsync) and the nixl-1gpu delta bench
# (previous version on the GPU) of that leg's tree. Both legs run against code that has the codec stage: the phases
# script drives its API (weightsync.codec.delta, from 0b6aaae on); a leg whose tree predates it is refused by name
# before anything runs (its phases cannot be measured by this script; its bench could, but a half-compared pair is
# not a before/after). Legs are labelled by their commits, never "old"/"new" by assumption.
# Carry .nixlwhl/nixl_cu13_cp312_ucx.tar.xz and a folder $SRC (default .nixlwhl/hI) holding a.tar.gz, b.tar.gz
# (git archive of each commit) and a.commit, b.commit (the hashes), so nobody's uncommitted edits travel.
# LEGS="b" runs B alone (A's files are then not needed). Logs under $OUT: run.log, phases-{a,b}.json,
# bench-{a,b}.json.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SRC=${SRC:-.nixlwhl/hI}
LEGS=${LEGS:-"a b"}
T0=$(date +%s)
LOG=$OUT/run.log
el() { echo $(( $(date +%s) - T0 )); }
label() { cat $SRC/$1.commit 2>/dev/null || echo "(no $1.commit)"; }
rm -rf /tmp/hI_site /tmp/hI_a /tmp/hI_b && mkdir -p /tmp/hI_site /tmp/hI_a /tmp/hI_b
tar -xJf .nixlwhl/nixl_cu13_cp312_ucx.tar.xz -C /tmp/hI_site || exit 3
for leg in $LEGS b; do
  [ -f /tmp/hI_$leg/weightsync/__init__.py ] || tar -xzf $SRC/$leg.tar.gz -C /tmp/hI_$leg || exit 4
  if [ ! -f /tmp/hI_$leg/weightsync/codec/delta.py ]; then
    echo "leg $leg ($(label $leg)) predates the codec stage (no weightsync/codec/delta.py): delta_phases.py drives" \
         "the codec API, so this pair cannot be compared by this script; pick commits from 0b6aaae on" | tee -a $LOG
    exit 5
  fi
done
{ python3 -c "import sys,torch,triton;print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  for leg in $LEGS; do echo "leg $leg: $(label $leg)"; done; } 2>&1 | tee -a $LOG
cd /tmp/hI_b
echo "--- tests (b: $(label b)) $(el) s" | tee -a $LOG
PYTHONPATH=/tmp/hI_site:/tmp/hI_b timeout ${TEST_LIMIT:-90} python3 -m pytest -q -p no:cacheprovider tests/test_delta_sender.py >> $LOG 2>&1
echo "tests rc=$?" | tee -a $LOG; tail -n 2 $LOG
phases() {  # $1: the leg (the weightsync it imports); the script is B's
  echo "--- phases $1 ($(label $1)) $(el) s" | tee -a $LOG
  PYTHONPATH=/tmp/hI_site:/tmp/hI_$1 timeout "$2" python3 /tmp/hI_b/benchmarks/delta_phases.py --model qwen3-8b \
    --steps ${PSTEPS:-3} --out $OUT/phases-$1.json >> $LOG 2>&1
  echo "phases $1 rc=$?" | tee -a $LOG
}
bench() {  # $1: the leg
  echo "--- bench $1 ($(label $1)) $(el) s" | tee -a $LOG
  cd /tmp/hI_$1
  PYTHONPATH=/tmp/hI_site:/tmp/hI_$1 timeout "$2" python3 -m weightsync bench --scenario nixl-1gpu --model qwen3-8b \
    --steps ${BSTEPS:-10} --baselines "" --timeout 100 --delta --delta-previous device \
    ${FRACTIONS:+--change-fraction $FRACTIONS} --json > $OUT/bench-$1.json 2>> $LOG
  echo "bench $1 rc=$?" | tee -a $LOG
  cd /tmp/hI_b
}
[ "${PHASES:-1}" = 1 ] && for leg in $LEGS; do phases $leg ${PHASE_LIMIT:-80}; done
for leg in $LEGS; do
  left=$(( ${TOTAL:-260} - $(el) ))
  if [ $left -gt 75 ]; then bench $leg $(( left < ${BENCH_LIMIT:-110} ? left - 10 : ${BENCH_LIMIT:-110} ));
  else echo "no time left for the bench of leg $leg ($(label $leg))" | tee -a $LOG; fi
done
echo "--- done $(el) s" | tee -a $LOG
LEGS="$LEGS" SRC="$SRC" python3 - <<'PY'
import json, os
out, src = os.environ["OUT"], os.environ["SRC"]

def label(leg):
    try:
        return open(f"{src}/{leg}.commit").read().strip()
    except OSError:
        return "?"

for leg in os.environ["LEGS"].split():
    try:
        r = json.load(open(f"{out}/phases-{leg}.json"))
    except Exception as e:
        print("phases", leg, label(leg), "none:", e); continue
    for f in r["fractions"]:
        print(f"phases {leg} {label(leg)} {f['fraction']:.3f} {f['kinds']}: encode {f['sender_encode_s']*1e3:.1f} ms "
              f"{[round(x*1e3,1) for x in f['sender_encode_all_s']]} {({k: round(v*1e3,1) for k, v in f['sender_phases_s'].items()})} "
              f"apply {f['receiver_fetch_apply_s']*1e3:.1f} proof {f['receiver_proof_s']*1e3:.1f} "
              f"exact {f['exact_after_apply']} proven {f['proven_before_apply']}")
for leg in os.environ["LEGS"].split():
    try:
        r = [json.loads(x) for x in open(f"{out}/bench-{leg}.json") if x.startswith('{"scenario"')][-1]
    except Exception as e:
        print("bench", leg, label(leg), "none:", e); continue
    d = r.get("delta", {})
    print("bench", leg, label(leg), "full", round(r["median_seconds"] * 1e3, 1), "ms verified", r.get("verified"),
          "delta verified", d.get("verified"), [e[-300:] for e in r.get("errors", [])])
    for run in d.get("runs", []):
        print("  errors", [e[-800:] for e in run["errors"]])
        for row in run.get("rows", []):
            print(f"  {row['fraction']:.3%}: median {row['median_seconds']*1e3:.1f} ms p90 {row['p90_seconds']*1e3:.1f} "
                  f"full reads {row['full_reads']}", {k: round(v*1e3, 1) for k, v in row["phase_median_seconds"].items()})
PY
