#!/usr/bin/env bash
# Every finished rank exits 0 (issue: a gloo teardown abort, "terminate called without an active exception",
# once turned a passed ZeRO-3 test into a SIGABRT). Intermittent, so it is shown by repetition, not by one run:
# the ZeRO-3 distributed tests and a 2-rank ZeRO-3 train.py run under the deepspeed launcher, N times each.
# Any non-zero exit or an abort message in any rank's output stops the loop and names the round.
#   make soak-exit            # N=20
#   N=5 bash tests/soak/exit_loop.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
N=${N:-20}
BIN=${BIN:-.venv/bin}
export DS_ACCELERATOR=cpu WANDB_MODE=offline TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export ULTRASCALE_CACHE_DIR=${ULTRASCALE_CACHE_DIR:-$PWD/.cache/ultrascale}
LOG=${LOG:-runs/soak_exit}
mkdir -p "$LOG"
aborted() { grep -lE "terminate called|Aborted|core dumped|SIGABRT" "$@" 2>/dev/null; }
t0=$(date +%s)
for i in $(seq 1 "$N"); do
  out="$LOG/pytest_$i.log"
  "$BIN/python" -m pytest -q -p no:cacheprovider -m dist -k "zero3 or stage3" tests >"$out" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || aborted "$out"; then echo "FAIL pytest round $i (rc=$rc): $out"; exit 1; fi
  echo "pytest round $i/$N: $(tail -1 "$out") [$(( $(date +%s) - t0 ))s]"
done
for i in $(seq 1 "$N"); do
  run="$LOG/train_$i"
  rm -rf "$run"
  "$BIN/deepspeed" --num_gpus 2 train.py recipe=cpu_smoke zero=stage3 train.steps=12 train.checkpoint_interval=6 \
    train.eval_interval=6 logger=none "output_dir=$run" >"$run.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || aborted "$run.log" "$run"/logs/*.log; then echo "FAIL train round $i (rc=$rc): $run.log"; exit 1; fi
  echo "train round $i/$N: exit 0, $(grep -c '"loss"' "$run/metrics.jsonl") step rows [$(( $(date +%s) - t0 ))s]"
done
echo "soak-exit: $N pytest rounds and $N train.py rounds, every rank exited 0, no abort ($(( $(date +%s) - t0 ))s)"
