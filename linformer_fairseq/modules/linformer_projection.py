"""The Linformer's projection along the sequence axis (the paper's E and F): ``T x B x C`` to ``k' x B x C``,
and what it makes of each sentence of a batch (``Sentences``), which the attention and the band read.

Shapes follow fairseq: activations are ``T x B x C`` (time, batch, channels), padding masks are ``B x
T`` with True at pad positions, on the right.
"""

import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

COMPRESS_TYPES = ("linear", "mean", "max", "conv")
# p in the factor (n / T)^p applied to a linear projection of a T-token sentence; "resample"
# (coded -1) stretches E's n columns over the sentence's T tokens instead of slicing and scaling;
# "exact" (coded -2) reads a sentence of at most k tokens as its own rows, longer ones as resample
LENGTH_NORM_POWERS = {"none": 0.0, "sqrt": 0.5, "linear": 1.0, "resample": -1.0, "exact": -2.0}
RESAMPLE, EXACT = LENGTH_NORM_POWERS["resample"], LENGTH_NORM_POWERS["exact"]
COMPRESS_INITS = ("normal", "xavier", "mean")

logger = logging.getLogger(__name__)


class Sentences(NamedTuple):
    """What a projection makes of each sentence of a batch (``SequenceProjection.sentences``), ``B``
    each: computed once a forward, and read by the projections and the band alike."""

    lengths: Tensor  # real tokens
    exact: Tensor | None  # read as its own rows (``exact``); None for projections that read none so
    # the positions, or tokens, each row covers (``SequenceProjection.sentences``): float32, float64 in a
    # float64 model
    width: Tensor


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

    def sentences(
        self, pad_mask: Tensor | None, T: int, B: int, device, dtype: torch.dtype = torch.float32
    ) -> Sentences:
        """This projection's reading of each sentence of a ``T``-long batch of ``B`` (pad_mask: ``B x
        T``, True at pads, or None), ``width`` in ``dtype`` (float32 for every model but a float64 one:
        MPS has no float64): the single source of each sentence's

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
            width = torch.full((B,), self.max_positions / self.k, device=device, dtype=dtype)
            return Sentences(lengths, None, width)
        width = lengths.clamp(min=1).to(dtype) / self.k
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


def sentence_lengths(pad_mask: Tensor | None, T: int, B: int, device) -> Tensor:
    """Each sentence's number of real tokens, ``B``; pad_mask: ``B x T``, True at pads, or None."""
    return torch.full((B,), T, device=device) if pad_mask is None else (~pad_mask).sum(1)
