#!/usr/bin/env bash
# Build the pretraining corpus (Wikipedia dump and/or books) -> train.txt, valid.txt.
# Run with --help for the options; the logic lives in dataprep/corpus.py.
# dataprep is installed with the plugin (setup.py); DATAPREP_PROG names this wrapper in --help
DATAPREP_PROG=$(basename "$0") exec "${PYTHON:-python3}" -m dataprep.corpus "$@"
