"""--local-kernel flex: the band and the rows in one compiled flex_attention call. On a CPU torch
compiles its forward only, so the forward is checked here against the blockwise kernel and the dense
float64 reference, with padding, the recount and exact sentences; how many kernels a run's shapes
compile, and what happens past the limit; the BlockMask built from block indices; and the offset's
gradient, which the flex path computes outside the kernel from flex's own log-sum-exp. Gradients
through the kernel itself are checked on a GPU (scripts/gpu_check.sh gradients)."""

import logging
import math

import pytest
import torch
import torch._dynamo.utils
from test_local_window import band_inputs, dense_band_and_rows, random_share

from linformer_fairseq.modules import LinformerMultiheadAttention, LinformerSettings
from linformer_fairseq.modules import linformer_band as band
from linformer_fairseq.modules import linformer_band_flex as flex

pytestmark = pytest.mark.skipif(not band.flex_available(), reason="this torch has no flex_attention")


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch):
    """Each test starts with no kernel compiled, in flex's count and in dynamo's."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(flex, "_kernels", set())
    monkeypatch.setattr(flex, "_warned", False)
    yield
    torch._dynamo.reset()


@pytest.fixture
def eager_flex(monkeypatch):
    """flex compiled by dynamo's eager backend: dynamo traces and counts graphs as it does for
    inductor, without compiling C++ for each, and runs flex's own reference, log-sum-exp included
    (inductor on a CPU returns none); the kernels' numerics are the other tests'."""
    monkeypatch.setattr(flex, "_compiled", torch.compile(flex._band_flex, backend="eager", dynamic=False))


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def as_float32(*tensors):
    return [t.float() if t is not None and t.is_floating_point() else t for t in tensors]


@pytest.mark.parametrize("T,half,R", [(200, 8, 20), (250, 60, 33)])
def test_flex_matches_the_dense_reference(T, half, R):
    """Lengths that are no multiple of the 128-position tile, rows that are none either, a band
    wider than a tile, padding of keys and rows, and the recount, in one softmax."""
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T, R, H=2, D=16)
    share = random_share(T, R)
    expected = dense_band_and_rows(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, share)
    args = as_float32(q, k, v, key_real) + [half] + as_float32(k_rows, v_rows, rows_real, offset) + [0.0, share.float()]
    got = flex.attend_local_and_projected_flex(*args)
    assert len(flex._kernels) == 1, "flex ran, not the blockwise kernel in its place"
    real = key_real.view(key_real.size(0), 1, T, 1)  # a pad query's output is never read
    torch.testing.assert_close((got.double() * real), expected * real, atol=2e-6, rtol=0)
    blockwise = band.attend_local_and_projected(*args)
    torch.testing.assert_close(got * real, blockwise * real, atol=2e-6, rtol=0)


def test_same_shape_batches_compile_once():
    """New padding, values, offsets and recounts, and a length in the same bucket: no recompilation."""
    for step, T in enumerate((300, 300, 290, 260)):  # all padded to 384
        q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T, 16, H=2, D=16, seed=step)
        key_real[0, T - 7 * step - 1 :] = False
        args = as_float32(q, k, v, key_real) + [8] + as_float32(k_rows, v_rows, rows_real, offset * step)
        flex.attend_local_and_projected_flex(*args, 0.0, random_share(T, 16, seed=step).float())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])


def test_flex_lengths_are_buckets():
    assert [flex.flex_length(T) for T in (1, 128, 129, 1000, 1024, 1025, 1280, 1281, 4096, 4097, 16384)] == [
        128, 128, 256, 1024, 1024, 1280, 1280, 1536, 4096, 5120, 16384
    ]  # fmt: skip


def test_the_offset_gradient_outside_the_kernel_is_the_blockwise_one():
    """d out / d offset through the carrier (given the rows' and band's log-sum-exp) equals the
    blockwise kernel's gradient, with padding and the recount."""
    T, half, R = 40, 3, 6
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T, R)
    share = random_share(T, R)
    weight = torch.randn(q.shape, dtype=torch.float64) * key_real.view(-1, 1, T, 1)
    offset.requires_grad_(True)
    out = band.attend_local_and_projected(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, 0.0, share)
    (expected,) = torch.autograd.grad((out * weight).sum(), offset)
    at = torch.arange(T)
    readable = ((at.view(T, 1) - at.view(1, T)).abs() <= half) & key_real.view(-1, 1, 1, T)
    band_scores = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~readable, -math.inf)
    rows = (q @ k_rows.transpose(-1, -2) / math.sqrt(q.size(-1)) + offset + share).masked_fill(
        ~rows_real.view(-1, 1, 1, R), -math.inf
    )
    lse = torch.cat([band_scores, rows], -1).logsumexp(-1).detach()
    carried = flex._offset_gradient_carrier(
        q, k_rows, v_rows, rows_real, offset, share, half, lse, out.detach(), chunk=16
    )
    assert carried.abs().max() == 0
    (got,) = torch.autograd.grad((carried * weight).sum(), offset)
    torch.testing.assert_close(got, expected, atol=1e-6 * expected.abs().max().item(), rtol=1e-5)  # float32 inside


def layer(kernel, count_once=True, length_norm="exact"):
    torch.manual_seed(0)
    settings = LinformerSettings(
        max_positions=256, compressed_dims=(32,), length_norm=length_norm, local_window=16,
        local_count_once=count_once, local_kernel=kernel,
    )  # fmt: skip
    module = LinformerMultiheadAttention(32, 2, settings, 32).eval()
    with torch.no_grad():
        module.local_far_bias.normal_()
    return module


def test_the_module_gives_the_same_output_with_either_kernel():
    """A padded batch with a sentence short enough to be read exactly (no band) beside long ones,
    the rows recounted: the flex layer's output is the blockwise layer's."""
    x = torch.randn(200, 3, 32)
    pads = torch.zeros(3, 200, dtype=torch.bool)
    pads[1, 150:] = True
    pads[2, 20:] = True  # 20 tokens <= k = 32: read exactly
    x = x.masked_fill(pads.t().unsqueeze(-1), 0.0)
    with torch.no_grad():
        fused, _ = layer("flex")(x, key_padding_mask=pads)
        blockwise, _ = layer("blockwise")(x, key_padding_mask=pads)
    assert len(flex._kernels) == 2, "flex ran (pieces of 2 and 1 sentences), not the blockwise kernel"
    real = (~pads).t().unsqueeze(-1)
    torch.testing.assert_close(fused * real, blockwise * real, atol=2e-6, rtol=0)


def test_kernel_choice_and_clear_errors():
    q = torch.randn(1, 1, 4, 8)
    assert band.band_kernel("auto", q, 0.0, needs_grad=False) == "blockwise"  # a CPU: no faster there
    assert band.band_kernel("flex", q, 0.0, needs_grad=False) == "flex"
    with pytest.raises(ValueError, match="no attention dropout"):
        band.band_kernel("flex", q, 0.1, needs_grad=False)
    with pytest.raises(ValueError, match="no backward on a CPU"):
        band.band_kernel("flex", q, 0.0, needs_grad=True)
    with pytest.raises(ValueError, match="float64"):
        band.band_kernel("flex", q.double(), 0.0, needs_grad=False)
    with pytest.raises(ValueError, match="local_kernel"):
        LinformerSettings(max_positions=8, compressed_dims=(4,), local_window=2, local_kernel="fused")
    module = layer("flex").train()
    with pytest.raises(ValueError, match="no backward on a CPU"):
        module(torch.randn(40, 1, 32))


def flex_call(B, T, R=16, half=8, share=None, seed=0):
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T, R, B=B, H=2, D=16, seed=seed)
    args = as_float32(q, k, v, key_real) + [half] + as_float32(k_rows, v_rows, rows_real, offset) + [0.0, share]
    return flex.attend_local_and_projected_flex(*args), band.attend_local_and_projected(*args), key_real


def test_batch_sizes_and_lengths_of_a_bucket_compile_at_most_four_kernels(eager_flex, caplog):
    """Batches of 2 to 8 sentences at three lengths of one bucket (as validation meets them, batched by
    tokens): pieces of 1, 2, 4 and 8 sentences, one kernel each, every one logged."""
    with caplog.at_level(logging.INFO, logger=flex.__name__):
        for B in range(2, 9):
            for T in (300, 290, 260):
                got, blockwise, key_real = flex_call(B, T, seed=B)
                real = key_real.view(B, 1, T, 1)
                torch.testing.assert_close(got * real, blockwise * real, atol=2e-6, rtol=0)
    compiled = [r for r in caplog.records if "compiling kernel" in r.getMessage()]
    assert graphs() == len(compiled) == 4, (graphs(), [r.getMessage() for r in compiled])
    assert flex.batch_pieces(13) == [8, 4, 1] and flex.batch_pieces(8) == [8]


def test_past_the_limit_a_new_shape_warns_once_and_runs_blockwise(eager_flex, monkeypatch, caplog):
    """Never dynamo's silent unfused fallback (a dense B x H x T x (T + R) score tensor): a shape past
    the limit runs the blockwise kernel, with the same result, and one warning for the run."""
    monkeypatch.setattr(flex, "FLEX_KERNELS", 1)
    with caplog.at_level(logging.INFO, logger=flex.__name__):
        flex_call(2, 300)
        for B, T in ((4, 300), (2, 700), (8, 300)):
            got, blockwise, _ = flex_call(B, T)
            assert torch.equal(got, blockwise)
    assert graphs() == 1
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "blockwise" in warned[0].getMessage()


def test_the_block_mask_from_block_indices_is_create_block_masks():
    """The band's BlockMask from block indices (O(T / 128)) has create_block_mask's blocks, the whole
    blocks (read without a mask) apart from the partial ones, for bands narrower and wider than a tile."""
    from torch.nn.attention.flex_attention import create_block_mask

    for T, R, half in ((384, 128, 8), (512, 256, 130), (256, 128, 0), (640, 128, 300), (128, 128, 127)):

        def band_or_row(b, h, q_at, kv_at, T=T, half=half):
            return (kv_at >= T) | ((q_at - kv_at).abs() <= half)

        expected = create_block_mask(band_or_row, None, None, T, T + R, device="cpu")
        got = flex.band_block_mask(T, R, half, "cpu")
        assert torch.equal(got.to_dense(), expected.to_dense()), (T, R, half)
        for ours, theirs in (
            (got.kv_num_blocks, expected.kv_num_blocks),
            (got.full_kv_num_blocks, expected.full_kv_num_blocks),
        ):
            assert torch.equal(ours, theirs), (T, R, half)
        n = T // flex.FLEX_BLOCK
        for i in range(n):  # the same blocks listed, in any order
            for kind in ("kv", "full_kv"):
                count = getattr(got, f"{kind}_num_blocks")[0, 0, i]
                listed = sorted(getattr(got, f"{kind}_indices")[0, 0, i, :count].tolist())
                count = getattr(expected, f"{kind}_num_blocks")[0, 0, i]
                assert listed == sorted(getattr(expected, f"{kind}_indices")[0, 0, i, :count].tolist())


@pytest.mark.parametrize("recount", ["tensor", "per sentence"])
def test_flex_lse_carries_the_offset_gradient(eager_flex, recount):
    """The offset's gradient from flex's own log-sum-exp (``return_aux``) equals the blockwise kernel's,
    with the share given as a tensor or computed in the score_mod from each sentence's length."""
    T, R, half, B = 140, 12, 5, 2
    q, k, v, key_real, k_rows, v_rows, rows_real, offset = as_float32(*band_inputs(T, R, B=B, H=2, D=16))
    lengths = key_real.sum(1).float()
    share = band.CountOnce(lengths, torch.tensor([3.0, 2.5]), torch.tensor([True, False]))
    if recount == "tensor":
        share = band.rows_outside_band(share, R, half, T)
    weight = torch.randn(q.shape) * key_real.view(B, 1, T, 1)
    gradients = []
    for kernel in (flex.attend_local_and_projected_flex, band.attend_local_and_projected):
        offset = offset.detach().requires_grad_(True)
        out = kernel(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, 0.0, share)
        gradients.append(torch.autograd.grad((out * weight).sum(), offset)[0])
    torch.testing.assert_close(*gradients, atol=1e-5 * gradients[1].abs().max().item(), rtol=1e-4)


def test_a_training_layer_runs_the_training_kernel_with_or_without_gradients(monkeypatch):
    """Activation checkpointing runs a layer without gradients, then recomputes it with them: a module
    in training asks for the kernel with a backward both times, so both passes run the same kernel;
    in eval (validation, inference) it asks for none."""
    asked = []
    choose = band.band_kernel
    monkeypatch.setattr(band, "band_kernel", lambda *args: asked.append(args[-1]) or choose(*args))
    module, x = layer("auto"), torch.randn(100, 2, 32)
    with torch.no_grad():
        module.train()(x)
        module.eval()(x)
    module.train()(x)
    assert asked == [True, False, True]
    with torch.no_grad(), pytest.raises(ValueError, match="no backward on a CPU"):
        layer("flex").train()(x)
