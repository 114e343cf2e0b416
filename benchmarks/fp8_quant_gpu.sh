#!/bin/bash
# The block-FP8 quantizer (weightsync/quant/fp8.py) on the 1-GPU host, in one device call: its GPU tests (the Triton
# kernel vs the torch definition on CPU and GPU, hardware and integer e4m3 casts; the upstream formula run eagerly on
# CUDA), then its rate on qwen3-8b's linear weights against a device copy measured in the same run
# (benchmarks/fp8_quant_speed.py), with the hardware cast and with the integer one. Run it from a snapshot folder
# (git archive HEAD) so nobody's uncommitted edits travel. Logs under $OUT: fp8.log, speed.json, speed_soft.json.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/fp8.log
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' 2>&1 | tee -a $LOG
echo "--- tests $(el) s" | tee -a $LOG
timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -x tests/test_fp8_gpu.py >> $LOG 2>&1
echo "tests rc=$? $(el) s" | tee -a $LOG; tail -n 4 $LOG
echo "--- speed (hardware cast) $(el) s" | tee -a $LOG
timeout ${SPEED_LIMIT:-60} python3 benchmarks/fp8_quant_speed.py --out $OUT/speed.json >> $LOG 2>&1; echo "speed rc=$?" | tee -a $LOG
if [ "${SOFT_SPEED:-1}" = 1 ]; then
  echo "--- speed (integer cast) $(el) s" | tee -a $LOG
  WEIGHTSYNC_FP8_SOFT_CAST=1 timeout ${SPEED_LIMIT:-60} python3 benchmarks/fp8_quant_speed.py --out $OUT/speed_soft.json >> $LOG 2>&1
  echo "speed soft rc=$?" | tee -a $LOG
fi
cat $OUT/speed.json $OUT/speed_soft.json 2>/dev/null
echo "--- done $(el) s" | tee -a $LOG
