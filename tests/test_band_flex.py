"""--local-kernel flex: the band and the rows in one compiled flex_attention call. On a CPU torch
compiles its forward only, so the forward is checked here against the blockwise kernel and the dense
float64 reference, with padding, the recount and exact sentences; that same-shape batches compile
once; and the offset's gradient, which the flex path computes outside the kernel. Gradients through
the kernel itself are checked on a GPU (scripts/gpu_check.sh gradients)."""

import math

import pytest
import torch
import torch._dynamo.utils
from test_local_window import band_inputs, dense_band_and_rows, random_share

from linformer_fairseq.modules import LinformerMultiheadAttention, LinformerSettings
from linformer_fairseq.modules import linformer_attention as attention

pytestmark = pytest.mark.skipif(not attention.flex_available(), reason="this torch has no flex_attention")


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
    got = attention.attend_local_and_projected_flex(*args)
    real = key_real.view(key_real.size(0), 1, T, 1)  # a pad query's output is never read
    torch.testing.assert_close((got.double() * real), expected * real, atol=2e-6, rtol=0)
    blockwise = attention.attend_local_and_projected(*args)
    torch.testing.assert_close(got * real, blockwise * real, atol=2e-6, rtol=0)


def test_same_shape_batches_compile_once():
    """New padding, values, offsets and recounts, and a length in the same bucket: no recompilation."""
    torch._dynamo.utils.counters.clear()
    for step, T in enumerate((300, 300, 290, 260)):  # all padded to 384
        q, k, v, key_real, k_rows, v_rows, rows_real, offset = band_inputs(T, 16, H=2, D=16, seed=step)
        key_real[0, T - 7 * step - 1 :] = False
        args = as_float32(q, k, v, key_real) + [8] + as_float32(k_rows, v_rows, rows_real, offset * step)
        attention.attend_local_and_projected_flex(*args, 0.0, random_share(T, 16, seed=step).float())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, dict(torch._dynamo.utils.counters["stats"])


def test_flex_lengths_are_buckets():
    assert [attention.flex_length(T) for T in (1, 128, 129, 1000, 1024, 1025, 1280, 1281, 4096, 4097, 16384)] == [
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
    out = attention.attend_local_and_projected(q, k, v, key_real, half, k_rows, v_rows, rows_real, offset, 0.0, share)
    (expected,) = torch.autograd.grad((out * weight).sum(), offset)
    at = torch.arange(T)
    readable = ((at.view(T, 1) - at.view(1, T)).abs() <= half) & key_real.view(-1, 1, 1, T)
    band = (q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))).masked_fill(~readable, -math.inf)
    rows = (q @ k_rows.transpose(-1, -2) / math.sqrt(q.size(-1)) + offset + share).masked_fill(
        ~rows_real.view(-1, 1, 1, R), -math.inf
    )
    lse = torch.cat([band, rows], -1).logsumexp(-1).detach()
    carried = attention._offset_gradient_carrier(
        q, k_rows, v_rows, rows_real, offset, share, lse, out.detach(), chunk=16
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
        flex, _ = layer("flex")(x, key_padding_mask=pads)
        blockwise, _ = layer("blockwise")(x, key_padding_mask=pads)
    real = (~pads).t().unsqueeze(-1)
    torch.testing.assert_close(flex * real, blockwise * real, atol=2e-6, rtol=0)


def test_kernel_choice_and_clear_errors():
    q = torch.randn(1, 1, 4, 8)
    assert attention.band_kernel("auto", q, 0.0, needs_grad=False) == "blockwise"  # a CPU: no faster there
    assert attention.band_kernel("flex", q, 0.0, needs_grad=False) == "flex"
    with pytest.raises(ValueError, match="no attention dropout"):
        attention.band_kernel("flex", q, 0.1, needs_grad=False)
    with pytest.raises(ValueError, match="no backward on a CPU"):
        attention.band_kernel("flex", q, 0.0, needs_grad=True)
    with pytest.raises(ValueError, match="float64"):
        attention.band_kernel("flex", q.double(), 0.0, needs_grad=False)
    with pytest.raises(ValueError, match="local_kernel"):
        LinformerSettings(max_positions=8, compressed_dims=(4,), local_window=2, local_kernel="fused")
    module = layer("flex").train()
    with pytest.raises(ValueError, match="no backward on a CPU"):
        module(torch.randn(40, 1, 32))
