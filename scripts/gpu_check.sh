#!/usr/bin/env bash
# The project's GPU check in one run (under 9 minutes on one H100/H200): pretrain.sh's steady state
# against fairseq's update, the band's kernels against float64 and against fused attention, and
# fairseq's update against the model's step, with model FLOPs utilization. See --help.
set -uo pipefail  # no -e: one section failing must not hide the others' tables
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

usage() {
    cat <<HELP
Usage: scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--budget SECONDS] [SECTION ...]

Runs on one CUDA GPU with PyTorch installed; fairseq is needed only by the pretrain and update
sections and is installed from DIR (default .whl, made by scripts/gpu_wheels.sh) into a private
folder when it does not import. Prints one block of tables a section and writes each section's
log to --out (default gpu-check); nothing the tools print is filtered out, warnings included
(dynamo's recompile limit, flex_attention run unfused). --budget caps the whole run (default
540 s): each section gets at most what is left, and sections past the budget are skipped with a
note.

Sections (default: all, in this order; each run has its own time limit):
  pretrain    scripts/pretrain.sh --gpus 1, fp16, 200 updates logged every 50, Linformer and
              RoBERTa at n = 512 (batch 32) and 4,096 (batch 4), on the repository's WikiText-2
              sample repeated ${REPEAT}x (one epoch holds the 200 updates: no epoch end is timed);
              updates/s over updates 51-200 from fairseq's ups of the log's records at 100, 150
              and 200, beside scripts/benchmark.py --mode update on the same config, data and
              batch: pretrain.sh / the update (the target: >= 0.8) and / the bare step
  gradients   the band's output and gradients, blockwise and flex, against float64 (bf16, padded batch)
  layer       one attention layer: SDPA, the plain Linformer (k = 256), the band (W = 128) with
              each kernel; n = 4,096 (batch 8) and 16,384 (batch 2); inference fp16, training bf16
  update      scripts/benchmark.py --mode update: fairseq's Trainer.train_step against the model's
              bare step, Linformer and RoBERTa at n = 512 (batch 32) and 4,096 (batch 4) on
              synthetic batches, bf16 (fp16 too when pretrain does not run: pretrain has fp16's)

Every training row (pretrain, update, layer training) has its MFU: the model's matmul FLOPs
(linformer_tools/mfu.py, from the model's shapes, 3x the forward) per second over the GPU's
dense bf16/fp16 peak (H100 SXM and H200 989, A100 312 TFLOP/s); another GPU: "unknown GPU: no MFU".

Example:
  scripts/gpu_wheels.sh && scripts/gpu_check.sh --out gpu-check
HELP
}

WHEELS=.whl OUT_DIR=gpu-check BUDGET=540 SECTIONS=()
REPEAT=20 PRETRAIN_UPDATES=200  # 20 copies of the sample: 281 updates an epoch of 32 x 512, 240 of 4 x 4,096
while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --wheels | --out | --budget)
            (($# >= 2)) || { echo "error: $1 needs a value" >&2; exit 2; }
            case $1 in --wheels) WHEELS=$2 ;; --out) OUT_DIR=$2 ;; --budget) BUDGET=$2 ;; esac
            shift 2 ;;
        gradients | layer | update | pretrain) SECTIONS+=("$1"); shift ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $BUDGET =~ ^[1-9][0-9]*$ ]] || { echo "error: --budget needs whole seconds, got '$BUDGET'" >&2; exit 2; }
((${#SECTIONS[@]})) || SECTIONS=(pretrain gradients layer update)
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || {
    echo "error: torch sees no CUDA GPU" >&2
    exit 2
}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
# the scripts import the plugin from this checkout, which a bare PyTorch node has not installed
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

needs_fairseq() {
    "$PYTHON" -c "import fairseq" 2>/dev/null && return 0
    [[ -d $WHEELS ]] || { echo "fairseq does not import and $WHEELS does not exist: run scripts/gpu_wheels.sh" >&2; return 1; }
    local site=/tmp/gpu-check-site
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl ||
        return 1
    export PYTHONPATH=$site:$PYTHONPATH PATH=$site/bin:$PATH
    "$PYTHON" -c "import fairseq; print('fairseq', fairseq.__version__, 'from', '$WHEELS')"
}

section() {  # NAME SECONDS COMMAND...: run it with its own limit, all its output also in OUT_DIR/NAME.log
    local name=$1 limit=$2 started status
    shift 2
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then
        echo "== $name: skipped, the ${BUDGET} s budget is spent =="
        return 124
    fi
    ((limit < left)) || limit=$left
    echo "== $name (at most ${limit} s) =="
    started=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
    status=${PIPESTATUS[0]}
    echo "[$name: $((SECONDS - started)) s, exit $status]"
    return "$status"
}

pretrain_data() {  # DIR: the sample's training text REPEAT times, binarized, unless DIR holds it
    local dir=$1 text=$OUT_DIR/wiki.train.x$REPEAT.tokens sample=data/sample/wikitext-2 i
    [[ -f $dir/valid.idx ]] && return
    for ((i = 0; i < REPEAT; i++)); do cat "$sample/wiki.train.tokens"; done >"$text"
    rm -rf "$dir.partial"
    section pretrain-data 90 fairseq-preprocess --only-source --trainpref "$text" \
        --validpref "$sample/wiki.valid.tokens" --destdir "$dir.partial" --workers "$(nproc)" &&
        mv "$dir.partial" "$dir"
    rm -f "$text"
    [[ -f $dir/valid.idx ]]
}

pretrain_group() {  # DATA BATCH LENGTH CONFIG[:OVERRIDE] ...: pretrain.sh on each, then the update of them all
    local data=$1 batch=$2 length=$3 run config extra save configs=() logs=()
    shift 3
    for run in "$@"; do
        config=${run%%:*} extra=${run#*:}
        [[ $run == *:* ]] || extra=''
        save=$OUT_DIR/pretrain-$config-n$length
        rm -rf "$save"  # a fresh run: no checkpoint to resume, a log of this run's records only
        section "pretrain-$config-n$length" 100 scripts/pretrain.sh --gpus 1 --batch-size "$batch" \
            --global-batch "$batch" --save-dir "$save" "$config" "$data" ${extra:+"$extra"} \
            optimization.max_update=$PRETRAIN_UPDATES common.log_interval=50 common.log_format=json \
            checkpoint.no_save=true
        configs+=("$config") logs+=(--pretrain-log "$config=$save/hydra_train.log")
    done
    # the same configs, data-bin and batch: epoch 1's first batches, as pretrain.sh's first updates took them
    section "pretrain-update-n$length" 90 "$PYTHON" scripts/benchmark.py --mode update --device cuda --dtype fp16 \
        --profile --data "$data" --batches 8 --config "$(IFS=,; echo "${configs[*]}")" --batch-size "$batch" \
        --lengths "$length" "${logs[@]}" --out-dir "$OUT_DIR/pretrain-update-n$length"
}

"$PYTHON" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT_DIR/device.txt"
ATTENTION=(scripts/benchmark_attention.py --device cuda --ks 256)
for part in "${SECTIONS[@]}"; do
    case $part in
        pretrain)
            needs_fairseq || continue
            data=$OUT_DIR/data-bin-x$REPEAT
            pretrain_data "$data" || { echo "== pretrain: no data-bin in $data, its runs skipped =="; continue; }
            pretrain_group "$data" 32 512 linformer_n512_k128_headwise roberta_base
            pretrain_group "$data" 4 4096 linformer_n4096_k256 roberta_base:seq_len=n4096 ;;
        gradients)
            section gradients 120 "$PYTHON" "${ATTENTION[@]}" --check-gradients --dtype bf16 --lengths 2000 \
                --batch-sizes 2 --local-windows 64,128 --local-kernels blockwise,flex ;;
        layer)
            for mode in "inference fp16" "training bf16"; do
                read -r m dtype <<<"$mode"
                section "layer-$m" 120 "$PYTHON" "${ATTENTION[@]}" --mode "$m" --dtype "$dtype" --lengths 4096,16384 \
                    --batch-sizes 8,2 --local-windows 0,128 --local-kernels blockwise,flex --repeats 10 \
                    --out "$OUT_DIR/layer-$m.json"
            done ;;
        update)
            needs_fairseq || continue
            dtypes=(bf16)
            [[ " ${SECTIONS[*]} " == *" pretrain "* ]] || dtypes=(fp16 bf16)
            for dtype in "${dtypes[@]}"; do
                for run in "linformer_n512_k128_headwise,roberta_base 32 512" "linformer_n4096_k256,roberta_base 4 4096"; do
                    read -r configs batch length <<<"$run"
                    section "update-$dtype" 120 "$PYTHON" scripts/benchmark.py --mode update --device cuda --profile \
                        --dtype "$dtype" --config "$configs" --batch-size "$batch" --lengths "$length" \
                        --out-dir "$OUT_DIR/update-$dtype-n$length"
                done
            done ;;
    esac
done
