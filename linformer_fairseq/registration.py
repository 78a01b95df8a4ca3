"""What importing the plugin registers, where fairseq is installed: torch's safe loader allows
the types fairseq checkpoints hold, and fairseq gets the plugin's models, task, bpe and optimizer
(see the package's docstring)."""

import argparse
import collections
import typing

import torch
from omegaconf import DictConfig, ListConfig
from omegaconf.base import ContainerMetadata, Metadata
from omegaconf.nodes import AnyNode

# torch >= 2.6 loads checkpoints with weights_only=True. fairseq checkpoints hold the training
# arguments as an argparse.Namespace, and when several ranks resume, rank 0 sends the others
# the loaded checkpoint with its config as an omegaconf DictConfig, which they unpickle with
# the same safe loader. Allow exactly those types; the safe loader stays on.
torch.serialization.add_safe_globals(
    [
        argparse.Namespace,
        DictConfig,
        ListConfig,
        ContainerMetadata,
        Metadata,
        AnyNode,
        typing.Any,
        dict,
        list,
        int,
        collections.defaultdict,
    ]
)

from . import encoders  # noqa: E402, F401  (registers --bpe hf_tokenizer)
from .models.imported_roberta import ImportedRobertaModel  # noqa: E402
from .models.linformer_roberta import LinformerRobertaModel  # noqa: E402  (registers the models)
from .optim import adam_fused  # noqa: E402, F401  (registers the optimizer)
from .tasks import long_sentence_prediction  # noqa: E402, F401  (registers the task)

__all__ = ["ImportedRobertaModel", "LinformerRobertaModel"]
