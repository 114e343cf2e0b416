#!/usr/bin/env bash
# Run bench scenarios on the GPU host and keep the raw JSON: benchmarks/run.sh OUTDIR MODEL SCENARIO...
# (each scenario in its own process, with a time limit, so one failure does not cost the others; OUTDIR.tgz
# archives it all at the end). Pass WEIGHTSYNC_COMMIT as a literal: the device copy's .git may be stale.
set -u
out=$1; model=$2; shift 2
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$out"
if [ -d .whl ] && [ ! -d /tmp/site/checkpoint_engine ]; then  # carried wheels: checkpoint-engine 0.4.2 and its needs
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
for s in "$@"; do
  t0=$(date +%s)
  timeout "${BENCH_LIMIT:-240}" python3 -m weightsync bench --scenario "$s" --model "$model" --steps "${STEPS:-5}" \
    --baselines "${BASELINES-naive,bucketed}" --timeout "${BENCH_TIMEOUT:-120}" --json \
    > "$out/$s-$model.json" 2> "$out/$s-$model.err"
  echo "== $s $model: exit $? in $(( $(date +%s) - t0 )) s"
  python3 benchmarks/summary.py "$out/$s-$model.json" || tail -c 1500 "$out/$s-$model.err"
done
# one archive of everything (the device tool returns at most 8 files a call)
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && echo "== archive: $out.tgz"
