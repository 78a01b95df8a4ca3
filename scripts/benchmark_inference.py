#!/usr/bin/env python
"""Inference time and memory of Linformer against fairseq RoBERTa (paper Table 3 and
Figure 2, top right), on CPU or GPU, one fresh subprocess per measured point."""
import argparse
import csv
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    FIRST_WORD_ID,
    build_model,
    fail,
    force_explicit_attention,
    import_fairseq,
    pyplot,
    save_figure,
    write_dict,
    write_text,
)

VOCAB_SIZE = 50265  # RoBERTa's GPT-2 BPE vocabulary
GIB = 1024**3
MIB = 1024**2
BASELINES = {
    "fused": "fairseq RoBERTa as installed: its MultiheadAttention calls F.multi_head_attention_forward, "
    "which runs PyTorch's fused scaled_dot_product_attention and never stores the n x n matrix",
    "explicit": "the same RoBERTa forced onto fairseq's own bmm + softmax path "
    "(MultiheadAttention._set_skip_embed_dim_check()), which stores the n x n matrix per head: "
    "the 2020 baseline of the paper",
}
# Paper Table 3: Linformer (layerwise sharing) over the Transformer on a 16 GB V100, (n, k) -> ratio
PAPER_TIME = {
    (512, 128): 1.5, (512, 256): 1.3,
    (1024, 128): 1.7, (1024, 256): 1.6, (1024, 512): 1.3,
    (2048, 128): 2.6, (2048, 256): 2.4, (2048, 512): 2.1, (2048, 1024): 1.3,
    (4096, 128): 3.4, (4096, 256): 3.2, (4096, 512): 2.8, (4096, 1024): 2.2, (4096, 2048): 1.3,
    (8192, 128): 5.5, (8192, 256): 5.0, (8192, 512): 4.4, (8192, 1024): 3.5, (8192, 2048): 2.1,
    (16384, 128): 8.6, (16384, 256): 7.8, (16384, 512): 7.0, (16384, 1024): 5.6, (16384, 2048): 3.3,
    (32768, 128): 13, (32768, 256): 12, (32768, 512): 11, (32768, 1024): 8.8, (32768, 2048): 5.0,
    (65536, 128): 20, (65536, 256): 18, (65536, 512): 16, (65536, 1024): 14, (65536, 2048): 7.9,
}  # fmt: skip
PAPER_MEMORY = {
    (512, 128): 1.7, (512, 256): 1.5,
    (1024, 128): 3.0, (1024, 256): 2.9, (1024, 512): 1.8,
    (2048, 128): 6.1, (2048, 256): 5.6, (2048, 512): 3.6, (2048, 1024): 2.0,
    (4096, 128): 14, (4096, 256): 13, (4096, 512): 8.3, (4096, 1024): 4.3, (4096, 2048): 2.3,
    (8192, 128): 28, (8192, 256): 26, (8192, 512): 17, (8192, 1024): 8.5, (8192, 2048): 4.5,
    (16384, 128): 56, (16384, 256): 48, (16384, 512): 32, (16384, 1024): 16, (16384, 2048): 8,
    (32768, 128): 56, (32768, 256): 48, (32768, 512): 36, (32768, 1024): 18, (32768, 2048): 16,
    (65536, 128): 60, (65536, 256): 52, (65536, 512): 40, (65536, 1024): 20, (65536, 2048): 18,
}  # fmt: skip

DESCRIPTION = __doc__ + """
Models (random weights, eval mode, built through fairseq's own parser and masked_lm task):
  roberta-fused      """ + BASELINES["fused"] + """
  roberta-explicit   """ + BASELINES["explicit"] + """
  linformer-k<K>[-chunk<C>]  linformer_roberta with --compressed-dim K (and --ffn-chunk-size C)
All share the widths given by --encoder-* and use --max-positions n. The timed forward is the
encoder (features_only=True): the masked-LM head's n x 50265 logits are the same for every model.

Method: each (model, n, k) point runs in a fresh subprocess: build, --warmup forwards, then the
median of --repeats timed forwards (torch.cuda.synchronize around each on GPU). Then one more
forward measures the peak forward memory: the most memory the allocator held during the forward
beyond what it held before (weights and input excluded).
  cuda: torch.cuda.max_memory_allocated() after reset_peak_memory_stats().
  cpu:  torch's CPU allocator keeps no peak counter, so that forward runs under
        torch.profiler with profile_memory=True, which records every allocation and free of the
        CPU allocator; the peak is the maximum of the running sum. Like the CUDA figure this
        counts tensor memory only: not oneDNN/MKL scratch buffers, nor allocator slack or
        fragmentation (RSS would add those and malloc's caching, which makes it history-dependent).
With --max-batch-budget-gb B, also the paper's way: the largest batch whose weights + peak
forward memory fit in B GiB (predicted from the peak at --batch-size and twice that, which grows
linearly with the batch, then verified by measuring it, and on CUDA by not running out of
memory), and the time per sequence at that batch.

FLOP-ideal ratio: matmul FLOPs (2 per multiply-add) of one layer on one sequence of n tokens,
d = embed dim, f = FFN dim, k = projected length:
  RoBERTa    8nd^2 (Q,K,V,out maps) + 4n^2d (QK^T, PV) + 4ndf (FFN)
  Linformer  4nd^2 (Q,out maps) + 4k'd^2 (K,V maps on k' projected rows; 4nd^2 with sharing none,
             which maps before projecting) + P * 2knd (linear E/F; 2nd for conv, 0 for mean/max)
             + 4nk'd (QK^T, PV over k') + 4ndf (FFN)
  where P is the number of distinct projections a layer applies: 2 for none/headwise (E and F),
  1 for kv/layerwise (E = F), and k' = k (ceil(n / (n // k)) for pooling).
The ideal ratio is RoBERTa / Linformer; it is independent of the layer count and the batch.

Outputs in --out-dir: benchmark.json (every point, its samples and the environment; rewritten
after each point, so an interrupted run keeps what finished; --resume skips those), benchmark.csv,
benchmark.md (the tables, also printed) and time_vs_length.png (log-log, one line per model).
Points whose estimated memory exceeds --memory-limit-gb are skipped, and so are longer lengths of
a model after one timed out or failed; the tables say so.
"""


def int_list(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def get_parser():
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int_list, default=[2**i for i in range(9, 17)],
                   help="sequence lengths n (default: 512,...,65536)")
    p.add_argument("--ks", type=int_list, default=[128, 256, 512, 1024, 2048],
                   help="projected lengths k; only k < n is run (default: 128,256,512,1024,2048)")
    p.add_argument("--ffn-chunk-size", type=int_list, default=[0],
                   help="Linformer FFN chunk sizes, one model per value; 0 = off (default: 0)")
    p.add_argument("--compress-sharing", default="layerwise", choices=["none", "headwise", "kv", "layerwise"],
                   help="Linformer projection sharing (default: layerwise, as in the paper's Table 3)")
    p.add_argument("--compress-type", default="linear", choices=["linear", "mean", "max", "conv"],
                   help="Linformer projection kind (default: linear)")
    p.add_argument("--baselines", default="fused,explicit",
                   help="which RoBERTa baselines to run, comma-separated from fused,explicit (default: both)")
    p.add_argument("--encoder-layers", type=int, default=12,
                   help="(default: 12) every layer costs the same, so fewer layers keep the ratios and save time")
    p.add_argument("--encoder-embed-dim", type=int, default=768)
    p.add_argument("--encoder-ffn-embed-dim", type=int, default=3072)
    p.add_argument("--encoder-attention-heads", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per forward (default: 1)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads per point (default: torch's choice)")
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards first (default: 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards; the median is reported (default: 5)")
    p.add_argument("--memory-limit-gb", type=float, default=0.0,
                   help="skip points whose estimated memory exceeds this (default: 80%% of the free RAM, "
                   "or 90%% of the GPU's memory)")
    p.add_argument("--max-batch-budget-gb", type=float, default=0.0,
                   help="also find the largest batch that fits this budget and time it (default: 0 = off)")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per point (default: 900)")
    p.add_argument("--out-dir", type=Path, default=Path("benchmark-results"), help="(default: benchmark-results)")
    p.add_argument("--resume", action="store_true", help="reuse the finished points of --out-dir/benchmark.json")
    p.add_argument("--calm", type=float, default=1.0,
                   help="measure only while other processes use at most this share of the CPU (column "
                   "'other CPU'): wait for it before each point (up to 30 min), measure a point again (twice "
                   "at most) when they used more meanwhile, and with --resume measure again the points above "
                   "it (default: 1, off). For a shared machine, e.g. 0.1")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one point, given as JSON
    return p


# ---------------------------------------------------------------- counting


def encoder_flops(n, d, f, layers, k=None, sharing="layerwise", kind="linear"):
    """Matmul FLOPs of the encoder layers on one sequence of n tokens (formula in --help);
    k=None is RoBERTa."""
    ffn = 4 * n * d * f
    if k is None:
        return layers * (8 * n * d * d + 4 * n * n * d + ffn)
    rows = k if kind == "linear" else -(-n // (n // k))
    kv_maps = 4 * (n if sharing == "none" else rows) * d * d
    projections = 2 if sharing in ("none", "headwise") else 1
    per_projection = {"linear": 2 * k * n * d, "conv": 2 * n * d}.get(kind, 0)
    return layers * (4 * n * d * d + kv_maps + projections * per_projection + 4 * n * rows * d + ffn)


def estimate_bytes(spec):
    """A generous estimate of a point's memory, to skip what cannot fit before trying it."""
    n, d, f, h, L = (spec[x] for x in ("n", "embed_dim", "ffn_dim", "heads", "layers"))
    elt = 2 if spec["dtype"] in ("fp16", "bf16") else 4
    weights = (VOCAB_SIZE + n + L * (4 * d + 2 * f)) * d * elt + (spec["k"] or 0) * n * L * 2 * elt
    per_sequence = n * (2 * f + 8 * d) * elt
    if spec["model"] == "roberta-explicit":
        per_sequence += 8 * h * n * n  # the scores and their float32 softmax
    elif spec["k"]:
        per_sequence += 8 * h * n * spec["k"]
    activations = spec["batch"] * per_sequence
    return weights + max(activations, spec["max_batch_budget_gb"] * GIB)


# ---------------------------------------------------------------- one point (worker)


def build_point_model(spec):
    flags = [
        "--encoder-layers", spec["layers"], "--encoder-embed-dim", spec["embed_dim"],
        "--encoder-ffn-embed-dim", spec["ffn_dim"], "--encoder-attention-heads", spec["heads"],
        "--max-positions", spec["n"], "--tokens-per-sample", spec["n"],
        "--dropout", 0, "--attention-dropout", 0,
    ]  # fmt: skip
    arch = "roberta_base"
    if spec["model"] == "linformer":
        arch = "linformer_roberta_base"
        flags += ["--compressed-dim", spec["k"], "--compress-sharing", spec["sharing"],
                  "--compress-type", spec["compress_type"], "--ffn-chunk-size", spec["ffn_chunk"]]  # fmt: skip
    with tempfile.TemporaryDirectory() as data_dir:
        write_dict(data_dir, [f"w{i}" for i in range(VOCAB_SIZE - FIRST_WORD_ID - 1)])  # masked_lm adds <mask>
        model, _ = build_model(arch, [str(x) for x in flags], data_dir)
    if spec["model"] == "roberta-explicit" and force_explicit_attention(model) != spec["layers"]:
        raise RuntimeError("could not switch every layer to the explicit attention path")
    return model


class Runner:
    """Forwards of one model on random tokens, timed and memory-measured."""

    def __init__(self, model, spec):
        self.model, self.n = model, spec["n"]
        self.device = torch.device(spec["device"])
        self.cuda = self.device.type == "cuda"

    def tokens(self, batch):
        # no padding symbol, so no padding mask: every position is attended
        return torch.randint(FIRST_WORD_ID, VOCAB_SIZE, (batch, self.n), device=self.device)

    def forward(self, tokens):
        self.model(tokens, features_only=True)
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, tokens, warmup, repeats):
        for _ in range(warmup):
            self.forward(tokens)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.forward(tokens)
            samples.append(time.perf_counter() - start)
        return samples

    def peak_bytes(self, tokens):
        """Peak allocator memory of one forward beyond what was held before it."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            self.forward(tokens)
            return torch.cuda.max_memory_allocated() - before
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            self.forward(tokens)
        events = sorted(
            (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
        )
        held = peak = 0
        for e in events:
            held += e.nbytes()
            peak = max(peak, held)
        return peak

    def fits(self, batch, budget):
        try:
            return self.weight_bytes() + self.peak_bytes(self.tokens(batch)) <= budget
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return False

    def weight_bytes(self):
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    def max_batch(self, batch, budget):
        """Largest batch whose weights + forward peak fit ``budget`` bytes: the peak grows
        linearly with the batch, so predict from two batches, then step down until it fits."""
        p1, p2 = self.peak_bytes(self.tokens(batch)), self.peak_bytes(self.tokens(2 * batch))
        slope = max((p2 - p1) / batch, 1.0)
        best = int((budget - self.weight_bytes() - (p1 - slope * batch)) // slope)
        while best > 0 and not self.fits(best, budget):
            best = min(best - 1, int(best * 0.9))
        return max(best, 0)


def run_worker(spec):
    import_fairseq()
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec["dtype"]]
    model = build_point_model(spec).eval().to(device=spec["device"], dtype=dtype)
    run = Runner(model, spec)
    result = {}
    with torch.inference_mode():
        tokens = run.tokens(spec["batch"])
        result["seconds"] = run.seconds(tokens, spec["warmup"], spec["repeats"])
        result["peak_bytes"] = run.peak_bytes(tokens)
        del tokens
        if spec["max_batch_budget_gb"]:
            best = run.max_batch(spec["batch"], spec["max_batch_budget_gb"] * GIB)
            result["max_batch"] = best
            if best:
                result["max_batch_seconds"] = run.seconds(run.tokens(best), spec["warmup"], spec["repeats"])
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the grid (parent)


def label(spec):
    if spec["model"] != "linformer":
        return spec["model"]
    return f"linformer-k{spec['k']}" + (f"-chunk{spec['ffn_chunk']}" if spec["ffn_chunk"] else "")


def make_grid(args):
    common = dict(
        layers=args.encoder_layers, embed_dim=args.encoder_embed_dim, ffn_dim=args.encoder_ffn_embed_dim,
        heads=args.encoder_attention_heads, batch=args.batch_size, dtype=args.dtype, device=args.device,
        threads=args.threads, warmup=args.warmup, repeats=args.repeats, max_batch_budget_gb=args.max_batch_budget_gb,
        sharing=args.compress_sharing, compress_type=args.compress_type,
    )  # fmt: skip
    baselines = args.baselines.split(",")
    specs = []
    for n in sorted(set(args.lengths)):
        for b in baselines:
            specs.append(dict(common, model=f"roberta-{b}", n=n, k=None, ffn_chunk=0))
        for k in sorted(set(args.ks)):
            if k < n:
                for c in args.ffn_chunk_size:
                    specs.append(dict(common, model="linformer", n=n, k=k, ffn_chunk=c))
    return specs


def check_args(args):
    if bad := set(args.baselines.split(",")) - set(BASELINES):
        fail(f"--baselines: unknown {sorted(bad)}; choose from {sorted(BASELINES)}")
    for name in ("lengths", "ks"):
        if 0 in getattr(args, name):
            fail(f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("encoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_attention_heads",
                 "batch_size", "repeats"):  # fmt: skip
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.encoder_embed_dim % args.encoder_attention_heads:
        fail(f"--encoder-embed-dim {args.encoder_embed_dim} is not divisible by "
             f"--encoder-attention-heads {args.encoder_attention_heads}")  # fmt: skip
    if args.compress_type != "linear":
        for n in args.lengths:
            if bad := [k for k in args.ks if k < n and n % k]:
                fail(f"--compress-type {args.compress_type} needs n divisible by k: n={n}, k={bad}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if not args.memory_limit_gb:
        args.memory_limit_gb = default_memory_limit_gb(args.device)
    if args.max_batch_budget_gb > args.memory_limit_gb:
        fail(f"--max-batch-budget-gb {args.max_batch_budget_gb} exceeds the memory limit "
             f"{args.memory_limit_gb:.1f} GiB (--memory-limit-gb)")


def default_memory_limit_gb(device):
    if device == "cuda":
        return 0.9 * torch.cuda.get_device_properties(0).total_memory / GIB
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return 0.8 * int(info["MemAvailable"].split()[0]) * 1024 / GIB


def spec_key(spec):
    return json.dumps(spec, sort_keys=True)


def others_cpu_share(seconds=2.0):
    """Share of the CPU that other processes use now (sampled while no point runs)."""
    (busy, ours), start = cpu_seconds(), time.time()
    time.sleep(seconds)
    (busy_end, ours_end), wall = cpu_seconds(), time.time() - start
    return max(0.0, (busy_end - busy) - (ours_end - ours)) / (wall * os.cpu_count())


def wait_until_calm(limit, max_wait=1800):
    start = time.time()
    while (share := others_cpu_share()) > limit and time.time() - start < max_wait:
        print(f"  waiting: other processes use {share:.0%} of the CPU (--calm {limit})", flush=True)
        time.sleep(30)


def measure_calmly(spec, args):
    """run_point, under the --calm rule (see --help)."""
    for _ in range(3):
        if args.calm < 1:
            wait_until_calm(args.calm)
        record = run_point(spec, args.timeout)
        if record["status"] != "ok" or record["other_cpu"] <= args.calm:
            break
        print(f"  other processes used {record['other_cpu']:.0%} of the CPU meanwhile; measuring again", flush=True)
    return record


def cpu_seconds():
    """(CPU seconds every process on the machine has been busy, CPU seconds of our finished
    children): their difference over a point is the CPU time other work took meanwhile."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), usage.ru_utime + usage.ru_stime


def run_point(spec, timeout):
    """Run one point in a fresh interpreter; returns its record (status ok/timeout/error).

    ``other_cpu`` is the share of the machine's CPU time that other processes used during the
    point: near 0 on a calm machine; timings taken at 0.2 or more shared the cores."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    start, (busy, ours) = time.time(), cpu_seconds()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "note": f"did not finish in {timeout:.0f} s"}
    wall, (busy_end, ours_end) = time.time() - start, cpu_seconds()
    other = max(0.0, (busy_end - busy) - (ours_end - ours)) / (wall * os.cpu_count())
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "error", "note": f"exit {proc.returncode}: {tail}", "wall_s": wall}
    return {"status": "ok", "wall_s": wall, "other_cpu": round(other, 3), **json.loads(lines[-1][len("RESULT "):])}


def environment(args, argv):
    # the fairseq version without importing fairseq (4 s): the parent never builds a model
    fairseq_dist = metadata.packages_distributions().get("fairseq", ["fairseq"])[0]
    if args.device == "cuda":
        hardware = torch.cuda.get_device_name(0)
    else:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        hardware = f"{names[0] if names else platform.processor()}, {os.cpu_count()} logical CPUs"
    return {
        "command": " ".join([Path(__file__).name, *argv]), "hardware": hardware,
        "torch": torch.__version__, "fairseq": metadata.version(fairseq_dist), "python": platform.python_version(),
        "threads": args.threads or torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "baselines": BASELINES,
    }  # fmt: skip


def run_grid(args, argv):
    specs = make_grid(args)
    out = args.out_dir / "benchmark.json"
    done = {}
    if args.resume and out.exists():
        done = {
            spec_key(p["spec"]): p
            for p in json.loads(out.read_text())["points"]
            if p["status"] == "ok" and p["other_cpu"] <= args.calm
        }
    report = {"environment": environment(args, argv), "points": []}
    given_up = {}  # label -> why its longer lengths are skipped
    for i, spec in enumerate(specs, 1):
        name, estimate = label(spec), estimate_bytes(spec)
        if spec_key(spec) in done:
            record = done[spec_key(spec)]
        elif name in given_up:
            record = {"spec": spec, "status": "skipped", "note": given_up[name]}
        elif estimate > args.memory_limit_gb * GIB:
            record = {"spec": spec, "status": "skipped",
                      "note": f"estimated {estimate / GIB:.1f} GiB > limit {args.memory_limit_gb:.1f} GiB"}  # fmt: skip
        else:
            record = {"spec": spec, **measure_calmly(spec, args)}
            if record["status"] != "ok":
                given_up[name] = f"{record['status']} at n={spec['n']}"
        report["points"].append(record)
        print(f"[{i}/{len(specs)}] {name} n={spec['n']}: {describe(record)}", flush=True)
        write_text(out, json.dumps(report, indent=1))
    return report


def describe(record):
    if record["status"] != "ok":
        return f"{record['status']} ({record['note']})"
    text = f"{ms_per_seq(record):.1f} ms/seq, peak {record['peak_bytes'] / MIB:.1f} MiB"
    if "max_batch" in record:
        text += f", max batch {record['max_batch']}"
    return text + f" ({record['wall_s']:.0f} s, other CPU {record['other_cpu']:.0%})"


# ---------------------------------------------------------------- reporting


def ms_per_seq(record, at_max_batch=False):
    if at_max_batch:
        if not record.get("max_batch"):
            return None
        return 1000 * statistics.median(record["max_batch_seconds"]) / record["max_batch"]
    return 1000 * statistics.median(record["seconds"]) / record["spec"]["batch"]


def summarize(report):
    """One row per Linformer point: its ratios against both baselines (None where either
    side is missing)."""
    ok = [p for p in report["points"] if p["status"] == "ok"]
    base = {(p["spec"]["model"], p["spec"]["n"]): p for p in ok if p["spec"]["model"] != "linformer"}
    rows = []
    for p in ok:
        s = p["spec"]
        if s["model"] != "linformer":
            continue
        n, k = s["n"], s["k"]
        dims = (n, s["embed_dim"], s["ffn_dim"], s["layers"])
        row = {
            "n": n, "k": k, "model": label(s),
            "flop_ideal": encoder_flops(*dims) / encoder_flops(*dims, k, s["sharing"], s["compress_type"]),
            "paper_time": PAPER_TIME.get((n, k)), "paper_memory": PAPER_MEMORY.get((n, k)),
        }  # fmt: skip
        for b in ("fused", "explicit"):
            ref = base.get((f"roberta-{b}", n))
            row[f"time_vs_{b}"] = ms_per_seq(ref) / ms_per_seq(p) if ref else None
            row[f"memory_vs_{b}"] = ref["peak_bytes"] / p["peak_bytes"] if ref else None
            both_fit = ref and ref.get("max_batch") and p.get("max_batch")
            row[f"max_batch_vs_{b}"] = p["max_batch"] / ref["max_batch"] if both_fit else None
            row[f"max_batch_time_vs_{b}"] = (
                ms_per_seq(ref, at_max_batch=True) / ms_per_seq(p, at_max_batch=True) if both_fit else None
            )
        rows.append(row)
    return sorted(rows, key=lambda r: (r["n"], r["k"], r["model"]))


def ratio(value):
    return "-" if value is None else f"{value:.2f}x"


def point_cells(p):
    """Cells of one row of the measured-points table."""
    if p["status"] != "ok":
        return ["-"] * 5 + [f"{p['status']}: {p['note']}"]
    low, high = (1000 * t / p["spec"]["batch"] for t in (min(p["seconds"]), max(p["seconds"])))
    at_max = ms_per_seq(p, at_max_batch=True)
    return [
        f"{ms_per_seq(p):.1f} ({low:.0f}-{high:.0f})", f"{p['peak_bytes'] / MIB:.1f}", str(p.get("max_batch", "-")),
        "-" if at_max is None else f"{at_max:.1f}", f"{p['other_cpu']:.0%}", "ok",
    ]  # fmt: skip


COLUMN_TITLES = {
    "time_vs_fused": "vs fused", "time_vs_explicit": "vs explicit", "max_batch_time_vs_fused": "max batch vs fused",
    "max_batch_time_vs_explicit": "max batch vs explicit", "flop_ideal": "FLOP-ideal", "paper_time": "paper",
    "memory_vs_fused": "peak vs fused", "memory_vs_explicit": "peak vs explicit",
    "max_batch_vs_fused": "max batch vs fused", "max_batch_vs_explicit": "max batch vs explicit",
    "paper_memory": "paper (max batch)",
}  # fmt: skip


def ratio_table(rows, title, columns):
    """A markdown table of the ratio ``columns`` of ``rows``, leaving out columns with no value."""
    columns = [c for c in columns if any(r[c] is not None for r in rows)]
    lines = [title + ":", "", "| n | k | model | " + " | ".join(COLUMN_TITLES[c] for c in columns) + " |",
             "| ---: | ---: | --- |" + " ---: |" * len(columns)]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['n']} | {r['k']} | {r['model']} | " + " | ".join(ratio(r[c]) for c in columns) + " |")
    return lines + [""]


def markdown(report):
    env, rows = report["environment"], summarize(report)
    spec0 = report["points"][0]["spec"]
    lines = [
        f"Command: `{env['command']}`",
        "",
        f"{env['hardware']}; torch {env['torch']}, fairseq {env['fairseq']}, {env['threads']} threads, "
        f"{env['date']}. 'other CPU': share of the CPU time other processes used during a point.",
        f"Widths: {spec0['layers']} layers, d={spec0['embed_dim']}, ffn={spec0['ffn_dim']}, "
        f"{spec0['heads']} heads; batch {spec0['batch']}, {spec0['dtype']}, {spec0['device']}; "
        f"Linformer sharing {spec0['sharing']}, projection {spec0['compress_type']}.",
        "",
        *(f"- `roberta-{b}`: {text}." for b, text in env["baselines"].items()),
        "",
        "Measured points (time: median of the timed forwards; peak: forward memory beyond weights and input):",
        "",
        "| model | n | k | ms/seq (min-max) | peak MiB | max batch | ms/seq at max batch | other CPU | status |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for p in report["points"]:
        s = p["spec"]
        lines.append(f"| {label(s)} | {s['n']} | {s['k'] or '-'} | " + " | ".join(point_cells(p)) + " |")
    lines += ["", "Linformer over RoBERTa, as in the paper's Table 3 (paper: V100, layerwise sharing).", ""]
    time_columns = ["time_vs_fused", "time_vs_explicit", "max_batch_time_vs_fused", "max_batch_time_vs_explicit",
                    "flop_ideal", "paper_time"]  # fmt: skip
    memory_columns = ["memory_vs_fused", "memory_vs_explicit", "max_batch_vs_fused", "max_batch_vs_explicit",
                      "paper_memory"]  # fmt: skip
    lines += ratio_table(rows, "Time saved: baseline time per sequence / Linformer's", time_columns)
    lines += ratio_table(rows, "Memory saved: baseline peak forward memory / Linformer's (max batch: Linformer's / "
                         "baseline's, the paper's measure)", memory_columns)  # fmt: skip
    return "\n".join(lines) + "\n"


def write_csv(report, path):
    fields = ["model", "n", "k", "ffn_chunk", "batch", "dtype", "device", "status", "note", "ms_per_seq",
              "peak_mib", "max_batch", "ms_per_seq_at_max_batch", "flops_per_seq"]  # fmt: skip
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    for p in report["points"]:
        s = p["spec"]
        dims = (s["n"], s["embed_dim"], s["ffn_dim"], s["layers"])
        k = s["k"] if s["model"] == "linformer" else None
        row = {
            "model": label(s), **{f: s[f] for f in ("n", "k", "ffn_chunk", "batch", "dtype", "device")},
            "status": p["status"], "note": p.get("note", ""),
            "flops_per_seq": encoder_flops(*dims, k, s["sharing"], s["compress_type"]),
        }  # fmt: skip
        if p["status"] == "ok":
            row.update(ms_per_seq=ms_per_seq(p), peak_mib=p["peak_bytes"] / MIB, max_batch=p.get("max_batch"),
                       ms_per_seq_at_max_batch=ms_per_seq(p, at_max_batch=True))  # fmt: skip
        writer.writerow(row)
    write_text(path, buf.getvalue())


def plot(report, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    lines = {}
    for p in report["points"]:
        if p["status"] == "ok":
            lines.setdefault(label(p["spec"]), []).append((p["spec"]["n"], ms_per_seq(p)))
    for name, points in lines.items():
        xs, ys = zip(*sorted(points))
        style = "-" if name.startswith("roberta") else "--" if "chunk" in name else "-."
        ax.plot(xs, ys, style, marker="o", markersize=3, label=name)
    spec0 = report["points"][0]["spec"]
    ax.set(yscale="log", xlabel="sequence length n", ylabel="time per sequence (ms)",
           title=f"Inference, {spec0['layers']} layers d={spec0['embed_dim']}, batch {spec0['batch']}, "
           f"{spec0['dtype']}, {spec0['device']}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    if lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = get_parser().parse_args(argv)
    if args.worker:
        return run_worker(json.loads(args.worker))
    check_args(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = run_grid(args, argv)
    table = markdown(report)
    write_text(args.out_dir / "benchmark.md", table)
    write_csv(report, args.out_dir / "benchmark.csv")
    plot(report, args.out_dir / "time_vs_length.png")
    print("\n" + table + f"\nWrote {args.out_dir}/benchmark.{{json,csv,md}} and time_vs_length.png")


if __name__ == "__main__":
    main()
