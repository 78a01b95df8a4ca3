"""The Linformer encoder: fairseq's TransformerEncoder with Linformer self-attention layers,
per-layer projected dimensions, layerwise-shared projections and optional FFN chunking."""

import copy

import torch
from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import TransformerConfig, TransformerEncoderBase
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase
from torch import Tensor

from .linformer_attention import LinformerMultiheadAttention, LinformerSettings, SequenceProjection, projection


class LinformerEncoderLayer(TransformerEncoderLayerBase):
    """A transformer encoder layer whose self-attention is Linformer attention.

    ``ffn_chunk_size > 0`` runs the feed-forward block in inference over chunks of that many
    positions: the ``T x B x ffn_dim`` intermediate is the peak-memory term once attention is
    O(n k), and chunking never materialises it whole. Outputs are identical.
    """

    def __init__(
        self, cfg, settings: LinformerSettings, compressed_dim: int, shared_projection: SequenceProjection | None
    ):
        super().__init__(cfg)
        self.self_attn = LinformerMultiheadAttention(
            self.embed_dim,
            cfg.encoder.attention_heads,
            settings,
            compressed_dim,
            dropout=cfg.attention_dropout,
            shared_projection=shared_projection,
        )
        self.ffn_chunk_size = settings.ffn_chunk_size

    def build_self_attention(self, embed_dim, cfg):
        return None  # the Linformer attention is built in __init__, where its settings are at hand

    def feed_forward_block(self, x: Tensor) -> Tensor:
        """The position-wise half of the layer: FFN, dropout, residual, layer norm."""
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.fc2(self.activation_dropout_module(self.activation_fn(self.fc1(x))))
        x = self.residual_connection(self.dropout_module(x), residual)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x

    def forward(self, x: Tensor, encoder_padding_mask: Tensor | None, attn_mask: Tensor | None = None):
        """x: ``T x B x C``; encoder_padding_mask: ``B x T``, True at pads."""
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key_padding_mask=encoder_padding_mask, attn_mask=attn_mask)
        x = self.residual_connection(self.dropout_module(x), residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        chunk = self.ffn_chunk_size
        if chunk > 0 and not self.training and x.size(0) > chunk:
            # the whole block is position-wise, so each chunk goes straight into the output
            # and no full-size temporary (FFN intermediate, residual sum, norm) is ever built
            out = torch.empty_like(x)
            for start in range(0, x.size(0), chunk):
                out[start : start + chunk] = self.feed_forward_block(x[start : start + chunk])
            return out
        return self.feed_forward_block(x)


class LinformerTransformerEncoder(TransformerEncoderBase):
    """TransformerEncoder with one LinformerEncoderLayer per entry of ``compressed_dims``.

    With layerwise sharing, the single projection lives here as ``compress_layer`` and every
    layer's ``self_attn.compress_k`` refers to it (the original example's state-dict layout).
    """

    def __init__(self, settings: LinformerSettings, cfg: TransformerConfig, dictionary, embed_tokens):
        # the base class builds no layers (encoder.layers = 0): each of ours needs its own k
        no_layers = copy.deepcopy(cfg)
        no_layers.encoder.layers = 0
        super().__init__(no_layers, dictionary, embed_tokens)
        self.cfg, self.linformer = cfg, settings
        shared = None
        if settings.sharing == "layerwise":
            self.compress_layer = shared = projection(settings, settings.compressed_dims[0])
        self.layers.extend(
            self.wrap(LinformerEncoderLayer(cfg, settings, k, shared), cfg) for k in settings.compressed_dims
        )
        self.num_layers = len(self.layers)

    @staticmethod
    def wrap(layer, cfg):
        """The wrapping of fairseq's own encoder, so --checkpoint-activations and FSDP apply."""
        if cfg.checkpoint_activations:
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        min_params_to_wrap = cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0
        return fsdp_wrap(layer, min_num_params=min_params_to_wrap)

    def forward(self, src_tokens, src_lengths=None, return_all_hiddens: bool = False, token_embeddings=None):
        """src_tokens: ``B x T``, right-padded. See TransformerEncoderBase.forward."""
        T, n = src_tokens.size(1), self.linformer.max_positions
        if T > n:
            raise ValueError(
                f"input of length {T} is longer than max_positions {n}; "
                "truncate it (e.g. --truncate-sequence / --shorten-method truncate) or train with a larger "
                "--max-positions"
            )
        left_padded = src_tokens[:, 0].eq(self.padding_idx).any()
        if src_tokens.is_cuda and self.training:
            # `if left_padded` would make the CPU wait for the GPU at every forward; training
            # batches come right-padded from fairseq's collater, so check on the GPU instead
            # (a device-side assert, reported at a later CUDA call)
            torch._assert_async(~left_padded, "Linformer needs right-padded inputs (padding at position 0)")
        elif left_padded:
            raise ValueError(
                "Linformer needs right-padded inputs (the projection ties E's columns to "
                "positions); got a batch with padding at position 0 (left padding?)"
            )
        if self.training and self.linformer.resample_prob > 0:
            # one draw a sentence for every layer: the reading a longer input would get, throughout
            drawn = torch.rand(src_tokens.size(0), device=src_tokens.device) < self.linformer.resample_prob
            for module in self.modules():
                if isinstance(module, SequenceProjection):
                    module.read_projected = drawn
        return super().forward(src_tokens, src_lengths, return_all_hiddens, token_embeddings)
