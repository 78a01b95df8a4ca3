"""The band and the rows as one fused flex_attention call (``--local-kernel flex``), imported only where
that kernel is chosen (``linformer_band.attend_band``): the compiled kernels are this module's state.

Every shape a run meets compiles a kernel of its own (static shapes: dynamic ones recompile with
symbolic sizes, which fails on a CPU in torch 2.13), so the shapes are made few: lengths padded to
buckets (``flex_length``), rows to whole tiles, and a batch split into pieces of powers of two. The
kernels are counted here, and each new one is logged; past ``FLEX_KERNELS`` (or dynamo's own recompile
limit, where that is lower, which would otherwise run flex unfused, with a dense T x (T + R) score
tensor) a shape runs the blockwise kernel instead, with one warning. No dynamo setting is changed.
"""

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from .linformer_band import CountOnce, attend_local_and_projected, rows_outside_band, unread_share

FLEX_BLOCK = 128  # flex_attention's tile: bucketed lengths and row counts are multiples of it
FLEX_KERNELS = 8  # compiled kernels a process keeps: dynamo's default recompile limit

logger = logging.getLogger(__name__)

_kernels: set = set()  # the shapes compiled so far
_block_masks: dict = {}
_compiled = None
_warned = False


def flex_length(T: int) -> int:
    """The length a flex band pads T to, so that batches of nearby lengths share one compiled kernel:
    a multiple of 128 up to 1,024, then four lengths an octave (at most 25% padding)."""
    if T <= 1024:
        return -(-T // FLEX_BLOCK) * FLEX_BLOCK
    step = 1 << (T.bit_length() - 3)  # a quarter of the octave T lies in
    return -(-T // step) * step


def batch_pieces(B: int) -> list[int]:
    """B as powers of two, largest first (13: 8, 4, 1): any batch runs through kernels compiled for at
    most log2(B) + 1 batch sizes, and no sentence is computed for padding."""
    return [1 << bit for bit in reversed(range(B.bit_length())) if B >> bit & 1]


def band_block_mask(T: int, R: int, half: int, device):
    """The band's block structure over [the T keys; the R rows] (multiples of ``FLEX_BLOCK``), built
    from block indices: query block i reads the key blocks within ``half`` of it (whole, needing no
    mask, where every pair is within ``half``) and every row block; O(T / 128) numbers, never a T x (T +
    R) mask. Padding is the score_mod's. Cached per shape."""
    key = (T, R, half, str(device))
    if key in _block_masks:
        return _block_masks[key]
    from torch.nn.attention.flex_attention import BlockMask

    blocks, reach, row_blocks = T // FLEX_BLOCK, -(-half // FLEX_BLOCK), R // FLEX_BLOCK
    at = torch.arange(blocks, device=device).view(blocks, 1)
    near = at + torch.arange(-reach, reach + 1, device=device)  # blocks x (2 reach + 1): every block the band touches
    inside = (near >= 0) & (near < blocks)
    whole = inside & ((at - near).abs() * FLEX_BLOCK + FLEX_BLOCK - 1 <= half)  # its farthest pair within half
    rows = torch.arange(blocks, blocks + row_blocks, device=device).expand(blocks, row_blocks)

    def listed(indices: Tensor, kept: Tensor):
        """flex's layout: a count a query block, and its blocks first in a row as wide as the key blocks."""
        order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)
        counts = kept.sum(1, dtype=torch.int32).view(1, 1, blocks)
        indices = indices.gather(1, order).clamp(0, blocks + row_blocks - 1).to(torch.int32)
        width = blocks + row_blocks
        indices = F.pad(indices, (0, width - indices.size(1))) if indices.size(1) < width else indices[:, :width]
        return counts, indices.view(1, 1, blocks, width)

    def band_or_row(b, h, q_at, kv_at):
        return (kv_at >= T) | ((q_at - kv_at).abs() <= half)

    partial = listed(near, inside & ~whole)
    full = listed(torch.cat([near, rows], 1), torch.cat([whole, torch.ones_like(rows, dtype=torch.bool)], 1))
    mask = BlockMask.from_kv_blocks(
        *partial, *full, BLOCK_SIZE=FLEX_BLOCK, mask_mod=band_or_row, seq_lengths=(T, T + R)
    )
    _block_masks[key] = mask
    return mask


def _band_flex(q, keys, values, score_mod, block_mask, lse: bool):
    """flex_attention in a function of this module's own: dynamo keeps its compiled kernels, and counts
    them against its recompile limit, per function, apart from any other caller's flex_attention."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    aux = AuxRequest(lse=True) if lse else None
    return flex_attention(q, keys, values, score_mod=score_mod, block_mask=block_mask, return_aux=aux)


def _kernel():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_band_flex, dynamic=False)
    return _compiled


def _admitted(shapes: list[tuple]) -> bool:
    """Whether every shape of a call has, or may compile, a kernel within the limit; logs each new one
    and warns the first time a call must run blockwise instead."""
    global _warned
    import torch._dynamo

    config = torch._dynamo.config
    limit = min(FLEX_KERNELS, getattr(config, "recompile_limit", getattr(config, "cache_size_limit", FLEX_KERNELS)))
    new = [s for s in dict.fromkeys(shapes) if s not in _kernels]
    if len(_kernels) + len(new) > limit:
        if not _warned:
            logger.warning(
                f"flex band: {len(_kernels)} kernels compiled, the limit ({limit}); batches of new shapes "
                f"(here {new[0]}) run the blockwise kernel, with the same result"
            )
            _warned = True
        return False
    for shape in new:
        _kernels.add(shape)
        logger.info(f"flex band: compiling kernel {len(_kernels)} of at most {limit}: {shape}")
    return True


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
    rows_share: Tensor | CountOnce | None = None,
) -> Tensor:
    """``attend_local_and_projected`` (same arguments, same result) as fused flex_attention over [the
    band's keys; the rows], the scores never stored. The band is a cached BlockMask; padding (a prefix
    of real keys and rows in each sentence: pads are on the right), the offset and the share enter
    through the score_mod, a ``CountOnce`` share computed there from each sentence's length and width.
    The length is padded to ``flex_length``, the rows to whole tiles, the batch cut by ``batch_pieces``."""
    assert dropout == 0, "flex_attention applies no attention dropout: use the blockwise kernel"
    B, H, T, D = q.shape
    R, padded = k_rows.size(2), flex_length(T)
    rows_padded = -(-R // FLEX_BLOCK) * FLEX_BLOCK
    grad_mode = torch.is_grad_enabled()  # dynamo guards on it, and on every input's requires_grad
    offset_grad = grad_mode and rows_offset.requires_grad
    requires = tuple(t.requires_grad for t in (q, k, v, k_rows, v_rows, rows_offset))
    pieces = batch_pieces(B)
    shape = (
        H,
        padded,
        rows_padded,
        D,
        q.dtype,
        str(q.device),
        half_window,
        type(rows_share).__name__,
        grad_mode,
        requires,
    )
    if not _admitted([(piece, *shape) for piece in pieces]):
        return attend_local_and_projected(
            q, k, v, key_real, half_window, k_rows, v_rows, rows_real, rows_offset, 0.0, rows_share
        )

    dtype = q.dtype
    keys = torch.cat(
        [F.pad(k.to(dtype), (0, 0, 0, padded - T)), F.pad(k_rows.to(dtype), (0, 0, 0, rows_padded - R))], 2
    )
    values = torch.cat(
        [F.pad(v.to(dtype), (0, 0, 0, padded - T)), F.pad(v_rows.to(dtype), (0, 0, 0, rows_padded - R))], 2
    )
    # per sentence: keys [0, band_end) and rows [padded, rows_end) are readable; a scalar a sentence,
    # where a B x (T + R) mask read per score made the kernel 18x slower on a GPU
    band_end = q.new_full((B,), T, dtype=torch.int32) if key_real is None else key_real.sum(1, dtype=torch.int32)
    real_rows = q.new_full((B,), R, dtype=torch.int32) if rows_real is None else rows_real.sum(1, dtype=torch.int32)
    per_sentence = {
        "offset": rows_offset.detach().to(torch.float32).expand(B, H, 1, 1).reshape(B, H),
        "band_end": band_end,
        "rows_end": padded + real_rows,
    }
    if isinstance(rows_share, CountOnce):
        per_sentence["length"], per_sentence["width"] = rows_share.lengths.float(), rows_share.width.float()
        if rows_share.banded is not None:
            per_sentence["banded"] = rows_share.banded
    elif rows_share is not None:  # any share: read per score
        share = F.pad(rows_share.to(torch.float32).view(B, T, R), (0, rows_padded - R, 0, padded - T))
        per_sentence["share"] = share
    block_mask = band_block_mask(padded, rows_padded, half_window, q.device)
    queries = F.pad(q, (0, 0, 0, padded - T))
    outs, lses, start = [], [], 0
    for piece in pieces:
        at = slice(start, start + piece)
        values_of = {name: t[at] for name, t in per_sentence.items()}
        with torch.autocast(q.device.type, enabled=False):
            out = _kernel()(
                queries[at], keys[at], values[at], _score_mod(padded, half_window, values_of), block_mask, offset_grad
            )
        if offset_grad:  # (out, AuxOutput)
            out, aux = out
            lses.append(aux.lse[:, :, :T])
        outs.append(out[:, :, :T])
        start += piece
    out = torch.cat(outs)
    if not offset_grad:
        return out
    # the offset's gradient outside the kernel: read in the score_mod, it costs an atomic add a score
    lse = torch.cat(lses)
    return out + _offset_gradient_carrier(q, k_rows, v_rows, rows_real, rows_offset, rows_share, half_window, lse, out)


def _score_mod(padded: int, half: int, sentence: dict):
    """The score_mod of one call: readability, the rows' offset and their share (``sentence``: the
    per-sentence tensors of ``attend_local_and_projected_flex``)."""
    offset, band_end, rows_end = sentence["offset"], sentence["band_end"], sentence["rows_end"]
    share, length, width, banded = (sentence.get(name) for name in ("share", "length", "width", "banded"))

    def score_mod(score, b, h, q_at, kv_at):
        is_row = kv_at >= padded
        row = (kv_at - padded).clamp(min=0)
        bias = offset[b, h]
        if share is not None:
            bias = bias + share[b, q_at, row]
        elif length is not None:
            unread = unread_share(q_at.to(torch.float32), row.to(torch.float32), length[b], width[b], half)
            bias = bias + (unread if banded is None else torch.where(banded[b], unread, 0.0))
        readable = torch.where(is_row, kv_at < rows_end[b], kv_at < band_end[b])
        return torch.where(readable, torch.where(is_row, score + bias, score), float("-inf"))

    return score_mod


def _offset_gradient_carrier(
    q, k_rows, v_rows, rows_real, rows_offset, rows_share, half: int, lse, out, chunk=1024
) -> Tensor:
    """Zero, with the gradient of the output with respect to the rows' offset: d out_i / d offset =
    sum over rows r of p_ir (v_r - out_i), from the rows' weights p_ir = exp(score_ir - lse_i),
    ``chunk`` queries at a time (their ``B x H x chunk x R`` scores, and shares, in float32)."""
    slopes = []
    with torch.no_grad():
        for start in range(0, q.size(2), chunk):
            at = slice(start, start + chunk)
            scores = torch.matmul(q[:, :, at].float(), k_rows.float().transpose(-1, -2)) * q.size(-1) ** -0.5
            scores += rows_offset.float()
            if isinstance(rows_share, CountOnce):
                scores += rows_outside_band(rows_share, k_rows.size(2), half, q.size(2), at).float()
            elif rows_share is not None:
                scores += rows_share[:, :, at].float()
            if rows_real is not None:
                scores.masked_fill_(~rows_real.view(rows_real.size(0), 1, 1, -1), float("-inf"))
            weights = scores.sub_(lse[:, :, at].float().unsqueeze(-1)).exp_()
            rows_out = torch.matmul(weights, v_rows.float())
            slopes.append(rows_out.sub_(weights.sum(-1, keepdim=True) * out[:, :, at].float()))
    return ((rows_offset - rows_offset.detach()).float() * torch.cat(slopes, 2)).to(out.dtype)
