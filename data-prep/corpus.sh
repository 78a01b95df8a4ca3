#!/usr/bin/env bash
# Build the pretraining corpus (Wikipedia dump and/or books) -> train.txt, valid.txt.
# Run with --help for the options; the logic lives in dataprep/corpus.py.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" DATAPREP_PROG="$(basename "$0")"
exec "${PYTHON:-python3}" -m dataprep.corpus "$@"
