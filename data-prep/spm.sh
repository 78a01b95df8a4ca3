#!/usr/bin/env bash
# Train sentencepiece and write dict.txt (train), or encode text with it (encode).
# Run with --help for the options; the logic lives in dataprep/spm.py.
# dataprep is installed with the plugin (setup.py); DATAPREP_PROG names this wrapper in --help
DATAPREP_PROG=$(basename "$0") exec "${PYTHON:-python3}" -m dataprep.spm "$@"
