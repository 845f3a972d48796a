#!/usr/bin/env bash
# One launcher on this node, for multi-node runs without ssh between nodes.
#
# Under Slurm, the sbatch script from launch/slurm.py runs this once per node via srun, and everything
# comes from Slurm's environment. By hand, run it on every node with the same MASTER_ADDR and NNODES and
# that node's NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 launch/node.sh train.py recipe=...   # node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 launch/node.sh train.py recipe=...   # node 1
#
# deepspeed (the default NODE_LAUNCHER) runs `deepspeed --no_ssh --node_rank K`: it needs a hostfile with one
# distinct name per node (HOSTFILE; written here from SLURM_JOB_NODELIST, or node0..nodeN-1 off Slurm).
# NODE_LAUNCHER=torchrun runs `torchrun --nnodes N --node_rank K` instead.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_LAUNCHER=${NODE_LAUNCHER:-deepspeed}

if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    else
        echo "launch/node.sh: set MASTER_ADDR to the address of node 0" >&2
        exit 2
    fi
fi
if [[ $# -lt 1 ]]; then
    echo "usage: launch/node.sh train.py key=value ..." >&2
    exit 2
fi
echo "launch/node.sh: node ${NODE_RANK}/${NNODES} on $(hostname), ${GPUS_PER_NODE} rank(s), master ${MASTER_ADDR}:${MASTER_PORT}, ${NODE_LAUNCHER}"

case "$NODE_LAUNCHER" in
    deepspeed)
        if [[ -z "${HOSTFILE:-}" ]]; then
            HOSTFILE=$(mktemp "${TMPDIR:-/tmp}/ultrascale-hostfile.XXXXXX")
            trap 'rm -f "$HOSTFILE"' EXIT
            "$PYTHON" -m launch.hostfile --slots "$GPUS_PER_NODE" --nnodes "$NNODES" -o "$HOSTFILE"
        fi
        # not exec: the EXIT trap removes the temporary hostfile
        "$PYTHON" -m deepspeed.launcher.runner --no_ssh --node_rank "$NODE_RANK" --num_nodes "$NNODES" \
            --num_gpus "$GPUS_PER_NODE" --hostfile "$HOSTFILE" \
            --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$@"
        ;;
    torchrun)
        exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" \
            --nproc_per_node "$GPUS_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$@"
        ;;
    *)
        echo "launch/node.sh: NODE_LAUNCHER=$NODE_LAUNCHER; choose deepspeed or torchrun" >&2
        exit 2
        ;;
esac
