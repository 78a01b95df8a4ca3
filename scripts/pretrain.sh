#!/usr/bin/env bash
# Pretrain a Linformer (or the RoBERTa baseline) with one of configs/pretraining/*.yaml, on one
# node's GPUs or on the CPU, keeping the config's global batch. See --help.
set -euo pipefail
# shellcheck source=scripts/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() {
    cat <<HELP
Usage: scripts/pretrain.sh [options] CONFIG DATA [OVERRIDE ...]

Masked-LM pretraining with fairseq-hydra-train and configs/pretraining/CONFIG.yaml (the paper's
recipe: 250k updates, fp16, global batch 2048 sequences). update_freq is recomputed for the
number of GPUs so the global batch stays the config's. Relaunching the same command resumes.

  CONFIG              e.g. linformer_n512_k128_headwise, linformer_n4096_k256, roberta_base
  DATA                fairseq data-bin folder, or shard folders joined by ':'

Options:
$COMMON_HELP
  --nodes N           nodes (default 1); N > 1 runs one copy per GPU under srun, which
                      scripts/slurm/pretrain.sbatch does, with --distributed-port P
  --from CHECKPOINT   continue pretraining CHECKPOINT's model (its architecture, max_positions,
                      k, sharing, ... are read from it) with a fresh optimizer and schedule, on
                      blocks of its max_positions tokens: the step after
                      scripts/extend_max_positions.py, with CONFIG extend (default --save-dir:
                      checkpoints/CONFIG/<CHECKPOINT's file name without .pt>)

Examples:
  scripts/pretrain.sh --gpus 8 linformer_n512_k128_headwise data-bin/shard0:data-bin/shard1
  scripts/pretrain.sh --cpu --global-batch 8 --batch-size 8 linformer_n512_k128_headwise \\
      data-bin/shard0 optimization.max_update=100 model.encoder_layers=2
  scripts/pretrain.sh --gpus 8 --from checkpoints/n2048.pt extend data-bin/shard0
HELP
}

ARGS=() FROM=''
while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --from)
            (($# >= 2)) || die "$1 needs a value"
            FROM=$2
            shift 2 ;;
        *) if common_option "$@"; then shift "$CONSUMED"; else ARGS+=("$1"); shift; fi ;;
    esac
done
((${#ARGS[@]} >= 2)) || die "need CONFIG and DATA (see --help)"
CONFIG=${ARGS[0]%.yaml} DATA=${ARGS[1]}
IFS=: read -r -a DATA_DIRS <<<"$DATA"  # split at ':' only: a folder name may hold spaces
for dir in "${DATA_DIRS[@]}"; do
    [[ -d $dir ]] || ((DRY_RUN)) || die "data folder $dir does not exist"
done
OVERRIDES=("task.data=$(hydra_quote "$DATA")" "${ARGS[@]:2}")
if [[ -n $FROM ]]; then
    FROM_NAME=$(basename "$FROM")
    SAVE_DIR=${SAVE_DIR:-checkpoints/$CONFIG/${FROM_NAME%.pt}}
    BLOCKS_OF_MODEL_LENGTH=1
else
    SAVE_DIR=${SAVE_DIR:-checkpoints/$CONFIG}
fi
launch "$REPO/configs/pretraining" "$CONFIG"
