#!/usr/bin/env bash
# The quality study (docs/quality.md): Linformer variants against RoBERTa of the same size,
# data, budget and seed. Run with --help for the options; the logic is in study_quality.py.
exec "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/study_quality.py" "$@"
