"""Linformer self-attention (Wang et al. 2020): keys and values are projected along the
sequence axis from n positions to k rows before attention, so attention costs O(n k).
With a local window W (``--local-window``), every query also reads the exact keys and values
of its W nearest positions, in the same softmax as the k rows: O(n (W + k)). With
``--local-count-once`` each row's weight leaves out the tokens that the query's band reads.

The settings and the module are here; the projection E/F in ``linformer_projection``, the band's
blockwise kernel in ``linformer_band``, its flex_attention kernel in ``linformer_band_flex``.

Shapes follow fairseq: activations are ``T x B x C`` (time, batch, channels), padding masks
are ``B x T`` with True at pad positions. Padding must be on the right (fairseq's
``RightPadDataset``, used by the masked_lm and sentence_prediction tasks).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linformer_band import BAND_KERNELS, BandInputs, CountOnce, attend_band
from .linformer_projection import (  # noqa: F401  (re-exported: the names every caller imports from here)
    COMPRESS_INITS,
    COMPRESS_TYPES,
    EXACT,
    LENGTH_NORM_POWERS,
    RESAMPLE,
    Sentences,
    SequenceProjection,
)

COMPRESS_SHARING = ("none", "headwise", "kv", "layerwise")


@dataclass(frozen=True)
class LinformerSettings:
    """What makes attention a Linformer's, checked once here and handed to every layer.

    ``compressed_dims`` holds k for each layer (non-uniform k: larger in low layers, as the
    paper suggests); the rest is in the model's config (``LinformerRobertaConfig``).
    """

    max_positions: int
    compressed_dims: tuple[int, ...]
    sharing: str = "headwise"
    kind: str = "linear"
    length_norm: str = "none"
    init: str = "normal"
    freeze: bool = False
    ffn_chunk_size: int = 0
    resample_prob: float = 0.0
    local_window: int = 0
    local_count_once: bool = False
    local_kernel: str = "auto"

    def __post_init__(self):
        for name, value, choices in (
            ("compress_sharing", self.sharing, COMPRESS_SHARING),
            ("compress_type", self.kind, COMPRESS_TYPES),
            ("compress_length_norm", self.length_norm, tuple(LENGTH_NORM_POWERS)),
            ("compress_init", self.init, COMPRESS_INITS),
            ("local_kernel", self.local_kernel, BAND_KERNELS),
        ):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; expected one of {choices}")
        n = self.max_positions
        if self.sharing == "layerwise" and len(set(self.compressed_dims)) > 1:
            raise ValueError("layerwise sharing uses one projection for all layers, so k cannot vary by layer")
        for k in self.compressed_dims:
            if not 0 < k <= n:
                raise ValueError(f"projected length k={k} must be in 1..max_positions ({n})")
            if self.kind != "linear" and n % k:
                raise ValueError(f"--compress-type {self.kind} needs max_positions ({n}) divisible by k ({k})")
        if self.ffn_chunk_size < 0:
            raise ValueError(f"--ffn-chunk-size must be >= 0, got {self.ffn_chunk_size}")
        if self.local_window < 0 or self.local_window % 2:
            raise ValueError(
                f"--local-window must be an even number >= 0 (W/2 neighbours on each side), got {self.local_window}"
            )
        if self.local_count_once and not self.local_window:
            raise ValueError("--local-count-once recounts the projected rows beside a band: add --local-window")
        if not 0.0 <= self.resample_prob <= 1.0:
            raise ValueError(f"--compress-resample-prob must be in [0, 1], got {self.resample_prob}")
        if self.resample_prob and (self.kind, self.length_norm) != ("linear", "exact"):
            raise ValueError(
                "--compress-resample-prob reads inputs that fit k through the projection instead of exactly, "
                f"so it needs --compress-type linear --compress-length-norm exact, not {self.kind} {self.length_norm}"
            )

    @classmethod
    def from_args(cls, args) -> "LinformerSettings":
        """From a model config (dataclass, DictConfig or argparse Namespace): folds the original
        example's flags (--shared-kv-compressed, --shared-layer-kv-compressed, --compressed) in."""
        sharing = str(args.compress_sharing)
        legacy = "layerwise" if args.shared_layer_kv_compressed else "kv" if args.shared_kv_compressed else None
        if legacy is not None:
            if sharing not in ("headwise", legacy):
                raise ValueError(f"--compress-sharing {sharing} contradicts the legacy flag that means {legacy}")
            sharing = legacy
        n, layers = args.max_positions, args.encoder_layers
        if args.layer_compressed_dims:
            try:
                dims = [int(d) for d in str(args.layer_compressed_dims).split(",")]
            except ValueError:
                raise ValueError(
                    f"--layer-compressed-dims must be comma-separated integers, got {args.layer_compressed_dims!r}"
                ) from None
            if len(dims) != layers:
                raise ValueError(f"--layer-compressed-dims has {len(dims)} values for {layers} encoder layers")
        elif args.compressed_dim > 0:
            dims = [args.compressed_dim] * layers
        else:
            if args.compressed < 1:
                raise ValueError(f"--compressed must be >= 1, got {args.compressed}")
            dims = [n // args.compressed] * layers
        return cls(
            max_positions=n,
            compressed_dims=tuple(dims),
            sharing=sharing,
            kind=str(args.compress_type),
            length_norm=str(args.compress_length_norm),
            init=str(args.compress_init),
            freeze=bool(args.freeze_compress),
            ffn_chunk_size=args.ffn_chunk_size,
            resample_prob=float(getattr(args, "compress_resample_prob", 0.0)),  # older configs lack it
            local_window=int(getattr(args, "local_window", 0)),
            local_count_once=bool(getattr(args, "local_count_once", False)),
            local_kernel=str(getattr(args, "local_kernel", "auto")),
        )


class LinformerMultiheadAttention(nn.Module):
    """Multi-head self-attention over k projected keys and values.

    Sharing of the projections (paper section 4): ``none`` (E_i, F_i per head), ``headwise``
    (E, F per layer), ``kv`` (E = F per layer), ``layerwise`` (one E for every layer, given
    as ``shared_projection``).

    The projection is applied to the layer input *before* the key/value linear maps whenever
    it is shared by heads (k rows go through W_K, W_V instead of n), and once for both keys and
    values when they share it. With per-head projections (``none``) it is applied after the
    linear maps, which is cheaper than projecting the input once per head. For linear, mean and
    conv projections both orders compute ``K_i = (E_i X) W_i^K + b_i^K``; max pooling does not
    commute with the maps, so under ``none`` it pools ``X W_i^K`` (a different operator from the
    other levels). Mean and max pooling have no parameters, so headwise, kv and layerwise give
    the same model with them (and, for mean, so does none).

    With ``local_window`` W > 0 every query also reads, in the same softmax, the exact keys and
    values of the positions within W/2 of it (``attend_local_and_projected``): a banded attention
    matrix has full rank, so no k x n projection can follow a head that looks at its neighbours.
    Each projected row's logit gets log(tokens it stands for, ``Sentences.width``) plus a learned
    per-head offset ``local_far_bias`` (initialised to 0), which sets the far field's weight against
    the band. With ``local_count_once`` a row stands only for the sentence's tokens it covers that the
    query's band does not read (``rows_outside_band``): its count becomes count x (1 - overlap /
    covered), and a row whose tokens all lie inside the band drops out, so no token is counted by
    both. A sentence the projection reads exactly (``exact``, at most k tokens) needs no band and
    gets none.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        settings: LinformerSettings,
        compressed_dim: int,
        dropout: float = 0.0,
        shared_projection: SequenceProjection | None = None,
    ):
        super().__init__()
        assert embed_dim % num_heads == 0, f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
        assert (settings.sharing == "layerwise") == (shared_projection is not None), (
            "layerwise sharing needs the shared projection, and only layerwise takes one"
        )
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.max_positions, self.dropout = settings.max_positions, dropout
        self.compress_sharing = settings.sharing

        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

        groups = num_heads if settings.sharing == "none" else 1
        self.compress_k = shared_projection or projection(settings, compressed_dim, groups)
        self.compress_v = (
            projection(settings, compressed_dim, groups) if settings.sharing in ("none", "headwise") else None
        )
        if settings.freeze:
            for p in self.compress_parameters():
                p.requires_grad_(False)
        self.local_window, self.local_count_once = settings.local_window, settings.local_count_once
        self.local_kernel = settings.local_kernel
        if self.local_window:
            self.local_far_bias = nn.Parameter(torch.zeros(num_heads))

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        if self.local_window:  # a checkpoint trained without the band: the far field's offset starts at 0
            state_dict.setdefault(prefix + "local_far_bias", torch.zeros(self.num_heads))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def compress_parameters(self):
        return [m.weight for m in (self.compress_k, self.compress_v) if m is not None and m.weight is not None]

    def key_value_maps(self, x: Tensor, pad_mask: Tensor | None) -> Tensor:
        """[X W_K, X W_V] of every position, bias-free, as one GEMM: ``T x B x 2C``, zero at pads."""
        if pad_mask is not None:
            x = x.masked_fill(pad_mask.t().unsqueeze(-1), 0.0)
        return F.linear(x, torch.cat([self.k_proj.weight, self.v_proj.weight]))

    def project_keys_values(
        self, x: Tensor, pad_mask: Tensor | None, maps: Tensor | None = None, sentences: Sentences | None = None
    ):
        """Projected keys and values, ``k' x B x C`` each, and the ``B x k'`` row mask; ``sentences``:
        the batch's ``compress_k.sentences``, when the caller has them (E and F read sentences alike).

        Under ``none``, W_K and W_V run as one GEMM, then every head's E_i and F_i as one batched
        product over the 2H heads of [X W_K, X W_V] (``maps``, when the caller has them).
        Headwise E and F stay two GEMMs: stacked into one they trained no faster at n = 512 or
        2048 (docs/benchmarks.md, "Against fairseq's original example")."""
        E, Fv = self.compress_k.weight, None if self.compress_v is None else self.compress_v.weight
        if self.compress_sharing == "none":  # pads contribute nothing to E (X W), bias-free
            kv = self.key_value_maps(x, pad_mask) if maps is None else maps
            both, kept = self.compress_k(kv, pad_mask, None if E is None else torch.cat([E, Fv]), sentences)
            k, v = both.split(self.embed_dim, dim=-1)
            return k + self.k_proj.bias, v + self.v_proj.bias, kept
        if pad_mask is not None:  # pads then contribute nothing to E X
            x = x.masked_fill(pad_mask.t().unsqueeze(-1), 0.0)
        xk, kept = self.compress_k(x, pad_mask, sentences=sentences)
        if self.compress_v is None or Fv is None:  # E = F, or pooling: one projection for both
            return self.k_proj(xk), self.v_proj(xk), kept
        return self.k_proj(xk), self.v_proj(self.compress_v(x, pad_mask, sentences=sentences)[0]), kept

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        need_head_weights: bool = False,
        **unused,
    ) -> tuple[Tensor, Tensor | None]:
        """query: ``T x B x C`` (key and value, if given, must be the query itself);
        key_padding_mask: ``B x T``, True at pads.

        Returns the output ``T x B x C`` and, with ``need_weights``, the context-mapping matrix
        over the projected keys: ``B x T x k'`` averaged over heads, or ``H x B x T x k'`` with
        ``need_head_weights``.
        """
        if attn_mask is not None:
            raise ValueError(
                "LinformerMultiheadAttention does not take an attn_mask: the projection mixes "
                "all positions into each of its k rows, so attention cannot be causal or "
                "masked per position. Use fairseq's MultiheadAttention for decoders."
            )
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("LinformerMultiheadAttention is self-attention only: key and value must be the query")
        T, B, C = query.shape
        assert C == self.embed_dim, f"expected {self.embed_dim} channels, got {C}"
        H, D = self.num_heads, self.head_dim

        band = self.local_window and not self.compress_k.reads_all_exactly(T)
        maps = None
        if band and self.compress_sharing == "none":  # the band's keys and values are made there anyway
            maps = self.key_value_maps(query, key_padding_mask)
        wide = torch.promote_types(query.dtype, torch.float32)
        sentences = self.compress_k.sentences(key_padding_mask, T, B, query.device, wide)
        k, v, kept = self.project_keys_values(query, key_padding_mask, maps, sentences)
        rows = k.size(0)
        # B x H x len x D as views of the T x B x C layout (no copies here)
        q = self.q_proj(query).view(T, B, H, D).permute(1, 2, 0, 3)
        k = k.view(rows, B, H, D).permute(1, 2, 0, 3)
        v = v.view(rows, B, H, D).permute(1, 2, 0, 3)
        mask = kept.view(B, 1, 1, rows) if kept is not None else None
        dropout = self.dropout if self.training else 0.0
        if band:
            if need_weights or need_head_weights:
                raise ValueError("attention weights are not returned with --local-window (they span band and rows)")
            inputs = self.band_inputs(query, key_padding_mask, maps, sentences, q, k, v, kept, dropout)
            out = self.attend_with_band(inputs)
            weights = None
        else:
            out, weights = attend(q, k, v, mask, dropout, need_weights, need_head_weights)
        out = out.permute(2, 0, 1, 3).reshape(T, B, C)
        return self.out_proj(out), weights

    def band_inputs(
        self, x: Tensor, pad_mask, maps, sentences: Sentences, q, k_rows, v_rows, kept, dropout: float
    ) -> BandInputs:
        """What the band's kernel reads: the queries ``q`` and the projected rows ``k_rows``, ``v_rows``
        (``B x H x len x D``, rows masked by ``kept``), the exact keys and values of x's own band (from
        ``maps``, bias-free [X W_K, X W_V], when given), and the rows' offset and share from the
        batch's ``sentences`` (the share as a ``CountOnce``); the offset in float32 or wider: it sets
        the weights."""
        T, B, C = x.shape
        H, D = self.num_heads, self.head_dim
        if maps is None:
            k, v = self.k_proj(x), self.v_proj(x)
        else:  # made from x with zeros at pads, which the band never reads
            k, v = maps[..., :C] + self.k_proj.bias, maps[..., C:] + self.v_proj.bias
        k, v = (t.view(T, B, H, D).permute(1, 2, 0, 3) for t in (k, v))
        key_real = None if pad_mask is None else ~pad_mask
        if sentences.exact is not None:  # their rows are their own tokens already
            band_on = (~sentences.exact).unsqueeze(1).expand(B, T)
            key_real = band_on if key_real is None else key_real & band_on
        wide = torch.promote_types(q.dtype, torch.float32)
        count = sentences.width.log().to(wide).view(B, 1, 1, 1)
        offset = count + self.local_far_bias.to(wide).view(1, H, 1, 1)
        half = self.local_window // 2
        share = None
        if self.local_count_once:  # per sentence: each kernel computes the share where it reads it
            banded = None if sentences.exact is None else ~sentences.exact
            share = CountOnce(sentences.lengths.to(wide), sentences.width, banded)
        return BandInputs(q, k, v, key_real, half, k_rows, v_rows, kept, offset, dropout, share)

    def attend_with_band(self, inputs: BandInputs) -> Tensor:
        """The band's kernel over ``inputs`` (``band_inputs``): ``B x H x T x D``. A module in training
        counts as needing gradients even where none are taken: activation checkpointing runs a layer's
        first pass without them, and its recompute, with them, must run the same kernel."""
        needs_grad = self.training or (
            torch.is_grad_enabled()
            and any(
                t.requires_grad
                for t in (inputs.q, inputs.k, inputs.v, inputs.k_rows, inputs.v_rows, inputs.rows_offset)
            )
        )
        return attend_band(self.local_kernel, inputs, needs_grad)


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, need_weights=False, need_head_weights=False
):
    """Softmax attention of ``B x H x T x D`` queries over ``B x H x R x D`` keys and values (R
    = k' projected rows, or T for full attention); mask: ``B x 1 x 1 x R``, True where a key may
    be read, or None. Shared by the Linformer and the exported model's full attention (RoBERTa).

    Returns ``B x H x T x D`` and, with ``need_weights``, the weights ``B x T x R`` averaged over
    heads, or ``H x B x T x R`` with ``need_head_weights``.
    """
    if not (need_weights or need_head_weights):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout), None
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.size(-1) ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).type_as(q)
    out = torch.matmul(F.dropout(weights, dropout, dropout > 0), v)
    return out, weights.transpose(0, 1) if need_head_weights else weights.mean(dim=1)


def projection(settings: LinformerSettings, k: int, groups: int = 1) -> SequenceProjection:
    """A projection from ``settings.max_positions`` to k rows of the settings' kind."""
    return SequenceProjection(settings.kind, settings.max_positions, k, groups, settings.length_norm, settings.init)
