#!/usr/bin/env bash
# Prepare IMDB (aclImdb_v1.tar.gz) for fairseq's sentence_prediction task.
# Run with --help for the options; the logic lives in dataprep/imdb.py.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" DATAPREP_PROG="$(basename "$0")"
exec "${PYTHON:-python3}" -m dataprep.imdb "$@"
