#!/usr/bin/env bash
# Quickstart: the whole path on the bundled sample text, on a CPU, in a few minutes.
#   corpus -> sentencepiece -> data-bin shards -> tiny Linformer MLM pretraining
#   -> SST-2 finetuning -> validation perplexity, dev accuracy, where the outputs are.
# Each finished step is reused when the script runs again.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${QUICKSTART_DIR:-$REPO/work/quickstart}"
PRETRAIN_UPDATES="${QUICKSTART_PRETRAIN_UPDATES:-400}"
FINETUNE_EPOCHS="${QUICKSTART_FINETUNE_EPOCHS:-4}"
PYTHON="${PYTHON:-python3}"
WORKERS=2
BASELINE=""  # "-roberta": the same steps with fairseq's RoBERTa instead of the Linformer

usage() {
    cat <<EOF
usage: $(basename "$0") [--out DIR] [--pretrain-updates N] [--finetune-epochs N] [--roberta]

Builds a corpus from data/sample (WikiText-2 excerpt + 4 Gutenberg books), trains a
sentencepiece model, binarizes 2 shards, pretrains a small Linformer (2 layers, 128 dims,
n=128, k=32, conv projection) with masked LM and finetunes it on the bundled SST-2 sample, both
through the launchers (scripts/pretrain.sh, scripts/finetune.sh) with configs/*/quickstart.yaml,
and prints the validation perplexity, the SST-2 dev accuracy and the output paths.

  --out DIR              output folder (default \$QUICKSTART_DIR or work/quickstart; now $OUT)
  --pretrain-updates N   pretraining updates (default $PRETRAIN_UPDATES)
  --finetune-epochs N    SST-2 epochs (default $FINETUNE_EPOCHS)
  --roberta              the baseline: fairseq's RoBERTa of the same size, data and budget
                         (outputs named *-roberta, beside the Linformer's; data is shared)
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --pretrain-updates) PRETRAIN_UPDATES="$2"; shift 2 ;;
        --finetune-epochs) FINETUNE_EPOCHS="$2"; shift 2 ;;
        --roberta) BASELINE="-roberta"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
for n in "$PRETRAIN_UPDATES" "$FINETUNE_EPOCHS"; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: '$n' is not a positive integer" >&2; exit 2; }
done

SAMPLE="$REPO/data/sample"
DP="$REPO/data-prep"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
START=$SECONDS
step() { echo; echo "== [$((SECONDS - START))s] $*"; }

step "1/7 corpus from $SAMPLE (WikiText-2 excerpt as Wikipedia, 4 books as BookCorpus)"
"$DP/corpus.sh" --out "$OUT/corpus" --valid-docs 4 \
    --wikitext "$SAMPLE/wikitext-2/wiki.train.tokens" "$SAMPLE/wikitext-2/wiki.valid.tokens" \
    --books "$SAMPLE/books"

step "2/7 sentencepiece (vocab 8000)"
"$DP/spm.sh" train --corpus "$OUT/corpus/train.txt" --out "$OUT/spm" --vocab-size 8000 \
    --workers $WORKERS
"$DP/spm.sh" encode --model "$OUT/spm/spm.model" --workers $WORKERS \
    --inputs "$OUT/corpus/train.txt" "$OUT/corpus/valid.txt" \
    --outputs "$OUT/corpus/train.spm" "$OUT/corpus/valid.spm"

step "3/7 binarize into 2 shards"
"$DP/binarize.sh" --train "$OUT/corpus/train.spm" --valid "$OUT/corpus/valid.spm" \
    --srcdict "$OUT/spm/dict.txt" --destdir "$OUT/data-bin" --shards 2 --workers $WORKERS

step "4/7 SST-2 sample"
"$DP/glue.sh" --glue-dir "$SAMPLE/glue" --tasks SST-2 --spm-model "$OUT/spm/spm.model" \
    --srcdict "$OUT/spm/dict.txt" --destdir "$OUT/glue" --workers $WORKERS

# Both stages train through the launchers and configs/*/quickstart.yaml, as a cluster run does
# through the same launchers and the paper's configs. A stage is done once its save dir holds
# 'finished'; a killed stage resumes from its checkpoint_last.pt when the quickstart reruns.
ARCH=()
if [[ -n $BASELINE ]]; then
    ARCH=(arch=roberta)  # the config's group: fairseq's RoBERTa, the same size
fi
stage() {  # NAME LAUNCHER ARGS...: run the launcher into $OUT/NAME; its whole output goes to
    local name=$1 dir="$OUT/$1"; shift  # $OUT/NAME.log, the console shows the progress lines
    if [[ -f $dir/finished ]]; then echo "skip $name: $dir/finished exists"; return; fi
    if ! "$@" --cpu --save-dir "$dir" 2>&1 | tee "$OUT/$name.log" |
        grep --line-buffered -E '^(plan|batch|error)|\]\[(train_inner|valid)\]'; then
        echo "error: $name failed; last lines of $OUT/$name.log:" >&2
        tail -n 20 "$OUT/$name.log" >&2
        exit 1
    fi
    touch "$dir/finished"
}

step "5/7 pretrain$BASELINE: masked LM, $PRETRAIN_UPDATES updates (configs/pretraining/quickstart.yaml)"
stage "pretrain$BASELINE" "$REPO/scripts/pretrain.sh" quickstart "$OUT/data-bin/shard0:$OUT/data-bin/shard1" \
    "${ARCH[@]}" "optimization.max_update=$PRETRAIN_UPDATES" "lr_scheduler.warmup_updates=$((PRETRAIN_UPDATES / 10))"

step "6/7 finetune$BASELINE on SST-2: $FINETUNE_EPOCHS epochs (configs/finetuning/quickstart.yaml)"
SST_ROWS=$(tr -d ' \n' <"$OUT/glue/SST-2-bin/meta.json" | sed -n 's/.*"train":\([0-9]*\).*/\1/p')
# shellcheck disable=SC2017  # whole batches per epoch, times the epochs
SST_UPDATES=$(( (SST_ROWS + 31) / 32 * FINETUNE_EPOCHS ))
stage "sst2$BASELINE" "$REPO/scripts/finetune.sh" quickstart "$OUT/pretrain$BASELINE/checkpoint_best.pt" \
    --data "$OUT/glue/SST-2-bin" "optimization.max_epoch=$FINETUNE_EPOCHS" \
    "optimization.max_update=$SST_UPDATES" "lr_scheduler.warmup_updates=$((SST_UPDATES / 16))"

step "7/7 results"
"$PYTHON" "$REPO/scripts/collect_results.py" --quickstart "$OUT/pretrain$BASELINE" "$OUT/sst2$BASELINE" \
    --dev-tsv "$SAMPLE/glue/SST-2/dev.tsv"
echo "quickstart finished in $((SECONDS - START)) s"
