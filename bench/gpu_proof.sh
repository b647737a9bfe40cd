#!/usr/bin/env bash
# The trainer's proof on one GPU (torch <= 2.12 shows the crash; 2.13+ has the upstream fix).
#   bench/gpu_proof.sh proof   1. TLS fix off + reduce-overhead: a drafter thread crashes with the
#                                 AssertionError from cudagraph_trees.py (gpu-tls-crash.log)
#                              2. fix on: the same config trains, loss falls, CUDA graphs are
#                                 recorded and replayed (gpu-smoke.log: "CUDA graphs recorded",
#                                 profiled cudaGraphLaunch count)
#   bench/gpu_proof.sh bench   3. compile modes and schedules on the Qwen3-8B-shaped config
#   bench/gpu_proof.sh attention  drafter attention backends, one eager step each (bench_attention.py)
#   bench/gpu_proof.sh oom     a real CUDA out-of-memory: qwen3-8b.yaml at batch 32 (gpu-cuda-oom.log)
#   bench/gpu_proof.sh all     proof + bench
#   bench/gpu_proof.sh dist    the trainer on several GPUs (bench_dist.py): dist-perf + dist-faults
#   bench/gpu_proof.sh dist-perf    1 GPU vs 2 replicas (in-process NCCL) vs torchrun 2 ranks,
#                                   torchrun 1 rank vs plain, warm-up of 1 vs 2 drafters
#   bench/gpu_proof.sh dist-faults  crash in rank 1, SIGTERM to rank 1, TLS fix off on rank 1
#                                   (and on), all under torchrun
#     (one GPU: the subset that applies; then 2 ranks share cuda:0 over gloo).
#     BENCH_DIST_ARGS adds bench_dist.py options, e.g. "--bf16 --split"; writes
#     $OUT/<mode>.txt and $OUT/<mode>/{results.json,summary.txt,dist-logs.tar.gz,layout.txt}
# Logs go to $OUT (default ./gpu-proof-out). Run from the repository root.
set -u
MODE=${1:-all}
OUT=${OUT:-$PWD/gpu-proof-out}
STEPS=${BENCH_STEPS:-30}
VARIANTS=${BENCH_VARIANTS:-eager,default,reduce-overhead,legacy-cudagraphs,sequential,reduce-overhead-dense}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$PWD
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'

if [ "$MODE" = proof ] || [ "$MODE" = all ]; then
  cd "$ROOT/trainer"
  echo "== 1. TLS fix off, reduce-overhead: expect the cudagraph_trees AssertionError"
  timeout 240 python3 train_dflash_pipeline.py --config configs/gpu-smoke.yaml \
    --set debug.tls_fix=false --set train.steps=20 --set eval.enabled=false \
    --set output_dir=/tmp/proof-crash 2>&1 | tee "$OUT/gpu-tls-crash.log"
  echo "exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tls-crash.log"
  echo "== 2. TLS fix on: the same config trains"
  timeout 300 python3 train_dflash_pipeline.py --config configs/gpu-smoke.yaml \
    --set 'debug.profile_steps=[101,110]' --set output_dir=/tmp/proof-fix 2>&1 | tee "$OUT/gpu-smoke.log"
  echo "exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-smoke.log"
  cd "$ROOT"
fi

if [ "$MODE" = bench ] || [ "$MODE" = all ]; then
  echo "== 3. benchmark: $VARIANTS on qwen3-8b.yaml, $STEPS steps each"
  python3 bench/bench_trainer.py --config trainer/configs/qwen3-8b.yaml --steps "$STEPS" \
    --log-every 5 --variants "$VARIANTS" --timeout 240 --out "$OUT/bench" 2>&1 | tee "$OUT/bench.txt"
fi

case "$MODE" in
  dist|dist-perf|dist-faults)
    PART=all
    [ "$MODE" = dist-perf ] && PART=perf
    [ "$MODE" = dist-faults ] && PART=faults
    echo "== the trainer on several GPUs: $PART"
    # shellcheck disable=SC2086  # BENCH_DIST_ARGS is a list of options
    python3 bench/bench_dist.py --part "$PART" --steps "${BENCH_STEPS:-20}" --out "$OUT/$MODE" \
      ${BENCH_DIST_ARGS:-} 2>&1 | tee "$OUT/$MODE.txt"
    if [ "$PART" != faults ] && [ -f "$OUT/$MODE/results.json" ]; then
      echo "== 8-GPU layouts from these numbers"
      python3 bench/layout_8gpu.py --results "$OUT/$MODE/results.json" 2>&1 | tee "$OUT/$MODE/layout.txt"
    fi
    ;;
esac

if [ "$MODE" = attention ]; then
  echo "== drafter attention backends on qwen3-8b.yaml (eager forward + backward)"
  python3 bench/bench_attention.py --config trainer/configs/qwen3-8b.yaml 2>&1 | tee "$OUT/attention.txt"
fi

if [ "$MODE" = oom ]; then
  cd "$ROOT/trainer"
  echo "== a real CUDA OOM: the 8B recipe at 32 sequences per step"
  timeout 240 python3 train_dflash_pipeline.py --config configs/qwen3-8b.yaml \
    --set runtime.compile=eager --set data.batch_size=32 --set train.steps=5 \
    --set output_dir=/tmp/proof-oom 2>&1 | tee "$OUT/gpu-cuda-oom.log"
  echo "exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-cuda-oom.log"
  cd "$ROOT"
fi
