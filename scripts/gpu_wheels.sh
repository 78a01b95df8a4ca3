#!/usr/bin/env bash
# Fill a wheelhouse with what scripts/gpu_check.sh needs on a GPU machine that has PyTorch but not
# fairseq and no network: fairseq-fixed's prebuilt wheel and the packages it needs that such a
# machine lacks. See --help.
set -euo pipefail

usage() {
    cat <<HELP
Usage: scripts/gpu_wheels.sh [--python-version X.Y] [--out DIR]

Downloads, on a machine that reaches PyPI, the wheels that fairseq needs beside PyTorch for the
target machine's Python (default 3.12) into DIR (default .whl at the repository root; add /.whl/
to .git/info/exclude). fairseq-fixed ships a prebuilt manylinux wheel a Python version: its Cython
extensions do not depend on torch, and the torch C++ extensions it carries (libbase, libnat) are
used by no model of this project. On the GPU machine, scripts/gpu_check.sh installs them with:

  python3 -m pip install --no-index --no-deps --target /tmp/gpu-check-site DIR/*.whl
  export PYTHONPATH=/tmp/gpu-check-site:\$PWD PATH=/tmp/gpu-check-site/bin:\$PATH
HELP
}

PY=3.12 OUT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.whl
while (($#)); do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --python-version | --out)
            (($# >= 2)) || { echo "error: $1 needs a value" >&2; exit 2; }
            if [[ $1 == --out ]]; then OUT=$2; else PY=$2; fi
            shift 2 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ $PY =~ ^3\.[0-9]+$ ]] || { echo "error: --python-version must look like 3.12, got '$PY'" >&2; exit 2; }
mkdir -p "$OUT"
# fairseq and the requirements a bare PyTorch image lacks (torch, numpy, regex, sacrebleu, tqdm,
# cython, scikit-learn and packaging are taken as there)
PACKAGES=(fairseq-fixed==0.12.3.1 hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 bitarray)
PLATFORMS=()
for platform in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    PLATFORMS+=(--platform "$platform")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${PLATFORMS[@]}" -d "$OUT" "${PACKAGES[@]}" ||
    python3 -m pip download --quiet --no-deps --python-version "$PY" --implementation cp \
        "${PLATFORMS[@]}" -d "$OUT" "${PACKAGES[@]}"
for sdist in "$OUT"/*.tar.gz; do  # antlr4's runtime is published as source only: pure Python, so one wheel fits all
    [[ -e $sdist ]] || continue
    python3 -m pip wheel --quiet --no-deps -w "$OUT" "$sdist" && rm "$sdist"
done
ls -1 "$OUT"
echo "wheelhouse: $(du -sh "$OUT" | cut -f1) in $OUT"
