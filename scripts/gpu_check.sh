#!/usr/bin/env bash
# The project's GPU check in one run (under 9 minutes on one H100/H200): the band's kernels against
# float64 and against fused attention, and fairseq's update against the model's step. See --help.
set -uo pipefail  # no -e: one section failing must not hide the others' tables
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

usage() {
    cat <<HELP
Usage: scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--budget SECONDS] [SECTION ...]

Runs on one CUDA GPU with PyTorch installed; fairseq is needed only by the update sections and
is installed from DIR (default .whl, made by scripts/gpu_wheels.sh) into a private folder when it
does not import. Prints one block of tables a section and writes each section's log to --out
(default gpu-check). --budget caps the whole run (default 540 s): each section gets at most what
is left, and sections past the budget are skipped with a note.

Sections (default: all, in this order; each has its own time limit):
  gradients   the band's output and gradients, blockwise and flex, against float64 (bf16, padded batch)
  layer       one attention layer: SDPA, the plain Linformer (k = 256), the band (W = 64, 128) with
              each kernel; n = 4,096 (batch 8) and 16,384 (batch 2); inference fp16, training bf16
  update      scripts/benchmark.py --mode update: fairseq's Trainer.train_step against the model's
              bare step, Linformer and RoBERTa at n = 512 (batch 32) and 4,096 (batch 4), fp16 and bf16
  pretrain    scripts/pretrain.sh --gpus 1, 60 updates, Linformer and RoBERTa at n = 512 and 4,096,
              on the repository's WikiText-2 sample: updates/s from the log

Example:
  scripts/gpu_wheels.sh && scripts/gpu_check.sh --out gpu-check
HELP
}

WHEELS=.whl OUT_DIR=gpu-check BUDGET=540 SECTIONS=()
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
((${#SECTIONS[@]})) || SECTIONS=(gradients layer update pretrain)
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

section() {  # NAME SECONDS COMMAND...: run it with its own limit, its output also in OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - SECONDS))
    if ((left < 20)); then
        echo "== $name: skipped, the ${BUDGET} s budget is spent =="
        return
    fi
    ((limit < left)) || limit=$left
    echo "== $name (at most ${limit} s) =="
    local started=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v -e '^W[0-9]' -e 'UserWarning' | tee -a "$OUT_DIR/$name.log"
    echo "[$name: $((SECONDS - started)) s, exit ${PIPESTATUS[0]}]"
}

"$PYTHON" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT_DIR/device.txt"
ATTENTION=(scripts/benchmark_attention.py --device cuda --ks 256)
for part in "${SECTIONS[@]}"; do
    case $part in
        gradients)
            section gradients 120 "$PYTHON" "${ATTENTION[@]}" --check-gradients --dtype bf16 --lengths 2000 \
                --batch-sizes 2 --local-windows 64,128 --local-kernels blockwise,flex ;;
        layer)
            for mode in "inference fp16" "training bf16"; do
                read -r m dtype <<<"$mode"
                section "layer-$m" 150 "$PYTHON" "${ATTENTION[@]}" --mode "$m" --dtype "$dtype" --lengths 4096,16384 \
                    --batch-sizes 8,2 --local-windows 0,64,128 --local-kernels blockwise,flex --repeats 10 \
                    --out "$OUT_DIR/layer-$m.json"
            done ;;
        update)
            needs_fairseq || continue
            for dtype in fp16 bf16; do
                for run in "linformer_n512_k128_headwise,roberta_base 32 512" "linformer_n4096_k256,roberta_base 4 4096"; do
                    read -r configs batch length <<<"$run"
                    section "update-$dtype" 150 "$PYTHON" scripts/benchmark.py --mode update --device cuda --profile \
                        --dtype "$dtype" --config "$configs" --batch-size "$batch" --lengths "$length" \
                        --out-dir "$OUT_DIR/update-$dtype-n$length"
                done
            done ;;
        pretrain)
            needs_fairseq || continue
            data=$OUT_DIR/data-bin
            [[ -f $data/dict.txt ]] || fairseq-preprocess --only-source --trainpref data/sample/wikitext-2/wiki.train.tokens \
                --validpref data/sample/wikitext-2/wiki.valid.tokens --destdir "$data" --workers 8 >/dev/null
            for run in "linformer_n512_k128_headwise 32" "roberta_base 32" "linformer_n4096_k256 4" \
                "roberta_base 4 seq_len=n4096"; do
                read -r config batch extra <<<"$run"
                save=$OUT_DIR/pretrain-$config-$batch
                section "pretrain" 120 scripts/pretrain.sh --gpus 1 --batch-size "$batch" --global-batch "$batch" \
                    --save-dir "$save" "$config" "$data" ${extra:+"$extra"} optimization.max_update=60 \
                    common.log_interval=10 checkpoint.no_save=true
                grep -h -o '"ups": "[0-9.]*"\|"wps": "[0-9.]*"\|"loss": "[0-9.]*"' "$save"/hydra_train.log 2>/dev/null |
                    tail -3 | tr '\n' ' '
                echo "<- $config batch $batch ${extra:-}"
            done ;;
    esac
done
