"""Data preparation for linformer-fairseq: raw corpora -> fairseq data-bin folders.

Each module is a stage with its own command line (see the *.sh wrappers one folder up).
"""
