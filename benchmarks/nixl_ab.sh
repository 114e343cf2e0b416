#!/bin/bash
# nixl-1gpu before/after on the 1-GPU host in one device call (issue 26 item 2): old and new trees from
# `git archive` tarballs (SNAP/old.tar.gz, SNAP/new.tar.gz, with old.commit / new.commit) so that nobody's
# uncommitted edits travel; NIXL from the stripped wheel (W, as benchmarks/ab_gpu.sh). Order: old, new,
# new without the reader's NIXL progress thread; then benchmarks/nixl_gpu.py --layout qwen3-8b (the model's
# tensors READ several ways, beside the device copy). Results under $OUT.
#   carry: SNAP (default .snap_h5) and .nixlwhl/nixl_cu13_cp312_ucx.tar.xz
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
SNAP=${SNAP:-.snap_h5}; W=.nixlwhl
rm -rf /tmp/nx_site /tmp/nx_old /tmp/nx_new && mkdir -p /tmp/nx_site /tmp/nx_old /tmp/nx_new
tar -xJf $W/nixl_cu13_cp312_ucx.tar.xz -C /tmp/nx_site || exit 3
tar -xzf $SNAP/old.tar.gz -C /tmp/nx_old && tar -xzf $SNAP/new.tar.gz -C /tmp/nx_new || exit 4
python3 -c "import sys,torch;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "old $(cat $SNAP/old.commit) new $(cat $SNAP/new.commit) at $(el) s"
bench() {  # $1 old|new, $2 tag, then env assignments
  side=$1; tag=$2; shift 2
  cd /tmp/nx_$side
  env "$@" WEIGHTSYNC_COMMIT=$(cat $ROOT/$SNAP/$side.commit) PYTHONPATH=/tmp/nx_site:/tmp/nx_$side \
    timeout "${BENCH_LIMIT:-60}" python3 -m weightsync bench --scenario nixl-1gpu --model qwen3-8b \
    --steps "${STEPS:-10}" --baselines "" --timeout 60 --json > $OUT/nixl-1gpu-$side-$tag.json 2> /tmp/nx_err
  echo "== $(el) s $side $tag rc=$?"
  python3 /tmp/nx_new/benchmarks/summary.py $OUT/nixl-1gpu-$side-$tag.json 2>&1 | head -3 || tail -c 600 /tmp/nx_err
  cd $ROOT
}
bench old 1 X=1
bench new 1 X=1
bench new nothread WEIGHTSYNC_NIXL_RX_PROGRESS_THREAD=0
echo "--- layout $(el) s"
cd /tmp/nx_new && PYTHONPATH=/tmp/nx_site:/tmp/nx_new timeout "${LAYOUT_LIMIT:-90}" python3 benchmarks/nixl_gpu.py \
  --layout qwen3-8b --out $OUT/layout-qwen3-8b.json > /tmp/nx_layout.log 2>&1
echo "layout rc=$? at $(el) s"; tail -c 1500 /tmp/nx_layout.log
