#!/usr/bin/env bash
# Two "nodes" on one 2-GPU host, as `dflashctl deploy` launches them across hosts: one
# torchrun per node (--nnodes 2 --node-rank k, static rendezvous on 127.0.0.1), node k on
# cuda:k, each with a run folder of its own (no shared storage), CUDA graphs
# (reduce-overhead, TLS-safe warm-up) and NCCL.
#   1. a run to step $FIRST: rank 0 writes the checkpoint on node 0 only
#   2. a run continuing it to step $SECOND with DFLASH_RESUME_FROM on node 0 only, as
#      dflashctl does: rank 1, which cannot see node 0's folder (a mount namespace with an
#      empty tmpfs over it), gets rank 0's state over NCCL ("(from rank 0)")
# Logs: $OUT/nodes-run1-node{0,1}.log, $OUT/nodes-run2-node{0,1}.log. From the repo root.
set -u
OUT=${OUT:-$PWD/gpu-proof-out}
FIRST=${FIRST:-60}
SECOND=${SECOND:-120}
PORT=${PORT:-29517}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd trainer || exit 2

run() {  # run NAME STEPS [RESUME_FOR_NODE0]
    local name=$1 steps=$2 resume=${3:-} pids=()
    for node in 0 1; do
        (
            export DFLASH_RUN_DIR="$WORK/node$node/$name" DFLASH_RUN_ID="$name"
            export DFLASH_NODE_RANK=$node DFLASH_NUM_NODES=2 CUDA_VISIBLE_DEVICES=$node
            if [ "$node" = 0 ] && [ -n "$resume" ]; then export DFLASH_RESUME_FROM="$resume"; fi
            mkdir -p "$DFLASH_RUN_DIR" "$WORK/node0"
            hide=()
            # Node 1 as on another host: node 0's folder hidden under an empty tmpfs in a
            # mount namespace of its own (it cannot read rank 0's checkpoint).
            if [ "$node" = 1 ]; then
                hide=(unshare -m --propagation private sh -c 'mount -t tmpfs tmpfs "$0" && exec "$@"' "$WORK/node0")
            fi
            exec "${hide[@]}" python3 -m torch.distributed.run --nnodes=2 --node-rank=$node \
                --nproc-per-node=1 --master-addr=127.0.0.1 --master-port=$PORT \
                --rdzv-id="$name" train_dflash_pipeline.py --config configs/gpu-smoke.yaml \
                --set train.steps=$steps --set train.log_every=20 --set eval.enabled=false
        ) >"$OUT/nodes-$name-node$node.log" 2>&1 &
        pids+=($!)
    done
    local code=0
    for pid in "${pids[@]}"; do wait "$pid" || code=$?; done
    echo "$name: exit $code"
    return $code
}

run run1 "$FIRST" || exit 1
ckpt=$(ls -d "$WORK"/node0/run1/outputs/checkpoints/step-* | tail -1)
echo "checkpoint on node 0: $ckpt; on node 1: $(ls "$WORK"/node1/run1/outputs/checkpoints 2>&1 | head -1)"
run run2 "$SECOND" "$ckpt" || exit 1
grep -h "resum\|step $SECOND/\|training complete\|CUDA graphs" "$OUT"/nodes-run2-node*.log | head -20
rm -rf "$WORK"
