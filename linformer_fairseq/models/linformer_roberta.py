"""Linformer RoBERTa: a RoBERTa encoder (masked-LM head, classification heads) whose
self-attention is Linformer attention. Works from fairseq-train flags and from
fairseq-hydra-train yaml (model ``_name: linformer_roberta``) through one config dataclass.
"""

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
from fairseq import utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta import RobertaEncoder, RobertaModel
from fairseq.models.roberta.model import base_architecture as roberta_base_architecture
from fairseq.models.roberta.model import roberta_large_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer.transformer_config import DEFAULT_MIN_PARAMS_TO_WRAP
from fairseq.modules.transformer_sentence_encoder import init_bert_params
from omegaconf import OmegaConf, open_dict

from ..modules.linformer_attention import (
    COMPRESS_INITS,
    COMPRESS_SHARING,
    COMPRESS_TYPES,
    LENGTH_NORM_POWERS,
    LinformerSettings,
)
from ..modules.linformer_encoder import LinformerTransformerEncoder
from .classification import CHUNK_LENGTH_HELP, POOLER_TOKENS, POOLER_TOKENS_HELP, PoolerTokens
from .imported_roberta import FAIRSEQ_LAYERNORM_EPS, set_layernorm_eps


@dataclass
class LinformerRobertaConfig(FairseqDataclass):
    # RoBERTa base (the paper's Linformer base: 12 layers, 768, 12 heads, n=512, k=128)
    encoder_layers: int = field(default=12, metadata={"help": "num encoder layers"})
    encoder_embed_dim: int = field(default=768, metadata={"help": "encoder embedding dimension"})
    encoder_ffn_embed_dim: int = field(default=3072, metadata={"help": "encoder embedding dimension for FFN"})
    encoder_attention_heads: int = field(default=12, metadata={"help": "num encoder attention heads"})
    activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = field(
        default="gelu", metadata={"help": "activation function to use"}
    )
    pooler_activation_fn: ChoiceEnum(utils.get_available_activation_fns()) = field(
        default="tanh", metadata={"help": "activation function to use for pooler layer"}
    )
    encoder_normalize_before: bool = field(
        default=False, metadata={"help": "apply layernorm before each encoder block"}
    )
    layernorm_embedding: bool = field(default=True, metadata={"help": "add layernorm to embedding"})
    dropout: float = field(default=0.1, metadata={"help": "dropout probability"})
    attention_dropout: float = field(default=0.1, metadata={"help": "dropout probability for attention weights"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout probability after activation in FFN"})
    pooler_dropout: float = field(default=0.0, metadata={"help": "dropout probability in the masked_lm pooler layers"})
    pooler_tokens: ChoiceEnum(POOLER_TOKENS) = field(default="first", metadata={"help": POOLER_TOKENS_HELP})
    chunk_length: int = field(default=0, metadata={"help": CHUNK_LENGTH_HELP})
    max_positions: int = field(
        default=512, metadata={"help": "n: number of positions, and the length the projections E/F map from"}
    )
    load_checkpoint_heads: bool = field(
        default=False, metadata={"help": "(re-)register and load heads when loading checkpoints"}
    )
    untie_weights_roberta: bool = field(
        default=False, metadata={"help": "untie weights between embeddings and classifiers"}
    )
    encoder_layerdrop: float = field(default=0.0, metadata={"help": "LayerDrop probability for encoder"})
    # typing.Optional, not `str | None`: fairseq builds its argparse flags from typing.Optional
    encoder_layers_to_keep: Optional[str] = field(  # noqa: UP045
        default=None, metadata={"help": "which layers to *keep* when pruning as a comma-separated list"}
    )
    spectral_norm_classification_head: bool = field(
        default=False, metadata={"help": "apply spectral normalization on the classification head"}
    )
    checkpoint_activations: bool = field(
        default=False, metadata={"help": "checkpoint activations at each layer, trading compute for memory"}
    )
    offload_activations: bool = field(
        default=False, metadata={"help": "with --checkpoint-activations, offload activations to CPU"}
    )
    min_params_to_wrap: int = field(
        default=DEFAULT_MIN_PARAMS_TO_WRAP, metadata={"help": "minimum parameters for FSDP to wrap a layer"}
    )

    # Linformer (paper section 4)
    compressed: int = field(
        default=4, metadata={"help": "compression ratio R: k = max_positions // R (the original flag)"}
    )
    compressed_dim: int = field(
        default=0, metadata={"help": "k, the projected length; takes precedence over --compressed (0: unset)"}
    )
    layer_compressed_dims: str = field(
        default="", metadata={"help": 'non-uniform k: one value per layer, e.g. "256,256,128,..." (wins over both)'}
    )
    compress_sharing: ChoiceEnum(COMPRESS_SHARING) = field(
        default="headwise",
        metadata={
            "help": "projection sharing: none (E_i, F_i per head), headwise (E, F per layer), "
            "kv (E = F per layer), layerwise (one E for all layers, heads, keys and values). With "
            "mean pooling, which has no parameters and commutes with the key/value maps, all four "
            "build the same model; with max pooling, headwise, kv and layerwise build the same model "
            "and none differs (it pools after the key/value maps, and max does not commute with them)"
        },
    )
    compress_type: ChoiceEnum(COMPRESS_TYPES) = field(
        default="linear",
        metadata={"help": "projection: linear (learned E), mean/max pooling or conv, with window and stride n/k"},
    )
    compress_length_norm: ChoiceEnum(tuple(LENGTH_NORM_POWERS)) = field(
        default="linear",
        metadata={
            "help": "linear projections: multiply each sentence's projected rows by (n/T)^p, T its own "
            "length: none (p=0, the original example), sqrt (p=0.5), linear (p=1; keeps short inputs "
            "at the scale of full blocks); resample: stretch E's n columns over the T tokens instead (each row "
            "keeps its full-block sum and mix); exact: resample, but a sentence of at most k tokens is read with each "
            "token its own key and value (softmax attention, exactly). Saved in checkpoints: loading one restores "
            "what it was trained with"
        },
    )
    compress_init: ChoiceEnum(COMPRESS_INITS) = field(
        default="normal",
        metadata={
            "help": "linear projections' init: normal N(0, 0.02) as the original, xavier, or mean (mean pooling)"
        },
    )
    compress_resample_prob: float = field(
        default=0.0,
        metadata={
            "help": "training only, with --compress-length-norm exact: read each input that fits k through the "
            "projection (as resample) with this probability, one draw an input for every layer, so that a model "
            "finetuned mostly on inputs read exactly also learns the projected reading longer inputs get"
        },
    )
    local_window: int = field(
        default=0,
        metadata={
            "help": "W: every query also attends, in the same softmax as the k projected rows, to the exact keys "
            "and values of the W/2 positions on each side of it (even; 0: off, the paper's Linformer). Costs "
            "O(n (W + k)); sentences that exact reads as their own rows get no band"
        },
    )
    local_count_once: bool = field(
        default=False,
        metadata={
            "help": "with --local-window: each projected row stands only for the tokens of its window that the "
            "query's band does not read (its log count becomes log(count x (1 - overlap / window))), so no token "
            "is counted by both. Rows are taken as windows of n/k consecutive positions (L/k of an L-token "
            "input under resample/exact): pooling, and E/F that average windows (the converter's avg)"
        },
    )
    local_kernel: str = field(
        default="auto",
        metadata={
            "help": "how the band of --local-window is computed: blockwise (plain PyTorch, any device), flex "
            "(torch's compiled flex_attention: one fused kernel over the band and the rows, no attention dropout), "
            "or auto (flex where it is known to be fast and right, blockwise otherwise; docs/model.md). The same "
            "numbers either way: a checkpoint runs with any kernel"
        },
    )
    freeze_compress: int = field(default=0, metadata={"help": "1: freeze the projection parameters"})
    shared_kv_compressed: int = field(default=0, metadata={"help": "legacy: 1 means --compress-sharing kv"})
    shared_layer_kv_compressed: int = field(
        default=0, metadata={"help": "legacy: 1 means --compress-sharing layerwise"}
    )
    layernorm_eps: float = field(
        default=FAIRSEQ_LAYERNORM_EPS,
        metadata={"help": "epsilon of every layer norm (a model imported from transformers keeps its own)"},
    )
    ffn_chunk_size: int = field(
        default=0,
        metadata={
            "help": "inference only: run each FFN block over chunks of this many positions (0: off; "
            "<= n/5 keeps the FFN below the attention block in peak memory); same outputs"
        },
    )


@register_model("linformer_roberta", dataclass=LinformerRobertaConfig)
class LinformerRobertaModel(PoolerTokens, RobertaModel):
    @classmethod
    def add_args(cls, parser):
        # RobertaModel hard-codes its argparse flags; take them from the dataclass instead,
        # without defaults so that the architectures can still fill them in
        gen_parser_from_dataclass(parser, LinformerRobertaConfig(), delete_default=True)

    @classmethod
    def hub_models(cls):
        return {}  # RoBERTa's downloadable names are RoBERTa models: from_pretrained takes a path

    @classmethod
    def build_model(cls, args, task):
        if OmegaConf.is_config(args):
            with open_dict(args):
                return cls._build(args, task)
        return cls._build(args, task)

    @classmethod
    def _build(cls, args, task):
        roberta_base_architecture(args)  # the derived fields fairseq's TransformerEncoder reads
        if getattr(args, "quant_noise_pq", 0):
            raise ValueError("quantization noise (--quant-noise-pq) is not supported by Linformer attention")
        model = cls(args, LinformerRobertaEncoder(args, task.source_dictionary))
        set_layernorm_eps(model, getattr(args, "layernorm_eps", FAIRSEQ_LAYERNORM_EPS))  # older configs lack it
        return model


class LinformerRobertaEncoder(RobertaEncoder):
    def build_encoder(self, args, dictionary, embed_tokens):
        settings = LinformerSettings.from_args(args)  # the one place they are read and checked
        encoder = LinformerTransformerEncoder(
            settings, TransformerConfig.from_namespace(args), dictionary, embed_tokens
        )
        encoder.apply(init_bert_params)
        return encoder

    def upgrade_state_dict_named(self, state_dict, name):
        """Load checkpoints of the original fairseq Linformer example: drop its bookkeeping
        buffers, the never-used bias of its layerwise projection, and the copies of that
        projection it stored under every layer's compress_k/compress_v."""
        super().upgrade_state_dict_named(state_dict, name)
        prefix = f"{name}." if name else ""
        state_dict.pop(f"{prefix}version", None)
        state_dict.pop(f"{prefix}sentence_encoder.compress_layer.bias", None)
        for i, layer in enumerate(self.sentence_encoder.layers):
            attn = f"{prefix}sentence_encoder.layers.{i}.self_attn"
            state_dict.pop(f"{prefix}sentence_encoder.layers.{i}.version", None)
            state_dict.pop(f"{attn}.compress_k.bias", None)
            state_dict.pop(f"{attn}.compress_v.bias", None)
            v_key, k_key = f"{attn}.compress_v.weight", f"{attn}.compress_k.weight"
            if layer.self_attn.compress_v is None and v_key in state_dict:
                shared = state_dict.get(k_key)
                if shared is None or not torch.equal(state_dict[v_key], shared):
                    raise ValueError(
                        f"{v_key}: the checkpoint has separate key and value projections, but the model "
                        f"shares them (--compress-sharing {self.sentence_encoder.linformer.sharing})"
                    )
                del state_dict[v_key]


def _fairseq_large_sizes():
    """The size fields of fairseq's roberta_large architecture."""
    args = argparse.Namespace()
    roberta_large_architecture(args)
    sizes = ("encoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_attention_heads")
    return {name: getattr(args, name) for name in sizes}


# The large model is registered as a model of its own, with its own config defaults: under
# fairseq-hydra-train, `model._name: linformer_roberta_large` then builds the large sizes
# (fairseq merges a model's dataclass defaults before any architecture function could run).
LinformerRobertaLargeConfig = dataclasses.make_dataclass(
    "LinformerRobertaLargeConfig",
    [(name, int, field(default=value)) for name, value in _fairseq_large_sizes().items()],
    bases=(LinformerRobertaConfig,),
)


@register_model("linformer_roberta_large", dataclass=LinformerRobertaLargeConfig)
class LinformerRobertaLargeModel(LinformerRobertaModel):
    @classmethod
    def add_args(cls, parser):
        gen_parser_from_dataclass(parser, LinformerRobertaLargeConfig(), delete_default=True)


# The defaults live in the config dataclasses (registering a model with one also registers the
# architecture of its name, "linformer_roberta" and "linformer_roberta_large").
@register_model_architecture("linformer_roberta", "linformer_roberta_base")
def linformer_roberta_base_architecture(args):
    # fairseq's argparse path (options.parse_args_and_arch, then task.build_model(args)) keeps
    # only the flags given; the dataclass path fills the rest, so fill them here too
    for f in dataclasses.fields(LinformerRobertaConfig):
        if not hasattr(args, f.name):
            setattr(args, f.name, f.default)
