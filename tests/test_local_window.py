"""--local-window: an exact local band beside the projection, in one softmax. Numerics against
a dense masked reference in float64 (odd lengths, padding, windows wider than the input),
gradients, every projection, exact inputs, half precision, activation checkpointing, and
checkpoints; --local-count-once's recount of the rows against counted positions."""

import copy
import itertools
import math
from fractions import Fraction

import pytest
import torch
from test_linformer_model import HALF, assert_within_half_precision, attention, build_model, features, tokens

from linformer_fairseq.modules import (
    COMPRESS_SHARING,
    COMPRESS_TYPES,
    LinformerMultiheadAttention,
    LinformerSettings,
    linformer_band,
    linformer_projection,
)
from linformer_fairseq.modules.linformer_attention import projection
from linformer_fairseq.modules.linformer_band import (
    CountOnce,
    attend_local_and_projected,
    band_geometry,
    rows_outside_band,
)

PAD = 1


def dense_band_and_rows(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, share=None):
    """The reference: the full T x T scores masked to |i - j| <= half, beside the rows' scores
    (plus ``share``, ``B x 1 x T x R``, when given)."""
    T, D = q.size(2), q.size(3)
    at = torch.arange(T)
    readable = ((at.view(T, 1) - at.view(1, T)).abs() <= half).view(1, 1, T, T)
    if key_real is not None:
        readable = readable & key_real.view(-1, 1, 1, T)
    band = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~readable, -math.inf)
    rows = q @ k_rows.transpose(-1, -2) / math.sqrt(D) + offset
    if share is not None:
        rows = rows + share
    if rows_real is not None:
        rows = rows.masked_fill(~rows_real.view(rows_real.size(0), 1, 1, -1), -math.inf)
    weights = torch.softmax(torch.cat([band, rows], -1), -1)
    return weights[..., :T] @ v + weights[..., T:] @ v_rows


def band_inputs(T, R, B=2, H=3, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    k_rows, v_rows = (torch.randn(B, H, R, D, generator=g, dtype=torch.float64) for _ in range(2))
    key_real = torch.ones(B, T, dtype=torch.bool)
    key_real[1, max(1, T - 3) :] = False  # the second sentence is padded
    rows_real = torch.ones(B, R, dtype=torch.bool)
    rows_real[1, -1] = False
    offset = torch.randn(B, H, 1, 1, generator=g, dtype=torch.float64)
    return q, k, v, key_real, k_rows, v_rows, rows_real, offset


@pytest.mark.parametrize("T,half,R", [(1, 2, 3), (7, 2, 3), (13, 4, 5), (16, 8, 4), (5, 16, 2), (33, 3, 7), (40, 1, 6)])
def test_band_matches_the_dense_masked_reference(T, half, R):
    """Odd lengths, lengths not a multiple of the block, windows wider than the input, padding."""
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T, R)
    got = attend_local_and_projected(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset)
    expected = dense_band_and_rows(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    unmasked = attend_local_and_projected(q, k, v, None, half, k_rows, v_rows, None, offset)
    torch.testing.assert_close(unmasked, dense_band_and_rows(q, k, v, None, half, k_rows, v_rows, None, offset))


def random_share(T, R, B=2, seed=1):
    """A stand-in for the recount: the log of a share in (0, 1], and -inf for some rows."""
    g = torch.Generator().manual_seed(seed)
    share = torch.rand(B, 1, T, R, generator=g, dtype=torch.float64).log()
    return share.masked_fill(torch.rand(B, 1, T, R, generator=g) < 0.2, -math.inf)


@pytest.mark.parametrize("T,half,R", [(7, 2, 3), (13, 4, 5), (5, 16, 2), (40, 1, 6)])
def test_band_with_the_rows_recounted_matches_the_dense_reference(T, half, R):
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T, R)
    share = random_share(T, R)
    got = attend_local_and_projected(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, 0.0, share)
    expected = dense_band_and_rows(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, share)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def counted_share(length: int, width: Fraction, rows: int, half: int, T: int):
    """The recount by counting, apart from the implementation: row r stands for the positions [r w,
    (r + 1) w), in steps of 1/d (w = m/d); of them, those of the L real tokens that query i's band [i -
    half, i + half] does not read are what it still counts. Its share is that count over the m steps
    of its width (so a row past the sentence counts nothing), its log what the rows' logits get."""
    m, d = width.numerator, width.denominator
    share = torch.empty(T, rows, dtype=torch.float64)
    for i, r in itertools.product(range(T), range(rows)):
        real = set(range(r * m, (r + 1) * m)) & set(range(d * length))
        band = set(range(d * max(0, i - half), d * (i + half + 1)))
        share[i, r] = len(real - band) / m
    return share.log()


def share_of(length: int, width, rows: int, half: int, T: int):
    count = CountOnce(
        torch.tensor([float(length)], dtype=torch.float64), torch.tensor([float(width)], dtype=torch.float64), None
    )
    return rows_outside_band(count, rows, half, T)


@pytest.mark.parametrize(
    "length,width,rows,half,T",
    [(20, 4, 8, 3, 24), (9, 2, 8, 0, 12), (30, 5, 6, 40, 30), (10, 4, 4, 2, 12), (15, 8, 2, 1, 16), (7, 2.5, 4, 1, 10)],
)
def test_rows_outside_band_counts_the_tokens_the_band_leaves(length, width, rows, half, T):
    """Rows partly past the sentence (its last tokens), wholly past it, a pooled last row of 7 tokens
    (counting 7, not 8), fractional widths, a band wider than the input, half = 0."""
    got = share_of(length, width, rows, half, T)
    expected = counted_share(length, Fraction(width), rows, half, T)
    assert got.shape == (1, 1, T, rows)
    torch.testing.assert_close(got[0, 0].exp(), expected.exp(), atol=1e-12, rtol=0)
    assert torch.equal(got[0, 0].isinf(), expected.isinf()), "a row with nothing left to count must drop out"


def test_rows_at_the_sentences_end_count_their_real_tokens_only():
    """n/k = 4 over L = 10 tokens, W = 4: row 2 holds tokens 8 and 9 only, so it counts 2 of its 4
    positions where the band reads neither, 1 at query 6 and none from query 7 on; row 3 lies past the
    sentence and counts nothing at any query (it kept a full count of 4 before)."""
    count = share_of(10, 4, 4, 2, 12)[0, 0, :10].exp() * 4  # the real queries
    expected = torch.tensor([2, 2, 2, 2, 2, 2, 1, 0, 0, 0], dtype=torch.float64)
    torch.testing.assert_close(count[:, 2], expected)
    assert torch.equal(count[:, 3], torch.zeros(10, dtype=torch.float64))


def test_rows_outside_band_takes_out_exactly_the_band_from_stretched_rows():
    """Under resample the rows split a sentence's L tokens in windows of L/k (fractional): over
    the rows, what the recount takes out of the counts is the band's size, no more, no less."""
    lengths, k, half, T = torch.tensor([37, 23, 5]), 8, 4, 37
    width = lengths.double() / k
    share = rows_outside_band(CountOnce(lengths.double(), width, None), k, half, T)[:, 0]  # B x T x R
    taken = ((1 - share.exp()) * width.view(-1, 1, 1)).sum(-1)  # B x T: these rows are all covered whole
    at = torch.arange(T)
    band = (torch.minimum(at + half + 1, lengths.view(-1, 1)) - (at - half).clamp(min=0)).clamp(min=0)
    real = at.view(1, T) < lengths.view(-1, 1)
    torch.testing.assert_close(taken[real], band[real].double(), atol=1e-9, rtol=0)


@pytest.mark.parametrize("T,half", [(9, 2), (8, 1), (4, 6)])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_band_gradients_match_finite_differences(T, half, dropout):
    """The backward pass recomputes the weights (and reuses the forward pass's dropout mask)."""
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T=T, R=3, B=2, H=2, D=3)
    inputs = [t.requires_grad_() for t in (q, k, v, k_rows, v_rows, offset)]

    def band(q, k, v, k_rows, v_rows, offset):
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        return attend_local_and_projected(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, dropout)

    assert torch.autograd.gradcheck(band, inputs)


def test_band_gradients_with_the_rows_recounted_match_finite_differences():
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T=9, R=3, B=2, H=2, D=3)
    share = random_share(9, 3)
    inputs = [t.requires_grad_() for t in (q, k, v, k_rows, v_rows, offset)]

    def band(q, k, v, k_rows, v_rows, offset):
        torch.manual_seed(0)
        return attend_local_and_projected(q, k, v, key_real, 2, k_rows, v_rows, rows_real, offset, 0.2, share)

    assert torch.autograd.gradcheck(band, inputs)


def test_band_dropout_keeps_the_expected_output():
    """Dropout zeroes weights and rescales the rest: averaged over draws, the output is the undropped one."""
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T=11, R=4)
    exact = attend_local_and_projected(q, k, v, key_real, 3, k_rows, v_rows, rows_real, offset)
    torch.manual_seed(0)
    draws = torch.stack(
        [attend_local_and_projected(q, k, v, key_real, 3, k_rows, v_rows, rows_real, offset, 0.5) for _ in range(4000)]
    )
    assert (draws[0] - exact).abs().max() > 0.1, "dropout changed nothing"
    spread = draws.std(0) / math.sqrt(len(draws))
    assert ((draws.mean(0) - exact).abs() < 5 * spread + 1e-9).all(), "dropout biased the output"


def test_band_backward_keeps_no_weights():
    """Training keeps O(T) numbers a head for the backward pass, not the T x (1.5 W + R) weights
    (with dropout, one byte a weight for its mask)."""
    B, H, T, D, R, half = 2, 4, 256, 8, 64, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    k_rows, v_rows = (torch.randn(B, H, R, D, generator=g, requires_grad=True) for _ in range(2))
    offset = torch.zeros(1, H, 1, 1, requires_grad=True)
    leaves = {t.untyped_storage().data_ptr() for t in (q, k, v, k_rows, v_rows, offset)}

    def kept_bytes(dropout):
        saved = {}

        def keep(t):
            if t.untyped_storage().data_ptr() not in leaves:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = attend_local_and_projected(q, k, v, None, half, k_rows, v_rows, None, offset, dropout)
        out.sum().backward()
        return sum(saved.values())

    weights = B * H * T * (3 * half + R) * 4
    without_dropout = kept_bytes(0.0)
    assert without_dropout < weights / 8, f"{without_dropout} bytes kept, the fp32 weights are {weights}"
    assert kept_bytes(0.1) - without_dropout <= weights / 4, "more than a byte a weight kept for dropout"


@pytest.mark.parametrize("block,T,half", [(3, 13, 4), (5, 11, 2), (7, 9, 1), (2, 10, 5), (4, 6, 0)])
def test_band_with_other_blocks_matches_the_dense_reference_and_its_gradients(monkeypatch, block, T, half):
    """Blocks other than the band's half width (BAND_BLOCK), spans that are not a multiple of them:
    the forward pass and the backward pass, which folds each block's span back onto the keys."""
    monkeypatch.setattr(linformer_band, "BAND_BLOCK", block)
    assert band_geometry(half, T).block == block
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T=T, R=3, B=2, H=2, D=3)
    share = random_share(T, 3)
    got = attend_local_and_projected(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, 0.0, share)
    expected = dense_band_and_rows(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, share)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    inputs = [t.requires_grad_() for t in (q, k, v, k_rows, v_rows, offset)]

    def band(q, k, v, k_rows, v_rows, offset):
        return attend_local_and_projected(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, 0.0, share)

    assert torch.autograd.gradcheck(band, inputs)


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_band_computes_in_float32(dtype):
    """In bf16 and fp16 the band's scores, exponentials, sums, products with the values and softmax
    backward run in float32, as fused attention kernels do: on half-precision inputs, the output and
    every gradient are as close to float64 on the same inputs as the float64 result rounded to the
    dtype (the baseline: no result in the dtype does better), at most 1.5x its mean error. Computed
    in the dtype they were 5x (output) and 4x to 8x (gradients) the baseline away."""
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T=97, R=8, B=2, H=2, D=16)
    share = random_share(97, 8)
    q = q * 2  # peaked attention
    halves = [t.to(dtype) for t in (q, k, v, k_rows, v_rows)]
    exact = [t.double().requires_grad_() for t in halves]
    reference = dense_band_and_rows(*exact[:3], key_real, 4, *exact[3:], rows_real, offset, share)
    grad = torch.randn_like(reference).to(dtype)
    expected = torch.autograd.grad(reference, exact, grad.double())
    inputs = [t.requires_grad_() for t in halves]
    out = attend_local_and_projected(*inputs[:3], key_real, 4, *inputs[3:], rows_real, offset, 0.0, share)
    assert out.dtype == dtype
    got = torch.autograd.grad(out, inputs, grad)
    for name, g, e in zip(("output", "q", "k", "v", "k_rows", "v_rows"), (out, *got), (reference, *expected)):
        assert g.dtype == dtype
        error, rounding = (g.double() - e).abs().mean(), (e.to(dtype).double() - e).abs().mean()
        assert error <= 1.5 * rounding, f"{name}: mean error {error / rounding:.2f}x the rounding to {dtype}"


def largest_allocation(run) -> int:
    """The largest single allocation (bytes) on the CPU while ``run()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def test_band_forward_allocates_nothing_of_T_by_T():
    """A training forward of a band layer at T = 4,096, W = 8 (count once, padding): no allocation
    holds T x T bytes, let alone T x T weights (the check sees one, too)."""
    T = 4096
    torch.manual_seed(0)
    attn = attention(8, 2, T, 16, length_norm="exact", local_window=8, local_count_once=True).train()
    x = torch.randn(T, 2, 8)
    pad_mask = torch.arange(T).view(1, T) >= torch.tensor([T, T - 1000]).view(-1, 1)
    assert largest_allocation(lambda: torch.ones(T, T, dtype=torch.bool)) >= T * T
    assert largest_allocation(lambda: attn(x, key_padding_mask=pad_mask)) < T * T


def module_reference(attn, x, pad_mask):
    """The module's output from its own projected rows, recomputed densely in float64: a row stands
    for n/k tokens, or for L/k (below 1 when L < k) where resample / exact stretch E over a sentence
    of L tokens; a sentence exact reads as its own rows (at most k tokens, and in training not marked
    by read_projected) gets no band."""
    T, B, C = x.shape
    H, D = attn.num_heads, attn.head_dim
    k_rows, v_rows, kept = attn.project_keys_values(x, pad_mask)

    def heads(t):
        return t.view(t.size(0), B, H, D).permute(1, 2, 0, 3)

    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x))
    lengths = (~pad_mask).sum(1)
    proj = attn.compress_k
    key_real = ~pad_mask
    half, exact = attn.local_window // 2, torch.zeros(B, dtype=torch.bool)
    if proj.kind == "linear" and proj.length_power == -2.0:  # exact: short sentences' rows are their tokens
        exact = lengths <= proj.k
        if attn.training and proj.read_projected is not None:
            exact &= ~proj.read_projected
        key_real = key_real & ~exact.view(B, 1)
    stretched = proj.kind == "linear" and proj.length_power < 0
    widths = [
        Fraction(1) if exact[b] else Fraction(length, proj.k) if stretched else Fraction(proj.max_positions, proj.k)
        for b, length in enumerate(lengths.tolist())
    ]
    count = torch.tensor([math.log(w) for w in widths], dtype=torch.float64).view(B, 1, 1, 1)
    offset = count + attn.local_far_bias.view(1, H, 1, 1)
    share = None
    if attn.local_count_once:  # the positions of each row's window that the band leaves
        share = torch.zeros(B, 1, T, k_rows.size(0), dtype=torch.float64)
        for b, length in enumerate(lengths.tolist()):
            if not exact[b]:
                share[b, 0] = counted_share(length, widths[b], k_rows.size(0), half, T)
    out = dense_band_and_rows(q, k, v, key_real, half, heads(k_rows), heads(v_rows), kept, offset, share)
    return attn.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, C))


@pytest.mark.parametrize(
    "kind,sharing,length_norm",
    [(kind, sharing, "none") for kind, sharing in itertools.product(COMPRESS_TYPES, COMPRESS_SHARING)]
    + [("linear", "headwise", norm) for norm in ("sqrt", "linear", "resample", "exact")]
    + [("linear", "none", "exact")],
)
@pytest.mark.parametrize("count_once", [False, True])
def test_module_matches_the_dense_reference_for_every_projection(kind, sharing, length_norm, count_once):
    """With --local-count-once the reference counts the positions of each row's window that the
    band leaves, and a sentence alone gives what it gives padded in the batch."""
    n, k, T = 32, 8, 23  # T > k: every sentence but the 6-token one goes through the projection
    torch.manual_seed(0)
    settings = LinformerSettings(
        n, (k,), sharing, kind, length_norm, "xavier", local_window=6, local_count_once=count_once
    )
    layerwise = projection(settings, k) if sharing == "layerwise" else None
    attn = LinformerMultiheadAttention(16, 4, settings, k, shared_projection=layerwise).double().eval()
    with torch.no_grad():
        attn.local_far_bias.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    lengths = torch.tensor([23, 15, 6])
    pad_mask = torch.arange(T).view(1, T) >= lengths.view(-1, 1)
    x = torch.randn(T, 3, 16, dtype=torch.float64)
    with torch.no_grad():
        got, _ = attn(x, key_padding_mask=pad_mask)
        expected = module_reference(attn, x, pad_mask)
    real = ~pad_mask.t()
    torch.testing.assert_close(got[real], expected[real], atol=1e-12, rtol=0)
    if count_once:
        with torch.no_grad():
            alone, _ = attn(x[:15, 1:2], key_padding_mask=pad_mask[1:2, :15])
        torch.testing.assert_close(alone[:, 0], got[:15, 1], atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "kind,length_norm,count_once",
    [("linear", "none", False), ("linear", "exact", True), ("linear", "resample", True), ("mean", "none", True)],
)
def test_module_gradients_match_the_dense_reference(kind, length_norm, count_once):
    """Gradients of the input and every parameter through the module, with padding; counted once,
    with a sentence exact reads as its own rows, rows of L/k tokens and pooled rows the sentence fills
    in part."""
    n, k, T, W = 64, 8, 61, 16
    torch.manual_seed(0)
    settings = LinformerSettings(n, (k,), "headwise", kind, length_norm, local_window=W, local_count_once=count_once)
    attn = LinformerMultiheadAttention(16, 4, settings, k).double()
    with torch.no_grad():
        attn.local_far_bias.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    pad_mask = torch.arange(T).view(1, T) >= torch.tensor([61, 40, 6]).view(-1, 1)
    x = torch.randn(T, 3, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randn(T, 3, 16, dtype=torch.float64) * ~pad_mask.t().unsqueeze(-1)
    params = [x, *attn.parameters()]
    grads = torch.autograd.grad((attn(x, key_padding_mask=pad_mask)[0] * target).sum(), params, allow_unused=True)
    expected = torch.autograd.grad((module_reference(attn, x, pad_mask) * target).sum(), params, allow_unused=True)
    for (name, _), g, e in zip([("x", x), *attn.named_parameters()], grads, expected):
        assert (g is None) == (e is None), name
        if g is not None:
            torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("count_once", [False, True])
def test_sentences_read_through_resample_stand_for_L_over_k_tokens_a_row(count_once):
    """--compress-resample-prob in training: a sentence of L <= k tokens that read_projected marks is
    read as resample reads it, its k rows L/k tokens each (5/16 at L = 5: k rows for its 5 tokens),
    beside its band; an unmarked one is read exactly (its rows are its tokens, no band); longer ones
    as before. Against the dense reference, with the band's rows counted once or not."""
    n, k, T = 32, 16, 30
    torch.manual_seed(0)
    settings = LinformerSettings(
        n, (k,), "headwise", "linear", "exact", "xavier", resample_prob=0.5, local_window=4, local_count_once=count_once
    )
    attn = LinformerMultiheadAttention(16, 4, settings, k).double().train()
    with torch.no_grad():
        attn.local_far_bias.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    lengths, drawn = torch.tensor([5, 5, 12, 23, 30]), torch.tensor([True, False, True, False, True])
    attn.compress_k.read_projected = attn.compress_v.read_projected = drawn
    pad_mask = torch.arange(T).view(1, T) >= lengths.view(-1, 1)
    sentences = attn.compress_k.sentences(pad_mask, T, 5, "cpu")
    assert sentences.exact.tolist() == [False, True, False, False, False]
    torch.testing.assert_close(
        sentences.width, torch.tensor([5 / 16, 1, 12 / 16, 23 / 16, 30 / 16], dtype=torch.float32)
    )
    x = torch.randn(T, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        got, _ = attn(x, key_padding_mask=pad_mask)
        expected = module_reference(attn, x, pad_mask)
    real = ~pad_mask.t()
    torch.testing.assert_close(got[real], expected[real], atol=1e-12, rtol=0)


def test_per_sentence_quantities_are_computed_once_a_forward(monkeypatch):
    """Lengths, exact reading and row width come from one place (SequenceProjection.sentences), once
    a layer's forward, for E, F and the band alike."""
    calls = []
    counted = linformer_projection.sentence_lengths
    monkeypatch.setattr(linformer_projection, "sentence_lengths", lambda *args: calls.append(1) or counted(*args))
    attn = attention(16, 4, 32, 8, length_norm="exact", local_window=4, local_count_once=True)
    pad_mask = torch.arange(20).view(1, 20) >= torch.tensor([20, 6]).view(-1, 1)
    attn(torch.randn(20, 2, 16), key_padding_mask=pad_mask)
    assert len(calls) == 1


def test_the_band_with_resample_prob_reads_each_sentence_as_one_model_reads_it():
    """A model trained with --compress-resample-prob and a band: in training each sentence's features
    are those of the sentence alone, either in eval (read exactly, no band: L <= k) or in a model that
    resamples every sentence, band and recount included; longer sentences read the same in both."""
    band = dict(local_window=4, local_count_once=True)
    model = build_model(compress_length_norm="exact", compress_resample_prob=0.5, **band)
    with torch.no_grad():
        for layer in model.encoder.sentence_encoder.layers:
            layer.self_attn.local_far_bias.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    state = model.state_dict()
    resample = build_model(compress_length_norm="resample", **band)
    resample.load_state_dict({key: torch.tensor(-1.0) if key.endswith("length_norm_power") else value
                              for key, value in state.items()})  # fmt: skip
    lengths = [3, 5, 7, 6, 4, 2, 7, 5, 3, 6, 12, 20]
    src = tokens(max(lengths), batch=len(lengths), seed=1)
    for b, L in enumerate(lengths):
        src[b, L:] = PAD
    with torch.no_grad():
        alone = [(features(model, src[b : b + 1, :L])[0], features(resample, src[b : b + 1, :L])[0])
                 for b, L in enumerate(lengths)]  # fmt: skip
        torch.manual_seed(0)
        trained = features(model.train(), src)
    readings = []
    for b, L in enumerate(lengths):
        exact, projected = alone[b]
        as_exact = torch.allclose(trained[b, :L], exact, atol=1e-5, rtol=0)
        as_projected = torch.allclose(trained[b, :L], projected, atol=1e-5, rtol=0)
        assert as_projected if L > 8 else as_exact or as_projected, f"sentence {b} (L={L}) read as neither reading"
        readings.append("projected" if as_projected else "exact")
    assert set(readings[:-2]) == {"exact", "projected"}, readings


def test_layers_with_and_without_a_band_by_their_k():
    """Per-layer k under exact: a layer whose k covers the input (32) reads every sentence exactly and
    has no band, the next (k = 8) bands the sentences longer than 8. Sentences of at most 8 tokens get
    the band-free model's features; the banded layer matches its dense reference on what it is given;
    a sentence alone gives what it gives padded in the batch."""
    dims = dict(layer_compressed_dims="32,8", compress_length_norm="exact")
    plain, banded = build_model(**dims), build_model(local_window=4, local_count_once=True, **dims)
    banded.load_state_dict(plain.state_dict())
    layers = banded.encoder.sentence_encoder.layers
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.local_far_bias.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
    lengths = [25, 8, 17, 5]
    src = tokens(25, batch=4, seed=3)
    for b, L in enumerate(lengths):
        src[b, L:] = PAD
    pad_mask = src.eq(PAD)
    with torch.no_grad():
        out, extra = banded(src, features_only=True, return_all_hiddens=True)
        reference = features(plain, src)
        inner = extra["inner_states"]
        for b, L in enumerate(lengths):
            torch.testing.assert_close(features(banded, src[b : b + 1, :L])[0], out[b, :L], atol=1e-5, rtol=0)
        attn = layers[1].self_attn
        x = layers[1].self_attn_layer_norm(inner[1]) if layers[1].normalize_before else inner[1]
        got = attn(x, key_padding_mask=pad_mask)[0]
        expected = module_reference(copy.deepcopy(attn).double(), x.double(), pad_mask)
    real = ~pad_mask.t()
    torch.testing.assert_close(got[real], expected[real].float(), atol=1e-5, rtol=0)
    for b, L in enumerate(lengths):
        if L <= 8:
            torch.testing.assert_close(out[b, :L], reference[b, :L], atol=1e-5, rtol=0)
        else:
            assert (out[b, :L] - reference[b, :L]).abs().max() > 1e-3, "the band changed nothing on a long input"


def test_window_zero_is_the_linformer_and_exact_inputs_get_no_band():
    """W = 0 builds today's model (same parameters, same outputs); a checkpoint without a band loads into
    a model with one; with a band, inputs that exact
    reads as their own rows (at most k tokens) give the W = 0 model's outputs, alone or in a
    batch with longer ones, and longer ones differ."""
    plain, zero = build_model(compress_length_norm="exact"), build_model(compress_length_norm="exact", local_window=0)
    assert plain.state_dict().keys() == zero.state_dict().keys()
    banded = build_model(compress_length_norm="exact", local_window=4)
    with torch.no_grad():
        for layer in banded.encoder.sentence_encoder.layers:
            layer.self_attn.local_far_bias.fill_(1.0)
    banded.load_state_dict(plain.state_dict())  # a checkpoint without a band: the offset starts at 0
    assert all(not layer.self_attn.local_far_bias.any() for layer in banded.encoder.sentence_encoder.layers)
    k = 8
    short, long_ = tokens(k, seed=1), tokens(20, seed=2)
    batch = torch.full((2, 20), PAD)
    batch[0, :k], batch[1] = short[0], long_[0]
    with torch.no_grad():
        torch.testing.assert_close(features(zero, batch), features(plain, batch), atol=0, rtol=0)
        torch.testing.assert_close(features(banded, short), features(plain, short), atol=0, rtol=0)
        mixed, reference = features(banded, batch), features(plain, batch)
    torch.testing.assert_close(mixed[0, :k], reference[0, :k], atol=1e-6, rtol=0)
    assert (mixed[1] - reference[1]).abs().max() > 1e-3, "the band changed nothing on a long input"


def test_band_trains_and_checkpointing_replays_it():
    """Gradients reach the far-field offset and the projections; with dropout on, activation
    checkpointing gives the same outputs and gradients as without."""
    src = tokens(20, batch=2)
    src[1, 13:] = PAD
    target = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(1))
    runs = []
    for checkpointing in (False, True):
        model = build_model(
            local_window=6, checkpoint_activations=checkpointing, dropout=0.2, attention_dropout=0.3
        ).train()
        torch.manual_seed(7)
        out = features(model, src)
        (out * target).sum().backward()
        runs.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain_out, plain), (ckpt_out, ckpt) = runs
    torch.testing.assert_close(ckpt_out, plain_out, atol=0, rtol=0)
    assert plain.keys() == ckpt.keys()
    for name, grad in ckpt.items():
        torch.testing.assert_close(grad, plain[name], atol=1e-9, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    bias = "encoder.sentence_encoder.layers.1.self_attn.local_far_bias"
    assert plain[bias].abs().min() > 0, "no gradient reaches the far field's per-head offset"


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("count_once", [False, True])
def test_half_precision_band_tracks_fp32(dtype, count_once):
    torch.manual_seed(0)
    attn = attention(64, 4, 32, 8, init="xavier", length_norm="resample", local_window=8, local_count_once=count_once)
    attn.eval()
    T, lengths = 27, torch.tensor([27, 17])
    pad_mask = torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)
    x = (torch.randn(T, 2, 64) * 2).to(dtype)
    with torch.no_grad():
        out = attn.to(dtype)(x, key_padding_mask=pad_mask)[0]
        ref = attn.float()(x.float(), key_padding_mask=pad_mask)[0]
    assert out.dtype == dtype
    assert_within_half_precision(out, ref, ~pad_mask.t(), dtype, max_eps=2.0, mean_eps=0.4)


def test_band_trains_under_autocast():
    """fairseq's --amp: the band runs in the autocast dtype, and its gradients track fp32's (with
    per-head projections the band's keys come out in fp32 beside bf16 queries)."""
    torch.manual_seed(0)
    attn = attention(64, 4, 32, 8, sharing="none", init="xavier", length_norm="resample", local_window=8)
    T, lengths = 27, torch.tensor([27, 17])
    pad_mask = torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1)
    x = torch.randn(T, 2, 64)
    grads = []
    for autocast in (False, True):
        attn.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attn(x, key_padding_mask=pad_mask)[0]
        assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
        (out.float() * ~pad_mask.t().unsqueeze(-1)).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None})
    fp32, bf16 = grads
    assert fp32.keys() == bf16.keys() and "local_far_bias" in fp32
    del fp32["k_proj.bias"]  # 0 but for rounding: it shifts every logit of a query alike
    for name, grad in fp32.items():
        error = (bf16[name] - grad).norm() / grad.norm()
        assert error < 0.05, f"{name}: relative error {error:.3f} under autocast"


def test_half_precision_band_does_not_overflow_on_large_values():
    """The output is a weighted mean of the values, so values near fp16's range come back intact
    (summed before the division by the weights' total they would overflow)."""
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T=40, R=6)
    big = torch.full_like(v, 2e4, dtype=torch.float16), torch.full_like(v_rows, 2e4, dtype=torch.float16)
    q, k, k_rows, offset = (t.half() for t in (q, k, k_rows, offset))
    out = attend_local_and_projected(q, k, big[0], key_real, 8, k_rows, big[1], rows_real, offset)
    torch.testing.assert_close(out, torch.full_like(out, 2e4), rtol=2e-3, atol=0)


def test_checkpoint_round_trip_and_clear_errors(tmp_path):
    model = build_model(local_window=6)
    with torch.no_grad():
        for layer in model.encoder.sentence_encoder.layers:
            layer.self_attn.local_far_bias.uniform_(-1, 1)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    loaded = build_model(local_window=6)
    loaded.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    src = tokens(25, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(features(loaded, src), features(model, src), atol=0, rtol=0)
    with pytest.raises(ValueError, match="even number"):
        build_model(local_window=5)
    with pytest.raises(ValueError, match="--local-count-once recounts the projected rows beside a band"):
        build_model(local_count_once=True)
    attn = attention(16, 4, 32, 8, local_window=4)
    with pytest.raises(ValueError, match="not returned with --local-window"):
        attn(torch.randn(20, 1, 16), need_weights=True)


def test_the_band_alone_and_the_rows_alone_as_the_long_document_study_reads_them():
    """studies/long_documents/runs.py's read_as: with its rows masked out a band model's attention
    is the dense band over the sentence's tokens alone, and with its band off it is the plain
    Linformer of its weights (short sentences read exactly keep their own rows either way)."""
    from long_documents.runs import read_as

    n, k, T = 32, 8, 23
    torch.manual_seed(0)
    settings = LinformerSettings(n, (k,), "headwise", "linear", "none", "xavier", local_window=6)
    lengths = torch.tensor([23, 15])
    pad_mask = torch.arange(T).view(1, T) >= lengths.view(-1, 1)
    x = torch.randn(T, 2, 16, dtype=torch.float64)
    attn = LinformerMultiheadAttention(16, 4, settings, k).double().eval()
    with torch.no_grad():
        attn.local_far_bias.copy_(torch.tensor([0.5, -1.0, 0.0, 2.0]))
        finetuned, _ = attn(x, key_padding_mask=pad_mask)
        band_alone, _ = read_as(copy.deepcopy(attn), "band only")(x, key_padding_mask=pad_mask)
        rows_alone, _ = read_as(copy.deepcopy(attn), "rows only")(x, key_padding_mask=pad_mask)
        B, H, D = 2, 4, 4
        q, kk, v = (p(x).view(T, B, H, D).permute(1, 2, 0, 3) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        no_rows = torch.zeros(B, H, 0, D, dtype=torch.float64)
        band = dense_band_and_rows(q, kk, v, ~pad_mask, 3, no_rows, no_rows, None, 0.0)
        without = LinformerSettings(n, (k,), "headwise", "linear", "none", "xavier")
        plain = LinformerMultiheadAttention(16, 4, without, k)
        plain.double().eval().load_state_dict(attn.state_dict(), strict=False)
        linformer, _ = plain(x, key_padding_mask=pad_mask)
    real = ~pad_mask.t()
    expected = attn.out_proj(band.permute(2, 0, 1, 3).reshape(T, B, 16))
    torch.testing.assert_close(band_alone[real], expected[real], atol=1e-12, rtol=0)
    torch.testing.assert_close(rows_alone[real], linformer[real], atol=1e-12, rtol=0)
    assert (finetuned[real] - band_alone[real]).abs().max() > 1e-3 < (finetuned[real] - rows_alone[real]).abs().max()
