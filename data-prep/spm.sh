#!/usr/bin/env bash
# Train sentencepiece and write dict.txt (train), or encode text with it (encode).
# Run with --help for the options; the logic lives in dataprep/spm.py.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" DATAPREP_PROG="$(basename "$0")"
exec "${PYTHON:-python3}" -m dataprep.spm "$@"
