#!/usr/bin/env bash
# Usage: studies/study_quality.sh [OPTION ...]   (--help lists the options)
# The quality study: Linformer variants against RoBERTa of the same size, data, budget and seed.
# Its report fills docs/quality.md. The logic is in study_quality.py, run with $PYTHON (python3).
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/study_quality.py" "$@"
