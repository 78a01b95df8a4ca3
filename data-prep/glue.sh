#!/usr/bin/env bash
# Prepare the eight GLUE tasks for fairseq's sentence_prediction task.
# Run with --help for the options; the logic lives in dataprep/glue.py.
# dataprep is installed with the plugin (setup.py); DATAPREP_PROG names this wrapper in --help
DATAPREP_PROG=$(basename "$0") exec "${PYTHON:-python3}" -m dataprep.glue "$@"
