"""The exact local band beside the projected rows (``--local-window``): every query reads the exact keys
and values of its W nearest positions and the k rows in one softmax, blockwise, never T x T; and the
choice of kernel for it (this blockwise one, or flex_attention's in ``linformer_band_flex``, imported
only when chosen). Shapes: ``B x H x T x D``.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

BAND_KERNELS = ("auto", "blockwise", "flex")
# queries a block of the blockwise band (``band_geometry``); 0: the band's half width, so that each
# block reads three blocks of keys
BAND_BLOCK = 0


class CountOnce(NamedTuple):
    """What ``--local-count-once`` computes each row's share outside a query's band from: per sentence
    (``B`` each), never per score, so that a kernel can compute the share where it reads it."""

    lengths: Tensor  # the sentence's real tokens L, in the dtype of
    width: Tensor  # the positions each row covers (``Sentences.width``): float32, or float64
    banded: Tensor | None  # False where the sentence is read exactly: no band, a row is its token (share 1)


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
    rows_share: Tensor | CountOnce | None  # a kernel's own computation of rows_outside_band, or that tensor


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
    rows_share: Tensor | CountOnce | None = None,
) -> Tensor:
    """One softmax over two sets of keys: the exact ``k``, ``v`` of the positions within
    ``half_window`` of each query, and the R projected rows ``k_rows``, ``v_rows``.

    q, k, v: ``B x H x T x D``; key_real: ``B x T``, True where a position may be read in the
    band, or None; k_rows, v_rows: ``B x H x R x D``; rows_real: ``B x R`` or None; rows_offset:
    added to every row's logit, broadcastable to ``B x H x 1 x 1``; dropout: the probability of
    dropping a weight; rows_share: ``B x 1 x T x R``, also added to the rows' logits (the log of the
    share of each row that lies outside each query's band), or the ``CountOnce`` that
    ``rows_outside_band`` computes it from, or None; it gets no gradient. Returns ``B x H x T x D``, in q's dtype.

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
    if isinstance(rows_share, CountOnce):
        rows_share = rows_outside_band(rows_share, k_rows.size(2), half_window, T)
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


def unread_share(at: Tensor, row: Tensor, length: Tensor, width: Tensor, half: int) -> Tensor:
    """log(the real tokens of row ``row`` that the band of query ``at`` does not read / the row's
    width): row r covers [r w, (r + 1) w), of which the real tokens are those below L; query i's band
    reads [i - half, i + half] within them. So a row's count, width x share, is the number of its real
    tokens the band leaves: a row past the sentence counts 0 (-inf), a pooled last row of 7 real
    tokens 7, not 8. Broadcasts; also computed inside flex's score_mod. A row the band reads whole
    leaves exactly 0 (-inf), not the log of a rounding error: its unread and read counts are the same
    differences, ``end - start``."""
    start = row * width
    end = torch.minimum(start + width, length)
    low, high = (at - half).clamp(min=0), torch.minimum(at + half + 1, length)
    read = (torch.minimum(end, high) - torch.maximum(start, low)).clamp(min=0)
    return ((end - start).clamp(min=0) - read).clamp(min=0).div(width).log()


def rows_outside_band(count: CountOnce, rows: int, half: int, T: int, queries: slice = slice(None)) -> Tensor:
    """``unread_share`` of every row at every query (of ``queries``), ``B x 1 x T x R`` (0 in sentences
    read exactly)."""
    B, device = count.lengths.size(0), count.lengths.device
    at = torch.arange(T, device=device, dtype=count.width.dtype)[queries].view(1, -1, 1)
    row = torch.arange(rows, device=device, dtype=count.width.dtype).view(1, 1, rows)
    share = unread_share(at, row, count.lengths.view(B, 1, 1), count.width.view(B, 1, 1), half)
    if count.banded is not None:
        share = share.masked_fill(~count.banded.view(B, 1, 1), 0.0)
    return share.unsqueeze(1)


FLEX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what flex_attention takes on every device


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
        "a GPU for training (flex_attention has no backward on a CPU)" if needs_grad and not q.is_cuda else "",
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


def attend_band(requested: str, inputs: BandInputs, needs_grad: bool) -> Tensor:
    """``inputs`` through the kernel ``band_kernel`` picks (flex's module imported only then)."""
    if band_kernel(requested, inputs.q, inputs.dropout, needs_grad) == "blockwise":
        return attend_local_and_projected(*inputs)
    from .linformer_band_flex import attend_local_and_projected_flex

    return attend_local_and_projected_flex(*inputs)
