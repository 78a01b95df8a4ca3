"""--local-window: an exact local band beside the projection, in one softmax. Numerics against
a dense masked reference in float64 (odd lengths, padding, windows wider than the input),
gradients, every projection, exact inputs, half precision, activation checkpointing, and
checkpoints; --local-count-once's recount of the rows against counted positions."""

import itertools
import math
from fractions import Fraction

import pytest
import torch
from test_linformer_model import HALF, assert_within_half_precision, attention, build_model, features, tokens

from linformer_fairseq.modules import COMPRESS_SHARING, COMPRESS_TYPES, LinformerMultiheadAttention, LinformerSettings
from linformer_fairseq.modules.linformer_attention import attend_local_and_projected, projection, rows_outside_band

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
    """rows_outside_band by counting: the share of row r's window [r w, (r + 1) w) that query i's
    band [i - half, i + half] does not read among the L real positions, in steps of 1/d (w = m/d)."""
    m, d = width.numerator, width.denominator
    share = torch.empty(T, rows, dtype=torch.float64)
    for i, r in itertools.product(range(T), range(rows)):
        window = set(range(r * m, (r + 1) * m))
        band = set(range(d * max(0, i - half), d * min(length, i + half + 1)))
        share[i, r] = len(window - band) / m
    return share.log()


@pytest.mark.parametrize("length,width,rows,half,T", [(20, 4, 8, 3, 24), (9, 2, 8, 0, 12), (30, 5, 6, 40, 30)])
def test_rows_outside_band_counts_the_positions_the_band_leaves(length, width, rows, half, T):
    """Windows of n/k positions (past the sentence too), a band wider than the input, half = 0."""
    got = rows_outside_band(torch.tensor([length]), torch.tensor([float(width)]), rows, half, T)
    expected = counted_share(length, Fraction(width), rows, half, T)
    assert got.shape == (1, 1, T, rows)
    torch.testing.assert_close(got[0, 0].exp(), expected.exp(), atol=1e-12, rtol=0)
    assert torch.equal(got[0, 0].isinf(), expected.isinf()), "a row the band covers must drop out"


def test_rows_outside_band_takes_out_exactly_the_band_from_stretched_rows():
    """Under resample the rows split a sentence's L tokens in windows of L/k (fractional): over
    the rows, what the recount takes out of the counts is the band's size, no more, no less."""
    lengths, k, half, T = torch.tensor([37, 23, 5]), 8, 4, 37
    width = lengths.double() / k
    share = rows_outside_band(lengths, width, k, half, T)[:, 0]  # B x T x R
    taken = ((1 - share.exp()) * width.view(-1, 1, 1)).sum(-1)  # B x T
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


def module_reference(attn, x, pad_mask):
    """The module's output from its own projected rows, recomputed densely in float64."""
    T, B, C = x.shape
    H, D = attn.num_heads, attn.head_dim
    k_rows, v_rows, kept = attn.project_keys_values(x, pad_mask)

    def heads(t):
        return t.view(t.size(0), B, H, D).permute(1, 2, 0, 3)

    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(x)), heads(attn.v_proj(x))
    lengths = (~pad_mask).sum(1).double()
    proj = attn.compress_k
    if proj.kind == "linear" and proj.length_power < 0:  # resample / exact stretch E over each sentence
        count = (lengths / proj.k).clamp(min=1).log().view(B, 1, 1, 1)
    else:
        count = torch.full((B, 1, 1, 1), math.log(proj.max_positions / proj.k), dtype=torch.float64)
    offset = count + attn.local_far_bias.view(1, H, 1, 1)
    key_real = ~pad_mask
    half, exact = attn.local_window // 2, torch.zeros(B, dtype=torch.bool)
    if proj.kind == "linear" and proj.length_power == -2.0:  # exact: short sentences' rows are their tokens
        exact = lengths <= proj.k
        key_real = key_real & ~exact.view(B, 1)
    share = None
    if attn.local_count_once:  # the rows as windows of n/k positions, or L/k under resample / exact
        stretched = proj.kind == "linear" and proj.length_power < 0
        share = torch.zeros(B, 1, T, k_rows.size(0), dtype=torch.float64)
        for b, length in enumerate(lengths.long().tolist()):
            width = Fraction(length, proj.k) if stretched else Fraction(proj.max_positions, proj.k)
            if not exact[b]:
                share[b, 0] = counted_share(length, width, k_rows.size(0), half, T)
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


def test_module_gradients_match_the_dense_reference():
    """Gradients of the input and every parameter through the module, with padding."""
    n, k, T, W = 64, 8, 61, 16
    torch.manual_seed(0)
    attn = LinformerMultiheadAttention(16, 4, LinformerSettings(n, (k,), "headwise", local_window=W), k)
    attn = attn.double()
    pad_mask = torch.arange(T).view(1, T) >= torch.tensor([61, 40, 9]).view(-1, 1)
    x = torch.randn(T, 3, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randn(T, 3, 16, dtype=torch.float64) * ~pad_mask.t().unsqueeze(-1)
    params = [x, *attn.parameters()]
    grads = torch.autograd.grad((attn(x, key_padding_mask=pad_mask)[0] * target).sum(), params, allow_unused=True)
    expected = torch.autograd.grad((module_reference(attn, x, pad_mask) * target).sum(), params, allow_unused=True)
    for (name, _), g, e in zip([("x", x), *attn.named_parameters()], grads, expected):
        assert (g is None) == (e is None), name
        if g is not None:
            torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-8, msg=lambda m: f"{name}: {m}")


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
