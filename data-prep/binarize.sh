#!/usr/bin/env bash
# Binarize an encoded corpus into fairseq shards data-bin/shard0..N-1.
# Run with --help for the options; the logic lives in dataprep/binarize.py.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" DATAPREP_PROG="$(basename "$0")"
exec "${PYTHON:-python3}" -m dataprep.binarize "$@"
