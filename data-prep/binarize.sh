#!/usr/bin/env bash
# Binarize an encoded corpus into fairseq shards data-bin/shard0..N-1.
# Run with --help for the options; the logic lives in dataprep/binarize.py.
# dataprep is installed with the plugin (setup.py); DATAPREP_PROG names this wrapper in --help
DATAPREP_PROG=$(basename "$0") exec "${PYTHON:-python3}" -m dataprep.binarize "$@"
