#!/usr/bin/env bash
# Issue 13's GPU cells for bench/gpu_island.py, one after another on one GPU, each under its own
# timeout and writing its own JSON to $OUT, so a cell that fails or runs out of time leaves the
# others. A cell is skipped when less than its timeout is left of BUDGET seconds.
#
#   OUT=bench/out/gpu BUDGET=400 PEAK=989 bash bench/gpu_island.sh
#   SET=profile OUT=bench/out/gpu bash bench/gpu_island.sh    # kernel time by kind
#
# pydantic and pynacl (imported through the inner config's records) may be missing on a GPU
# image: wheels in .whl/ are installed to /tmp/site first when that folder is there.
set -u
OUT=${OUT:-bench/out/gpu}
BUDGET=${BUDGET:-400}
PEAK=${PEAK:-989}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site
fi
nvidia-smi -L
python3 -c 'import torch, transformers, pydantic, nacl; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))'
START=$SECONDS
B=${B:-"python3 bench/gpu_island.py --device cuda --peak-tflops $PEAK"}

cell() {  # cell NAME TIMEOUT ARGS...
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt "$limit" ]; then
    echo "=== $name skipped: ${left}s left, it needs ${limit}s"
    return
  fi
  echo "=== $name (timeout ${limit}s, $((SECONDS - START))s in)"
  timeout "$limit" $B "$@" --out "$OUT/$name.json"
  echo "=== $name rc=$? at $((SECONDS - START))s"
}

if [ "${SET:-figures}" = profile ]; then  # where a step's time goes: kernels by kind
  cell g1b_prof 100 --model gemma-1b --mode plain --seq-len 2048 --micro-batch 4 --step-batch 16 --steps 2 --warmup 1 --profile
  cell g4b_prof 110 --model gemma-4b --mode plain --seq-len 2048 --micro-batch 2 --step-batch 8 --steps 2 --warmup 1 --profile
  cell g12b_prof 100 --model gemma-12b --layers 6 --mode fsdp --seq-len 2048 --micro-batch 2 --step-batch 8 --steps 2 --warmup 1 --profile
  echo "=== done at $((SECONDS - START))s"
  exit 0
fi
# gemma-1b and gemma-4b: one learner's inner steps (plain), then the island's FSDP2 path on 1 rank.
cell g1b_plain 80 --model gemma-1b --mode plain --seq-len 2048 --micro-batch 4 --step-batch 16 --steps 5 --warmup 2
cell g4b_plain 110 --model gemma-4b --mode plain --seq-len 2048 --micro-batch 2 --step-batch 8 --steps 4 --warmup 2
# gemma-12b at its real width, 2/6/10 layers, at the plan's shape for a full 12B island:
# micro-batch 1 × 4096, activation checkpointing.
cell g12b_ckpt 130 --model gemma-12b --layers 2,6,10 --mode fsdp --checkpointing --seq-len 4096 --micro-batch 1 --step-batch 4 --steps 3 --warmup 1
cell g1b_fsdp 80 --model gemma-1b --mode fsdp --seq-len 2048 --micro-batch 4 --step-batch 16 --steps 5 --warmup 2
# gemma-12b width without checkpointing: the activations per layer the plan counts, and MFU.
cell g12b_acts 90 --model gemma-12b --layers 2,6 --mode fsdp --seq-len 2048 --micro-batch 2 --step-batch 8 --steps 3 --warmup 1
cell g4b_fsdp 110 --model gemma-4b --mode fsdp --seq-len 2048 --micro-batch 2 --step-batch 8 --steps 4 --warmup 2
echo "=== done at $((SECONDS - START))s"
