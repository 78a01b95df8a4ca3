"""Model FLOPs utilization of a training step: the model's matmul FLOPs per second over the GPU's dense
bf16/fp16 tensor peak. The FLOPs are counted from the model's shapes (``matmul_flops``), the peak read from a
table by the name torch gives the GPU (``dense_peak``): a GPU not in the table gets no MFU, never a guess.
Needs neither torch nor fairseq (scripts/benchmark_attention.py runs where fairseq is not installed)."""

import re

from .benchmark_report import MASKED_SHARE, encoder_flops

# torch.cuda.get_device_name() -> (name in the reports, dense bf16/fp16 tensor FLOP/s, no sparsity), from
# NVIDIA's data sheets. Names must match whole: "NVIDIA H100 PCIe", "NVIDIA H100 NVL" and "NVIDIA H200 NVL"
# have lower peaks and are not here, so they get no MFU.
DENSE_PEAKS = (
    (r"NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
    (r"NVIDIA H200", "H200", 989e12),
    (r"NVIDIA A100(-SXM4-40GB|-SXM4-80GB|-PCIE-40GB| 80GB PCIe)", "A100", 312e12),
)
HALF = ("fp16", "bf16")


def matmul_flops(n, d, f, layers, k=None, sharing="headwise", kind="linear", window=0, vocab=0, training=True,
                 masked_share=MASKED_SHARE):  # fmt: skip
    """Matmul FLOPs (2 per multiply-add) of one sequence of n tokens, d = embed dim, f = FFN dim (0: attention
    only), V = ``vocab`` (0: no output head), m = ``masked_share`` x n masked positions. Per layer:

      q and out maps 4nd^2; k and v maps 4nd^2 (RoBERTa; Linformer with sharing none, which maps before
        projecting) or 4kd^2 (Linformer: maps the k projected rows);
      attention (QK^T and PV): RoBERTa 4n^2 d; Linformer 4nkd against its k rows, plus E/F P x 2knd
        (P = 2 for none/headwise, 1 for kv/layerwise; 2nd a projection for conv, 0 for mean/max pooling);
      a band of W (``window``): + 4nWd, + 4nd^2 for every position's own keys and values (unless sharing none);
      FFN 4ndf;

    then once the masked-LM head on the masked positions: 2m(d^2 + dV). ``training``: 3x all that (a backward
    costs two forwards). ``k``: one k for every layer or one per layer; None: RoBERTa. The per-layer terms are
    benchmark_report.encoder_flops's, which tests/test_benchmark.py checks against torch's FlopCounterMode."""
    ks = tuple(k) if isinstance(k, (list, tuple)) else (k,) * layers
    if len(ks) != layers:
        raise ValueError(f"{len(ks)} values of k for {layers} layers")
    forward = sum(encoder_flops(n, d, f, 1, k_i, sharing, kind, window=window) for k_i in ks)
    if vocab:
        forward += 2 * masked_share * n * (d * d + d * vocab)
    return 3 * forward if training else forward


def dense_peak(device_name, dtype):
    """(which peak, its dense FLOP/s) for a bf16/fp16 run on a GPU of DENSE_PEAKS, else (why there is no
    MFU, None)."""
    if dtype not in HALF:
        return f"no MFU for {dtype}: the peaks are bf16/fp16's", None
    for pattern, label, peak in DENSE_PEAKS:
        if re.fullmatch(pattern, device_name or ""):
            return f"{label}'s dense bf16/fp16 peak, {peak / 1e12:g} TFLOP/s", peak
    return f"unknown GPU: no MFU ({device_name})", None


def cuda_peak(device, dtype):
    """dense_peak of the GPU torch runs on (``device`` 'cuda'), or why none ('cpu': no MFU on a CPU)."""
    if device != "cuda":
        return f"no MFU on {device}", None
    import torch

    return dense_peak(torch.cuda.get_device_name(), dtype)


def utilization(flops, seconds, peak):
    """The share of ``peak`` FLOP/s that ``flops`` done in ``seconds`` are; None without a peak or a time."""
    return flops / seconds / peak if peak and seconds else None


def percent(share):
    return "-" if share is None else f"{100 * share:.1f}%"
