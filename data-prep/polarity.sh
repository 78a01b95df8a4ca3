#!/usr/bin/env bash
# Pang & Lee's movie-review polarity dataset (whole reviews) as an aclImdb_v1-layout tarball.
# Run with --help for the options; the logic lives in dataprep/polarity.py.
DATAPREP_PROG=$(basename "$0") exec "${PYTHON:-python3}" -m dataprep.polarity "$@"
