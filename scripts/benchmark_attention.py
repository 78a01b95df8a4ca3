#!/usr/bin/env python
"""Time (and on a GPU, peak memory) of one self-attention layer: PyTorch's fused full attention
(scaled_dot_product_attention, as fairseq's RoBERTa runs it) against the plugin's Linformer
attention at each k and local window W (--local-windows; with --local-count-once, each band also
counted once) and band kernel (--local-kernels), side by side in one process. --check-gradients
instead compares each band kernel's output and gradients with float64.

Needs only torch: linformer_fairseq.modules.linformer_attention imports without fairseq, so it
runs where fairseq is not installed (a GPU node with a bare PyTorch; the repository root on
PYTHONPATH where the plugin is not pip-installed). The whole model against fairseq's RoBERTa is
scripts/benchmark.py. Prints a table of milliseconds per step, peak MiB and the ratio to full
attention (above 1: faster than full attention), in training on a GPU of linformer_tools/mfu.py's
table also the model FLOPs utilization (the layer's matmul FLOPs, 3x its forward's, over the dense
bf16/fp16 peak), and writes it to --out as JSON. docs/benchmarks.md gives the figures.
"""

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from linformer_fairseq.modules import linformer_attention as attention
    from linformer_fairseq.modules import linformer_band as band
except ModuleNotFoundError as error:  # a bare PyTorch node where the repository is not installed
    if error.name != "linformer_fairseq":
        raise
    sys.exit("error: linformer_fairseq does not import: run from the repository root with PYTHONPATH=.")
from linformer_tools import mfu  # scripts/, this script's folder, is on sys.path

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class FullAttention(torch.nn.Module):
    """fairseq's RoBERTa attention as PyTorch's fused kernel runs it: four maps and one SDPA call."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        T, B, C = x.shape

        def split(t):
            return t.view(T, B, self.heads, C // self.heads).permute(1, 2, 0, 3)

        out = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))
        return self.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, C)), None


def models(args, n):
    """(name, maker) of each layer at length n; the makers are partials, whose arguments layer_flops reads."""
    yield "full", functools.partial(FullAttention, args.embed_dim, args.heads)
    for k in (k for k in args.ks if k < n):
        for window in args.local_windows:
            for once in (False, True) if window and args.local_count_once else (False,):
                for kernel in args.local_kernels if window else ("auto",):
                    settings = attention.LinformerSettings(
                        max_positions=n, compressed_dims=(k,), length_norm=args.length_norm, local_window=window,
                        local_count_once=once, local_kernel=kernel,
                    )  # fmt: skip
                    name = f"linformer-k{k}" + (f"-w{window}" if window else "") + ("-once" if once else "")
                    name += f"-{kernel}" if window and len(args.local_kernels) > 1 else ""
                    make = functools.partial(attention.LinformerMultiheadAttention, args.embed_dim, args.heads)
                    yield name, functools.partial(make, settings, k)


def layer_flops(make, n):
    """The matmul FLOPs of a training step (forward and backward) of one sequence through the layer ``make``
    builds: mfu.matmul_flops of one layer without FFN or head, full attention's or the Linformer's at its k,
    sharing, projection and band."""
    if make.func is FullAttention:
        return mfu.matmul_flops(n, make.args[0], 0, 1)
    d, _, settings, k = make.args  # a partial of a partial: functools flattens the arguments
    return mfu.matmul_flops(n, d, 0, 1, k, settings.sharing, settings.kind, settings.local_window)


def check_gradients(args):
    """Each band kernel against the blockwise band in float64 at one padded batch (n = the first
    length, k = the first k, W = each band, the recount on, computed from each sentence's length as
    in a model under ``resample``): the largest error of the output and of
    each gradient over the largest reference value, beside the float64 result rounded to the dtype."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    n, B, k, H, D = args.lengths[0], args.batch_sizes[0], args.ks[0], args.heads, args.embed_dim // args.heads
    g = torch.Generator(device=device).manual_seed(0)
    q, key, value = (torch.randn(B, H, n, D, generator=g, device=device, dtype=torch.float64) for _ in range(3))
    k_rows, v_rows = (torch.randn(B, H, k, D, generator=g, device=device, dtype=torch.float64) for _ in range(2))
    key_real = torch.ones(B, n, dtype=torch.bool, device=device)
    key_real[-1, n - n // 5 :] = False  # the last sentence padded
    rows_real = torch.ones(B, k, dtype=torch.bool, device=device)
    rows_real[-1, -k // 7 :] = False
    offset = torch.randn(B, H, 1, 1, generator=g, device=device, dtype=torch.float64)
    lengths = key_real.sum(1).double()
    share = band.CountOnce(lengths, lengths / k, None)  # k rows stretched over each sentence
    weight = torch.randn(B, H, n, D, generator=g, device=device, dtype=torch.float64) * key_real.view(B, 1, n, 1)

    def run(kernel, window, as_dtype):
        leaves = [t.detach().to(as_dtype).clone().requires_grad_(True) for t in (q, key, value, k_rows, v_rows, offset)]
        a, b, c, d, e, f = leaves
        wide = torch.promote_types(as_dtype, torch.float32)  # what a model hands its kernel
        count = band.CountOnce(share.lengths.to(wide), share.width.to(wide), None)
        out = kernel(a, b, c, key_real, window // 2, d, e, rows_real, f, 0.0, count)
        (out.double() * weight).sum().backward()
        return [out.detach().double() * key_real.view(B, 1, n, 1)] + [t.grad.double() for t in leaves]

    names = "output q k v k_rows v_rows offset".split()
    print(f"| W | kernel | {' | '.join(names)} |\n| ---: | --- |" + " ---: |" * len(names))
    for window in (w for w in args.local_windows if w):
        reference = run(band.attend_local_and_projected, window, torch.float64)
        rounded = [(r.to(dtype).double() - r).abs().max() / r.abs().max() for r in reference]
        print(f"| {window} | float64 rounded to {args.dtype} | " + " | ".join(f"{e:.1e}" for e in rounded) + " |")
        for kernel in args.local_kernels:
            try:
                function = band.attend_local_and_projected
                if kernel == "flex":
                    from linformer_fairseq.modules.linformer_band_flex import (
                        attend_local_and_projected_flex as function,
                    )

                errors = [(a - r).abs().max() / r.abs().max() for a, r in zip(run(function, window, dtype), reference)]
                print(f"| {window} | {kernel} | " + " | ".join(f"{e:.1e}" for e in errors) + " |", flush=True)
            except Exception as error:  # one kernel failing must not hide the others' figures
                print(f"| {window} | {kernel} | failed: {type(error).__name__}: {str(error)[:300]} |", flush=True)


def timed(layer, x, training: bool, repeats: int, device: str):
    """(median milliseconds of a step, peak MiB above the inputs, or None on a CPU)."""

    def step():
        if training:
            layer(x)[0].float().sum().backward()
        else:
            with torch.inference_mode():
                layer(x)

    cuda = device == "cuda"
    for _ in range(2):  # warm-up: kernels chosen, allocator grown
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            step()
            times.append(1000 * (time.perf_counter() - started))
    times.sort()
    return times[len(times) // 2], (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None


def int_list(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int_list, default=[1024, 4096], help="sequence lengths n (default: 1024,4096)")
    p.add_argument("--batch-sizes", type=int_list, help="sequences a step, one per length (default: 1 each)")
    p.add_argument("--ks", type=int_list, default=[256], help="projected lengths k; only k < n runs (default: 256)")
    p.add_argument("--local-windows", type=int_list, default=[0, 64, 128], help="bands W (default: 0,64,128)")
    p.add_argument("--local-count-once", action="store_true", help="each band also counted once (-once), beside it")
    p.add_argument(
        "--local-kernels",
        default="auto",
        help="band kernels, comma-separated: auto, blockwise, flex "
        "(default: auto); with several, each band runs with each (-blockwise, -flex)",
    )
    p.add_argument(
        "--check-gradients",
        action="store_true",
        help="compare each band kernel's output and gradients with float64 instead of timing",
    )
    p.add_argument("--length-norm", default="resample", choices=tuple(attention.LENGTH_NORM_POWERS),
                   help="the projection's --compress-length-norm (default: resample)")  # fmt: skip
    p.add_argument("--embed-dim", type=int, default=768, help="default: 768")
    p.add_argument("--heads", type=int, default=12, help="default: 12")
    p.add_argument("--mode", choices=("inference", "training"), default="inference", help="training: + backward")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="default: fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0: torch's choice")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per point, the median reported (default: 10)")
    p.add_argument("--out", type=Path, help="also write the rows as JSON here")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.batch_sizes = args.batch_sizes or [1] * len(args.lengths)
    args.local_kernels = args.local_kernels.split(",")
    if bad := [k for k in args.local_kernels if k not in band.BAND_KERNELS]:
        p.error(f"--local-kernels: unknown {bad}; expected some of {band.BAND_KERNELS}")
    if len(args.batch_sizes) != len(args.lengths):
        p.error(f"--batch-sizes has {len(args.batch_sizes)} values for {len(args.lengths)} lengths")
    if min(args.lengths + args.batch_sizes + [args.repeats]) < 1:
        p.error("--lengths, --batch-sizes and --repeats must be >= 1")
    if bad := [w for w in args.local_windows if w % 2]:
        p.error(f"--local-windows: a band is W/2 neighbours on each side, so W must be even, got {bad}")
    if args.embed_dim % args.heads:
        p.error(f"--embed-dim {args.embed_dim} is not divisible by --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, training = DTYPES[args.dtype], args.mode == "training"
    if args.check_gradients:
        return check_gradients(args)
    device = torch.device(args.device)
    rows = []
    why, peak = mfu.cuda_peak(args.device, args.dtype) if training else (None, None)
    mfu_column = (" MFU |", " ---: |") if training else ("", "")
    print(f"| n | batch | model | ms a step | peak MiB | vs full |{mfu_column[0]}")
    print(f"| ---: | ---: | --- | ---: | ---: | ---: |{mfu_column[1]}")
    for n, batch in zip(args.lengths, args.batch_sizes):
        torch.manual_seed(0)
        x = torch.randn(n, batch, args.embed_dim, device=device, dtype=dtype, requires_grad=training)
        full_ms = None
        for name, make in models(args, n):
            layer = make().to(device, dtype).train(training)
            layer.dropout = 0.0  # the same work in every step
            ms, mib = timed(layer, x, training, args.repeats, args.device)
            full_ms = full_ms or ms
            row = dict(n=n, batch=batch, model=name, ms=round(ms, 3), peak_mib=mib and round(mib), vs_full=full_ms / ms)
            shown = "-" if mib is None else f"{mib:,.0f}"
            line = f"| {n:,} | {batch} | {name} | {ms:.3f} | {shown} | {full_ms / ms:.2f}x |"
            if training:
                flops = batch * layer_flops(make, n)
                row |= {"flops": flops, "mfu": mfu.utilization(flops, ms / 1000, peak)}
                line += f" {mfu.percent(row['mfu'])} |"
            rows.append(row)
            print(line, flush=True)
            del layer
    if training:
        print(f"MFU: {why}" if peak is None else f"MFU against the {why}", flush=True)
    if args.out:
        setting = {key: value for key, value in vars(args).items() if key != "out"}
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        report = {"command": " ".join(sys.argv), "device": device_name, "torch": torch.__version__, **setting}
        args.out.write_text(json.dumps({**report, "rows": rows}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
