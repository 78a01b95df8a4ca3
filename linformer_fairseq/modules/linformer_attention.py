"""Linformer self-attention (Wang et al. 2020): keys and values are projected along the
sequence axis from n positions to k rows before attention, so attention costs O(n k).
With a local window W (``--local-window``), every query also reads the exact keys and values
of its W nearest positions, in the same softmax as the k rows: O(n (W + k)). With
``--local-count-once`` each row's weight leaves out the tokens that the query's band reads.

Shapes follow fairseq: activations are ``T x B x C`` (time, batch, channels), padding masks
are ``B x T`` with True at pad positions. Padding must be on the right (fairseq's
``RightPadDataset``, used by the masked_lm and sentence_prediction tasks).
"""

import functools
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

COMPRESS_SHARING = ("none", "headwise", "kv", "layerwise")
COMPRESS_TYPES = ("linear", "mean", "max", "conv")
# p in the factor (n / T)^p applied to a linear projection of a T-token sentence; "resample"
# (coded -1) stretches E's n columns over the sentence's T tokens instead of slicing and scaling;
# "exact" (coded -2) reads a sentence of at most k tokens as its own rows, longer ones as resample
LENGTH_NORM_POWERS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0, "resample": -1.0, "exact": -2.0}
RESAMPLE, EXACT = LENGTH_NORM_POWERS["resample"], LENGTH_NORM_POWERS["exact"]
COMPRESS_INITS = ("normal", "xavier", "mean")
BAND_KERNELS = ("auto", "blockwise", "flex")
# queries a block of the blockwise band (``band_geometry``); 0: the band's half width, so that each
# block reads three blocks of keys
BAND_BLOCK = 0

logger = logging.getLogger(__name__)


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


class Sentences(NamedTuple):
    """What a projection makes of each sentence of a batch (``SequenceProjection.sentences``), ``B``
    each: computed once a forward, and read by the projections and the band alike."""

    lengths: Tensor  # real tokens
    exact: Tensor | None  # read as its own rows (``exact``); None for projections that read none so
    width: Tensor  # float64: the positions, or tokens, each row covers (``SequenceProjection.sentences``)


class SequenceProjection(nn.Module):
    """The paper's E (or F): maps ``T x B x C`` to ``k' x B x C`` along the sequence axis.

    Kinds (``n`` = max_positions, ``s = n // k``):

    - ``linear``: a learned ``k x n`` matrix; an input of T < n positions uses its first T
      columns, so the output always has k rows. Each row is a sum over the T real tokens, so
      its size grows with T: a model pretrained on full blocks would see keys and values
      shrunk to about T/n of their trained size on short inputs (GLUE sentences are ~5% of
      n=512). ``length_norm`` undoes that per sentence: rows are multiplied by (n / T)^p, T
      being the sentence's own number of real tokens, p = 0 (``none``, the original
      example), 0.5 (``sqrt``) or 1 (``linear``); the factor is 1 at T = n. ``resample``
      instead reads the T tokens as if they filled the n positions: token t covers
      [t n/T, (t+1) n/T), so its column is the sum of E's columns over that span (fractional at
      the edges). Every row keeps its full-block sum and its mix along the block. ``exact``
      reads a sentence of at most k real tokens as its own rows (each token one key and value:
      softmax attention over its tokens, exactly, at a cost T x T <= T x k) and longer ones as
      ``resample``. Under ``resample`` a short sentence's tokens get whole rows, but unequally
      many (at T = 300, k = 512: one or two), which weighs some tokens double in attention.
      While training, ``read_projected`` (a ``B`` bool tensor the encoder draws for each batch,
      ``--compress-resample-prob``) makes ``exact`` read the marked sentences as ``resample``
      even when they fit k.
    - ``mean`` / ``max``: pooling over windows of s positions; ``conv``: a learned kernel of
      width s applied with stride s (a block-structured E, initialised to mean pooling). An
      input of T positions gives ``ceil(T / s)`` rows, each normalised by its own window, so
      they need no length handling; rows whose window holds only padding are reported as
      empty.

    The arguments are those of a ``LinformerSettings``, which checked them.

    With ``groups > 1`` (sharing level "none") the channels are split into ``groups`` heads and
    each head gets its own matrix or kernel.

    Pad positions never contribute (the caller zeroes them; pooling also leaves them out of
    its counts and maxima): a sentence projects to the same rows however far its batch pads it.

    A linear projection stores its length handling in the buffer ``length_norm_power``, so a
    checkpoint carries the behaviour it was trained with and loading it restores that
    behaviour whatever the model was built with; checkpoints without the buffer (the
    original example's, and this plugin's before the option existed) load as ``none``.
    """

    def __init__(
        self, kind: str, max_positions: int, k: int, groups: int = 1, length_norm: str = "none", init: str = "normal"
    ):
        super().__init__()
        self.kind, self.max_positions, self.k, self.groups = kind, max_positions, k, groups
        self.stride = max_positions // k
        if kind == "linear":
            shape = (k, max_positions) if groups == 1 else (groups, k, max_positions)
            self.weight = nn.Parameter(self._initial_matrix(init, shape))
            self.length_power = LENGTH_NORM_POWERS[length_norm]
            self.register_buffer("length_norm_power", torch.tensor(self.length_power))
        elif kind == "conv":
            self.weight = nn.Parameter(torch.full((groups, self.stride), 1.0 / self.stride))
        else:
            self.register_parameter("weight", None)
        self.read_projected: Tensor | None = None  # set by the encoder for each training batch

    @staticmethod
    def _initial_matrix(init: str, shape) -> Tensor:
        """``normal``: N(0, 0.02), what fairseq's init_bert_params gives the original
        example's nn.Linear projections; ``xavier``: uniform with fan_in n, fan_out k, gain
        1/sqrt(2) (std 0.040 at n=512, k=128); ``mean``: row j averages positions
        [j n/k, (j+1) n/k), i.e. starts as mean pooling."""
        k, n = shape[-2:]
        if init == "normal":
            return torch.randn(shape) * 0.02
        if init == "xavier":
            bound = math.sqrt(6.0 / (n + k)) / math.sqrt(2.0)
            return torch.empty(shape).uniform_(-bound, bound)
        window = torch.arange(n) * k // n  # the row each position falls in
        E = (window.unsqueeze(0) == torch.arange(k).unsqueeze(1)).float()
        return (E / E.sum(1, keepdim=True)).expand(shape).clone()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        if self.kind == "linear":
            key = prefix + "length_norm_power"
            saved = state_dict.setdefault(key, torch.tensor(0.0))  # older checkpoints: "none"
            power = float(saved)
            if power != self.length_power:
                name = {v: k for k, v in LENGTH_NORM_POWERS.items()}.get(power, power)
                logger.info(f"{prefix or 'projection '}: using the checkpoint's compress length norm {name!r}")
            self.length_power = power
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        power = f", length_power={self.length_power}" if self.kind == "linear" else ""
        return f"{self.kind}, n={self.max_positions}, k={self.k}, groups={self.groups}{power}"

    def forward(
        self, x: Tensor, pad_mask: Tensor | None, weight: Tensor | None = None, sentences: Sentences | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """x: ``T x B x C`` with zeros at its pad positions; pad_mask: ``B x T`` (True at
        pads) or None. ``weight`` replaces this projection's own by matrices or kernels of the
        same kind stacked along the groups: under sharing ``none`` the attention projects every
        head's keys and values in one product that way. ``sentences``: this batch's
        ``self.sentences``, when the caller has them.

        Returns the projection ``k' x B x C`` and a ``B x k'`` mask of the rows that hold at
        least one real token (None when every row does).
        """
        if x.size(0) > self.max_positions:
            raise ValueError(
                f"sequence length {x.size(0)} exceeds max_positions {self.max_positions} of the "
                f"Linformer projection (its E/F matrices are k x max_positions)"
            )
        weight = self.weight if weight is None else weight
        if self.kind != "linear":
            return self._pooled(x, pad_mask, weight)
        if sentences is None:
            sentences = self.sentences(pad_mask, x.size(0), x.size(1), x.device)
        if self.length_power == EXACT:
            return self._exact_below_k(x, pad_mask, weight, sentences)
        return self._linear(x, pad_mask, weight, sentences.lengths), None

    def _exact_below_k(self, x: Tensor, pad_mask: Tensor | None, weight: Tensor, sentences: Sentences):
        """``exact``: a sentence of L <= k real tokens keeps its tokens as rows (the first L of
        k, the rest masked: pads are at the end, as ``_resampled`` also assumes); longer ones,
        and in training those ``read_projected`` marks, are resampled to k rows."""
        T, B, _ = x.shape
        real = None if pad_mask is None else ~pad_mask
        if self.reads_all_exactly(T):
            return x, real
        projected = self._linear(x, pad_mask, weight, sentences.lengths)
        if real is None and T > self.k:  # every sentence is longer than k
            return projected, None
        if real is None:
            real = x.new_ones(B, T, dtype=torch.bool)
        exact = sentences.exact
        rows, kept = x[: self.k], real[:, : self.k]
        if T < self.k:  # only with read_projected: the exact rows padded (and masked) to the projection's k
            rows, kept = F.pad(rows, (0, 0, 0, 0, 0, self.k - T)), F.pad(kept, (0, self.k - T), value=False)
        return torch.where(exact.view(1, B, 1), rows, projected), torch.where(exact.unsqueeze(1), kept, True)

    def reads_all_exactly(self, T: int) -> bool:
        """Whether every sentence of a ``T``-long batch is read as its own rows (``exact``, T <= k)."""
        drawn = self.read_projected if self.training else None
        return self.kind == "linear" and self.length_power == EXACT and T <= self.k and drawn is None

    def sentences(self, pad_mask: Tensor | None, T: int, B: int, device) -> Sentences:
        """This projection's reading of each sentence of a ``T``-long batch of ``B`` (pad_mask: ``B x
        T``, True at pads, or None): the single source of each sentence's

        - ``lengths``: its number of real tokens L;
        - ``exact``: whether it is read as its own rows (``exact``: L <= k, and in training not marked
          by ``read_projected``); None for other projections;
        - ``width``: the positions each row covers, which is the number of tokens it stands for: 1
          for a sentence read exactly (its rows are its tokens); L/k (a fraction of a token when L <
          k) where ``resample`` or ``exact`` stretch E over its L tokens, so that its k rows stand
          for L tokens together; n/k otherwise, row r covering [r n/k, (r + 1) n/k): the geometry
          of pooling and of E/F that average windows (the converter's ``avg``, ``--compress-init
          mean``; a learned E/F may have drifted from it).
        """
        lengths = sentence_lengths(pad_mask, T, B, device)
        if not (self.kind == "linear" and self.length_power in (RESAMPLE, EXACT)):
            width = torch.full((B,), self.max_positions / self.k, device=device, dtype=torch.float64)
            return Sentences(lengths, None, width)
        width = lengths.clamp(min=1).double() / self.k
        if self.length_power == RESAMPLE:
            return Sentences(lengths, None, width)
        exact = lengths <= self.k  # no `if exact.any()`: on a GPU it would wait
        drawn = self.read_projected if self.training else None
        if drawn is not None:
            assert drawn.shape == (B,), f"read_projected: one flag a sentence ({B}), got {tuple(drawn.shape)}"
            exact &= ~drawn
        return Sentences(lengths, exact, width.masked_fill(exact, 1.0))

    def _linear(self, x: Tensor, pad_mask: Tensor | None, weight: Tensor, lengths: Tensor) -> Tensor:
        """E x of ``T x B x C`` sentences of ``lengths`` real tokens (``B``), as the length norm has it."""
        T, B, C = x.shape
        if self.length_power in (RESAMPLE, EXACT) and (pad_mask is not None or T < self.max_positions):
            return self._resampled(x, weight, lengths)
        E = weight[..., :T]
        rows = E.size(-2)
        if E.dim() == 2:
            # T x B x C is T x (B*C) in memory: one GEMM, no permute
            out = torch.matmul(E, x.reshape(T, B * C)).view(rows, B, C)
        else:  # one matrix per group of channels (per head)
            groups = E.size(0)
            x = x.reshape(T, B, groups, C // groups)
            out = torch.einsum("gkt,tbgd->kbgd", E, x).reshape(rows, B, C)
        if self.length_power == 0.0 or (pad_mask is None and T == self.max_positions):
            return out  # factor 1, or E itself: every full pretraining block
        # in place: `out` is a fresh product that its backward does not need
        if pad_mask is None:
            return out.mul_((self.max_positions / T) ** self.length_power)
        lengths = lengths.clamp(min=1).to(out.dtype)  # each sentence's own T
        return out.mul_((self.max_positions / lengths).pow(self.length_power).view(1, B, 1))

    def _resampled(self, x: Tensor, weight: Tensor, lengths: Tensor) -> Tensor:
        """E stretched per sentence: with L real tokens, token t's column is the integral of E's
        columns over [t n/L, (t+1) n/L), read off their cumulative sum by linear interpolation;
        columns past the sentence integrate over nothing."""
        T, B, C = x.shape
        n = self.max_positions
        lengths = lengths.clamp(min=1)
        cumulative = F.pad(weight.float().cumsum(-1), (1, 0))  # [..., j]: the sum of E's first j columns
        edges = (torch.arange(T + 1, device=x.device) * (n / lengths.float()).unsqueeze(1)).clamp(max=n)  # B x T+1
        left = edges.floor().long().clamp(max=n - 1)
        integral = cumulative[..., left] + weight.float()[..., left] * (edges - left)  # ... x B x T+1
        E = (integral[..., 1:] - integral[..., :-1]).to(x.dtype)  # ... x k x B x T
        if E.dim() == 3:
            return torch.einsum("kbt,tbc->kbc", E, x)
        groups = E.size(0)
        out = torch.einsum("gkbt,tbgd->kbgd", E, x.reshape(T, B, groups, C // groups))
        return out.reshape(E.size(1), B, C)

    def _pooled(self, x: Tensor, pad_mask: Tensor | None, weight: Tensor | None):
        T, B, C = x.shape
        s = self.stride
        rows = -(-T // s)
        tail = rows * s - T
        fill = float("-inf") if self.kind == "max" else 0.0  # what the tail must not change
        windows = F.pad(x, (0, 0, 0, 0, 0, tail), value=fill).view(rows, s, B, C)
        real = kept = None
        if pad_mask is not None:
            real = F.pad(~pad_mask, (0, tail), value=False).view(B, rows, s)
            kept = real.any(-1)
        if self.kind == "max":
            if real is not None:  # the zeros at pads must not win the max
                windows = windows.masked_fill(~real.permute(1, 2, 0).unsqueeze(-1), float("-inf"))
            out = windows.amax(dim=1)
            if kept is not None:  # a window of padding only is -inf: make it a harmless 0
                out = out.masked_fill(~kept.t().unsqueeze(-1), 0.0)
        elif self.kind == "mean":
            if real is None:
                count = x.new_full((rows, 1, 1), float(s))
                count[-1] = s - tail
            else:
                count = real.sum(-1).t().unsqueeze(-1).clamp(min=1).to(x.dtype)
            out = windows.sum(dim=1) / count
        else:  # conv: one kernel per group of channels (per head)
            w = weight.to(x.dtype)
            if w.size(0) == 1:
                out = torch.einsum("wsbc,s->wbc", windows, w[0])
            else:
                g = windows.view(rows, s, B, w.size(0), C // w.size(0))
                out = torch.einsum("wsbgd,gs->wbgd", g, w).reshape(rows, B, C)
        return out, kept


class BandInputs(NamedTuple):
    """The arguments of ``attend_local_and_projected``, and of every kernel that computes the same."""

    q: Tensor
    k: Tensor
    v: Tensor
    key_real: Tensor | None
    half_window: int
    k_rows: Tensor
    v_rows: Tensor
    rows_real: Tensor | None
    rows_offset: Tensor
    dropout: float
    rows_share: Tensor | None


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
        sentences = self.compress_k.sentences(key_padding_mask, T, B, query.device)
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
        batch's ``sentences``; in float32 or wider, the offset and share, which set the weights."""
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
        if self.local_count_once:
            share = rows_outside_band(sentences.lengths, sentences.width, k_rows.size(2), half, T)
            if sentences.exact is not None:  # no band there: a row is its token
                share = share.masked_fill(sentences.exact.view(B, 1, 1, 1), 0.0)
            share = share.to(wide)
        return BandInputs(q, k, v, key_real, half, k_rows, v_rows, kept, offset, dropout, share)

    def attend_with_band(self, inputs: BandInputs) -> Tensor:
        """The band's kernel over ``inputs`` (``band_inputs``): ``B x H x T x D``."""
        needs_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (inputs.q, inputs.k, inputs.v, inputs.k_rows, inputs.v_rows, inputs.rows_offset)
        )
        kernel = BAND_KERNEL_FUNCTIONS[band_kernel(self.local_kernel, inputs.q, inputs.dropout, needs_grad)]
        return kernel(*inputs)


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


class BandGeometry(NamedTuple):
    """How the blockwise band cuts a sentence's T queries (``band_geometry``)."""

    half: int  # the band's half width, at most T - 1: a wider band reads nothing more
    block: int  # queries a block
    blocks: int
    span: int  # keys a block reads: its own and ``half`` on either side


def band_geometry(half_window: int, T: int) -> BandGeometry:
    """The one place the blocks are chosen: ``BAND_BLOCK`` queries a block, or the band's half width
    (at least 1); each block reads the block + 2 half keys around it."""
    half = min(half_window, T - 1)
    block = BAND_BLOCK or max(half, 1)
    return BandGeometry(half, block, -(-T // block), block + 2 * half)


def attend_local_and_projected(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_real: Tensor | None,
    half_window: int,
    k_rows: Tensor,
    v_rows: Tensor,
    rows_real: Tensor | None,
    rows_offset: Tensor,
    dropout: float = 0.0,
    rows_share: Tensor | None = None,
) -> Tensor:
    """One softmax over two sets of keys: the exact ``k``, ``v`` of the positions within
    ``half_window`` of each query, and the R projected rows ``k_rows``, ``v_rows``.

    q, k, v: ``B x H x T x D``; key_real: ``B x T``, True where a position may be read in the
    band, or None; k_rows, v_rows: ``B x H x R x D``; rows_real: ``B x R`` or None; rows_offset:
    added to every row's logit, broadcastable to ``B x H x 1 x 1``; dropout: the probability of
    dropping a weight; rows_share: ``B x 1 x T x R``, also added to the rows' logits (the log of the
    share of each row that lies outside each query's band, ``rows_outside_band``), or None; it
    gets no gradient. Returns ``B x H x T x D``, in q's dtype.

    Blockwise, never T x T: the queries are cut into blocks of b positions (``band_geometry``: b =
    half_window), and each block reads the b + 2 * half_window keys around it (its band lies inside
    them), so the cost is O(T (b + 2 half_window + R)). The backward pass recomputes the weights from
    the scores' maximum and sum, so training keeps O(T) numbers a head, not the T x (3 half_window +
    R) weights. Whatever the inputs' dtype, it computes in float32 (float64 for float64 inputs), as
    fused attention kernels do: the scores, their maximum, exponentials and sums, the products with
    the values, and the softmax's backward.
    """
    T = q.size(2)
    half, block, blocks, span = band_geometry(half_window, T)
    tail = blocks * block - T
    query_at = torch.arange(blocks * block, device=q.device).view(blocks, block, 1)
    key_at = (torch.arange(blocks, device=q.device) * block - half).view(blocks, 1, 1) + torch.arange(
        span, device=q.device
    )
    readable = ((key_at - query_at).abs() <= half) & (key_at >= 0) & (key_at < T)  # blocks x block x span
    if key_real is not None:
        real = F.pad(key_real, (half, tail + half), value=False).unfold(1, span, block)  # B x blocks x span
        readable = (readable & real.unsqueeze(2)).unsqueeze(1)  # B x 1 x blocks x block x span
    if rows_real is not None:
        rows_real = rows_real.view(-1, 1, 1, rows_real.size(-1))
    # keys and values in q's dtype (under autocast, the autocast dtype its projection ran in), so that
    # their gradients come back in one dtype; the offset and share, which the weights are computed
    # from, in the wide dtype the kernel computes in
    wide = torch.promote_types(q.dtype, torch.float32)
    k, v, k_rows, v_rows = (t.to(q.dtype) for t in (k, v, k_rows, v_rows))
    rows_offset = rows_offset.to(wide)
    if rows_share is not None:  # the padded queries' rows as well
        rows_share = F.pad(rows_share.to(wide), (0, 0, 0, tail))
    with torch.autocast(q.device.type, enabled=False):
        return BandAndRows.apply(q, k, v, k_rows, v_rows, rows_offset, rows_share, readable, rows_real, half, dropout)


class BandAndRows(torch.autograd.Function):
    """``attend_local_and_projected`` once its band's geometry is known: readable (``blocks x block
    x span``, or ``B x 1 x`` that) is True where a query of a block may read a key of its span. It
    computes in rows_offset's dtype (float32 or float64) and keeps its inputs, for the backward
    pass, in their own."""

    @staticmethod
    def forward(ctx, q, k, v, k_rows, v_rows, rows_offset, rows_share, readable, rows_real, half: int, dropout: float):
        B, H, T, D = q.shape
        blocks, block, span = readable.shape[-3:]
        inputs = q, k, v, k_rows, v_rows
        q, k, v, k_rows, v_rows = _widened(rows_offset.dtype, blocks * block, *inputs)
        band, far = _band_and_row_scores(q, k, k_rows, rows_offset, rows_share, readable, rows_real, half)
        top = torch.maximum(band.amax(-1, keepdim=True), far.amax(-1, keepdim=True))
        band, far = band.sub_(top).exp_(), far.sub_(top).exp_()
        total = band.sum(-1, keepdim=True) + far.sum(-1, keepdim=True)
        keep_band = keep_far = None
        if dropout > 0:  # kept as bytes for the backward pass: a quarter of the weights' fp32 size
            keep_band, keep_far = (
                torch.empty_like(t, dtype=torch.uint8).bernoulli_(1 - dropout).bool() for t in (band, far)
            )
            band, far = band.mul_(keep_band), far.mul_(keep_far)
            total = total * (1 - dropout)
        out = _weighted_values(band, far, v, v_rows, half) / total
        ctx.save_for_backward(*inputs, rows_offset, rows_share, readable, rows_real, top, total, keep_band, keep_far)
        ctx.half, ctx.dropout = half, dropout
        return out.view(B, H, blocks * block, D)[:, :, :T].to(inputs[0].dtype).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        q, k, v, k_rows, v_rows, rows_offset, rows_share, readable, rows_real, top, total, keep_band, keep_far = (
            ctx.saved_tensors
        )
        dtype, half, (B, H, T, D) = q.dtype, ctx.half, q.shape
        blocks, block, span = readable.shape[-3:]
        q, k, v, k_rows, v_rows, grad = _widened(rows_offset.dtype, blocks * block, q, k, v, k_rows, v_rows, grad)
        band, far = _band_and_row_scores(q, k, k_rows, rows_offset, rows_share, readable, rows_real, half)
        # the weights p / (1 - dropout), from the forward pass's shift and sums
        band, far = band.sub_(top).exp_().div_(total), far.sub_(top).exp_().div_(total).view(B, H, blocks * block, -1)
        grad = F.pad(grad, (0, 0, 0, blocks * block - T))  # B x H x blocks*block x D
        grad_blocks = grad.view(B, H, blocks, block, D)
        dropped_band, dropped_far = (
            (band, far) if keep_band is None else (band * keep_band, far * keep_far.view_as(far))
        )
        grad_v = _fold_windows(dropped_band.transpose(-1, -2) @ grad_blocks, half, block, T)
        grad_v_rows = dropped_far.transpose(-1, -2) @ grad
        del dropped_band, dropped_far
        # the softmax's backward, ds = p (dp - sum(p dp)): with the weights here p / (1 - dropout) and
        # dp = keep * (grad . value) / (1 - dropout), p dp is weight x keep x (grad . value), and its
        # sum (grad . out) is taken from these products rather than from the rounded output
        band_scores = grad_blocks @ _windows(v, half, block, span)
        row_scores = grad @ v_rows.transpose(-1, -2)
        if keep_band is not None:
            band_scores, row_scores = band_scores.mul_(keep_band), row_scores.mul_(keep_far.view_as(row_scores))
        band_scores, row_scores = band_scores.mul_(band), row_scores.mul_(far)
        along = band_scores.sum(-1, keepdim=True) + row_scores.sum(-1, keepdim=True).view(B, H, blocks, block, 1)
        along = along.mul_(1 - ctx.dropout)
        band_scores = band_scores.addcmul_(band, along, value=-1)
        row_scores = row_scores.addcmul_(far, along.view(B, H, blocks * block, 1), value=-1)
        grad_offset = row_scores.sum((-1, -2), keepdim=True).sum_to_size(rows_offset.shape)
        grad_q = band_scores @ _windows(k, half, block, span).transpose(-1, -2)
        grad_q = (grad_q.view(B, H, blocks * block, D) + row_scores @ k_rows)[:, :, :T] * D**-0.5
        grad_k = _fold_windows(band_scores.transpose(-1, -2) @ q.view(B, H, blocks, block, D), half, block, T)
        grad_k_rows = row_scores.transpose(-1, -2) @ q
        grads = (g.to(dtype) for g in (grad_q, grad_k, grad_v, grad_k_rows, grad_v_rows))
        return *grads, grad_offset, None, None, None, None, None


def _widened(wide: torch.dtype, length: int, q: Tensor, *others: Tensor) -> tuple[Tensor, ...]:
    """q (``B x H x T x D``) scaled by 1/sqrt(D) and padded to ``length`` queries, and the others, in ``wide``."""
    q = F.pad(q.to(wide) * q.size(-1) ** -0.5, (0, 0, 0, length - q.size(2)))
    return q, *(t.to(wide) for t in others)


def _windows(t: Tensor, half: int, block: int, span: int) -> Tensor:
    """``B x H x T x D`` -> ``B x H x blocks x D x span``: each block's span, a view of the padded t."""
    blocks = -(-t.size(2) // block)
    return F.pad(t, (0, 0, half, blocks * block - t.size(2) + half)).unfold(2, span, block)


def _fold_windows(windows: Tensor, half: int, block: int, T: int) -> Tensor:
    """The adjoint of ``_windows``: ``B x H x blocks x span x D`` summed back onto ``B x H x T x D``,
    a block's width of the span at a time: piece p of block b lands on [(b + p) block, (b + p + 1)
    block) of the padded positions, so the blocks' pieces p tile them (the last piece is narrower
    where the span is not a multiple of the block: zeros make up the rest)."""
    B, H, blocks, span, D = windows.shape
    pieces = -(-span // block)
    folded = windows.new_zeros(B, H, (blocks + pieces - 1) * block, D)
    for start in range(0, span, block):
        piece = windows[:, :, :, start : start + block]
        piece = F.pad(piece, (0, 0, 0, block - piece.size(3)))
        folded[:, :, start : start + blocks * block] += piece.reshape(B, H, -1, D)
    return folded[:, :, half : half + T]


def _band_and_row_scores(q, k, k_rows, rows_offset, rows_share, readable, rows_real, half: int):
    """The scaled, padded queries' logits over their band (``B x H x blocks x block x span``,
    -inf where unreadable) and over the rows (``B x H x blocks x block x R``, offset and share added)."""
    B, H, _, D = q.shape
    blocks, block, span = readable.shape[-3:]
    band = torch.matmul(q.view(B, H, blocks, block, D), _windows(k, half, block, span))
    band.masked_fill_(~readable, float("-inf"))
    far = torch.matmul(q, k_rows.transpose(-1, -2)).add_(rows_offset)
    if rows_share is not None:
        far.add_(rows_share)
    if rows_real is not None:
        far.masked_fill_(~rows_real, float("-inf"))
    return band, far.view(B, H, blocks, block, -1)


def _weighted_values(band: Tensor, far: Tensor, v: Tensor, v_rows: Tensor, half: int) -> Tensor:
    """The band's and the rows' weights times their values: ``B x H x blocks x block x D``."""
    B, H, blocks, block, span = band.shape
    out = torch.matmul(band, _windows(v, half, block, span).transpose(-1, -2))
    return out + torch.matmul(far.view(B, H, blocks * block, -1), v_rows).view(B, H, blocks, block, -1)


def rows_outside_band(lengths: Tensor, width: Tensor, rows: int, half: int, T: int) -> Tensor:
    """log(1 - overlap / covered): the log of the share of each row's real positions that lie
    outside each query's band, ``B x 1 x T x R`` (-inf where the band reads all of them). In a
    sentence of L real tokens (``lengths``, ``B``), row r covers [r w, min((r + 1) w, L)) (w =
    ``width``, ``B``): the last row of a pooled projection holds only the tokens left, and rows
    past the sentence hold none (their share stays 1); query i's band is [i - half, i + half]
    within the L tokens. Computed in float64: a row the band reads whole must come out as -inf,
    not as the log of a rounding error's sign."""
    B, device, wide = lengths.size(0), lengths.device, torch.float64
    width, length = width.to(wide).view(B, 1, 1), lengths.to(wide).view(B, 1, 1)
    start = torch.arange(rows, device=device, dtype=wide).view(1, 1, rows) * width
    end = torch.minimum(start + width, length)
    at = torch.arange(T, device=device, dtype=wide).view(1, T, 1)
    low, high = (at - half).clamp(min=0), torch.minimum(at + half + 1, length)
    overlap = (torch.minimum(end, high) - torch.maximum(start, low)).clamp(min=0)
    covered = end - start  # the same differences as the overlap's: a row read whole leaves exactly 0
    taken = torch.where(covered > 0, overlap / covered, 0.0)
    return (1 - taken).clamp(min=0).log().unsqueeze(1)


def sentence_lengths(pad_mask: Tensor | None, T: int, B: int, device) -> Tensor:
    """Each sentence's number of real tokens, ``B``; pad_mask: ``B x T``, True at pads, or None."""
    return torch.full((B,), T, device=device) if pad_mask is None else (~pad_mask).sum(1)


def projection(settings: LinformerSettings, k: int, groups: int = 1) -> SequenceProjection:
    """A projection from ``settings.max_positions`` to k rows of the settings' kind."""
    return SequenceProjection(settings.kind, settings.max_positions, k, groups, settings.length_norm, settings.init)


FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what flex_attention takes on every device
FLEX_BLOCK = 128  # flex_attention's tile: bucketed lengths are multiples of it
FLEX_RECOMPILE_LIMIT = 64  # one compiled kernel per (bucket, k, W, batch size): more than dynamo's default 8


@functools.cache  # asked at every band forward: import once
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def band_kernel(requested: str, q: Tensor, dropout: float, needs_grad: bool) -> str:
    """The kernel for the band of queries ``q`` (``--local-kernel``): ``blockwise``, ``flex``, or for
    ``auto`` flex where it has been checked to be right and fast (CUDA, inference; its training is
    measured by scripts/gpu_check.sh) and blockwise elsewhere. flex applies no attention dropout, takes
    no float64 and has no backward on a CPU."""
    if requested == "blockwise":
        return requested
    problems = [
        "torch.nn.attention.flex_attention (torch >= 2.5)" if not flex_available() else "",
        f"a float32/float16/bfloat16 input, not {q.dtype}" if q.dtype not in FLEX_DTYPES else "",
        f"no attention dropout (got {dropout}: --attention-dropout 0)" if dropout else "",
        "a GPU for gradients (flex_attention has no backward on a CPU)" if needs_grad and not q.is_cuda else "",
    ]
    problems = [p for p in problems if p]
    if requested == "flex":
        if problems:
            raise ValueError(
                f"--local-kernel flex needs {'; '.join(problems)}; or use --local-kernel auto or blockwise"
            )
        return requested
    assert requested == "auto", f"local kernel {requested!r} is not one of {BAND_KERNELS}"
    return "flex" if not problems and q.is_cuda and not needs_grad else "blockwise"


def flex_length(T: int) -> int:
    """The length a flex band pads T to, so that batches of nearby lengths share one compiled kernel:
    a multiple of 128 up to 1,024, then four lengths an octave (at most 25% padding)."""
    if T <= 1024:
        return -(-T // FLEX_BLOCK) * FLEX_BLOCK
    step = 1 << (T.bit_length() - 3)  # a quarter of the octave T lies in
    return -(-T // step) * step


_flex_block_masks: dict = {}
_flex_compiled = None


def _flex_band_mask(T: int, R: int, half: int, device):
    """The band's block structure over [the T keys; the R rows], built once per shape: each query reads
    the keys within ``half`` of it and every row (padding is the score_mod's)."""
    key = (T, R, half, str(device))
    if key not in _flex_block_masks:
        from torch.nn.attention.flex_attention import create_block_mask

        def band_or_row(b, h, q_at, kv_at):
            return (kv_at >= T) | ((q_at - kv_at).abs() <= half)

        _flex_block_masks[key] = create_block_mask(band_or_row, None, None, T, T + R, device=device)
    return _flex_block_masks[key]


def _flex():
    """flex_attention compiled once, for static shapes: a new shape compiles a kernel of its own, where
    dynamic shapes would recompile it with symbolic sizes (which fails on a CPU in torch 2.13)."""
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), FLEX_RECOMPILE_LIMIT))
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def attend_local_and_projected_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_real: Tensor | None,
    half_window: int,
    k_rows: Tensor,
    v_rows: Tensor,
    rows_real: Tensor | None,
    rows_offset: Tensor,
    dropout: float = 0.0,
    rows_share: Tensor | None = None,
) -> Tensor:
    """``attend_local_and_projected`` (same arguments, same result) as one fused flex_attention over
    [the band's keys; the rows], the scores never stored. The band is a cached BlockMask; padding
    (a prefix of real keys and rows in each sentence: pads are on the right), the offset and the
    share enter through the score_mod. The length is padded to ``flex_length``."""
    assert dropout == 0, "flex_attention applies no attention dropout: use the blockwise kernel"
    B, H, T, D = q.shape
    R, padded = k_rows.size(2), flex_length(T)
    dtype, grow = q.dtype, (0, 0, 0, padded - T)
    keys = torch.cat([F.pad(k.to(dtype), grow), k_rows.to(dtype)], 2)
    values = torch.cat([F.pad(v.to(dtype), grow), v_rows.to(dtype)], 2)
    # per sentence: keys [0, band_end) and rows [padded, rows_end) are readable; a scalar a sentence,
    # where a B x (T + R) mask read per score made the kernel 18x slower on a GPU
    band_end = q.new_full((B,), T, dtype=torch.int32) if key_real is None else key_real.sum(1, dtype=torch.int32)
    rows_end = padded + (
        q.new_full((B,), R, dtype=torch.int32) if rows_real is None else rows_real.sum(1, dtype=torch.int32)
    )
    offset = rows_offset.detach().to(torch.float32).expand(B, H, 1, 1).reshape(B, H)
    share = (
        None if rows_share is None else F.pad(rows_share.to(torch.float32), (0, 0, 0, padded - T)).view(B, padded, R)
    )

    def score_mod(score, b, h, q_at, kv_at):
        row = (kv_at - padded).clamp(min=0)
        bias = offset[b, h] if share is None else offset[b, h] + share[b, q_at, row]
        readable = torch.where(kv_at >= padded, kv_at < rows_end[b], kv_at < band_end[b])
        return torch.where(readable, torch.where(kv_at >= padded, score + bias, score), float("-inf"))

    offset_grad = torch.is_grad_enabled() and rows_offset.requires_grad
    with torch.autocast(q.device.type, enabled=False):
        out = _flex()(
            F.pad(q, grow),
            keys,
            values,
            score_mod=score_mod,
            block_mask=_flex_band_mask(padded, R, half_window, q.device),
            return_lse=offset_grad,
        )
    if not offset_grad:
        return out[:, :, :T]
    # the offset's gradient outside the kernel: read in the score_mod, it costs an atomic add a score
    out, lse = out[0][:, :, :T], out[1][:, :, :T]
    return out + _offset_gradient_carrier(q, k_rows, v_rows, rows_real, rows_offset, rows_share, lse, out)


def _offset_gradient_carrier(q, k_rows, v_rows, rows_real, rows_offset, rows_share, lse, out, chunk=1024) -> Tensor:
    """Zero, with the gradient of the output with respect to the rows' offset: d out_i / d offset =
    sum over rows r of p_ir (v_r - out_i), from the rows' weights p_ir = exp(score_ir - lse_i),
    ``chunk`` queries at a time (their ``B x H x chunk x R`` scores in float32)."""
    slopes = []
    with torch.no_grad():
        for start in range(0, q.size(2), chunk):
            at = slice(start, start + chunk)
            scores = torch.matmul(q[:, :, at].float(), k_rows.float().transpose(-1, -2)) * q.size(-1) ** -0.5
            scores += rows_offset.float()
            if rows_share is not None:
                scores += rows_share[:, :, at].float()
            if rows_real is not None:
                scores.masked_fill_(~rows_real.view(rows_real.size(0), 1, 1, -1), float("-inf"))
            weights = scores.sub_(lse[:, :, at].float().unsqueeze(-1)).exp_()
            rows_out = torch.matmul(weights, v_rows.float())
            slopes.append(rows_out.sub_(weights.sum(-1, keepdim=True) * out[:, :, at].float()))
    return ((rows_offset - rows_offset.detach()).float() * torch.cat(slopes, 2)).to(out.dtype)


BAND_KERNEL_FUNCTIONS = {"blockwise": attend_local_and_projected, "flex": attend_local_and_projected_flex}
