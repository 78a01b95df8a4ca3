"""linformer-fairseq: the Linformer (Wang et al. 2020) as a fairseq plugin.

Use as ``fairseq-train --user-dir linformer_fairseq --arch linformer_roberta_base ...``.
Importing registers the ``linformer_roberta`` model and its architectures.
"""
import argparse

import torch

# torch >= 2.6 loads checkpoints with weights_only=True, and fairseq checkpoints hold the
# training arguments as an argparse.Namespace: allow exactly that, keep the safe loader on.
torch.serialization.add_safe_globals([argparse.Namespace])

from . import models  # noqa: E402,F401  (registers the models)
