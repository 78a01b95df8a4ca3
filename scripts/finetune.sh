#!/usr/bin/env bash
# Finetune a pretrained Linformer (or RoBERTa) checkpoint on a GLUE task, IMDB or long documents with
# configs/finetuning/TASK.yaml. See --help.
set -euo pipefail
# shellcheck source=scripts/launch_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"

usage() {
    cat <<HELP
Usage: scripts/finetune.sh [options] TASK CHECKPOINT [OVERRIDE ...]

Finetunes CHECKPOINT with fairseq-hydra-train and configs/finetuning/TASK.yaml (RoBERTa's
published per-task lr, batch, epochs and warmup). The model (architecture, k, sharing,
max_positions) is read from CHECKPOINT. A relaunch with the same --save-dir resumes from
its checkpoint_last.pt (or, if that file is incomplete, from the newest complete checkpoint
in --save-dir) instead of starting again from CHECKPOINT.

  TASK                cola, sst_2, mrpc, qqp, sts_b, mnli, qnli, rte or imdb (SST-2 etc. work too);
                      long_documents: two-class documents longer than 512 tokens read whole by a
                      model extended to them (with --lp-ft mean and --data; docs/long_documents.md)
  CHECKPOINT          a pretraining checkpoint, e.g. checkpoints/linformer_n512_k128_headwise/checkpoint_best.pt

Options:
  --data DIR          the task's data-bin (input0/, input1/, label/)
                      (default: DATA_ROOT/<TASK>-bin, e.g. data-bin/SST-2-bin)
  --data-root DIR     where data-prep wrote the <TASK>-bin folders, its --destdir (default:
                      data-bin, as in README.md and data-prep/README.md)
  --seed S            random seed (default 1)
  --lp-ft first|mean  LP-FT: start the classification head from a linear probe of CHECKPOINT's
                      frozen features of the training split (scripts/probe_head.py), of <s>
                      (first) or of the mean of the final states (mean: the model then reads
                      the mean). The long-document recipe, docs/long_documents.md. The probed
                      checkpoint is SAVE_DIR/probed.pt, fitted once and kept for relaunches
$COMMON_HELP
  Default --save-dir: checkpoints/finetune/<CHECKPOINT's folder name>/TASK/seed<S>, the layout
  scripts/collect_results.py reads.
HELP
}

# data-prep's folder names: GLUE's spelling of each task
task_folder() {
    case $1 in
        cola) echo CoLA ;; sst_2) echo SST-2 ;; sts_b) echo STS-B ;; *) echo "${1^^}" ;;
    esac
}

ARGS=() DATA='' DATA_ROOT=data-bin SEED=1
while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --data | --data-root | --seed | --lp-ft)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in --data) DATA=$2 ;; --data-root) DATA_ROOT=$2 ;; --seed) SEED=$2 ;; --lp-ft) LP_FT=$2 ;; esac
            shift 2 ;;
        *) if common_option "$@"; then shift "$CONSUMED"; else ARGS+=("$1"); shift; fi ;;
    esac
done
((${#ARGS[@]} >= 2)) || die "need TASK and CHECKPOINT (see --help)"
[[ $SEED =~ ^[0-9]+$ ]] || die "--seed needs a whole number, got '$SEED'"
[[ -z $LP_FT || $LP_FT == first || $LP_FT == mean ]] || die "--lp-ft takes first or mean, got '$LP_FT'"
TASK=${ARGS[0],,} CHECKPOINT=${ARGS[1]}
TASK=${TASK//-/_}
if [[ $TASK == recipe || ! -f $REPO/configs/finetuning/$TASK.yaml ]]; then
    TASKS=()
    for yaml in "$REPO"/configs/finetuning/*.yaml; do
        yaml=${yaml##*/}
        [[ $yaml == recipe.yaml ]] || TASKS+=("${yaml%.yaml}")
    done
    die "no task '${ARGS[0]}': choose one of ${TASKS[*]}"
fi
DATA=${DATA:-$DATA_ROOT/$(task_folder "$TASK")-bin}
[[ -d $DATA/input0 && -d $DATA/label ]] || ((DRY_RUN)) ||
    die "$DATA is not a sentence_prediction data-bin (no input0/ and label/): see --data"
[[ -f $CHECKPOINT ]] || die "checkpoint $CHECKPOINT does not exist"
CHECKPOINT=$(realpath "$CHECKPOINT")
SAVE_DIR=${SAVE_DIR:-checkpoints/finetune/$(basename "$(dirname "$CHECKPOINT")")/$TASK/seed$SEED}

OVERRIDES=("task.data=$(hydra_quote "$DATA")" "common.seed=$SEED" "${ARGS[@]:2}")
FROM=$CHECKPOINT
launch "$REPO/configs/finetuning" "$TASK"
