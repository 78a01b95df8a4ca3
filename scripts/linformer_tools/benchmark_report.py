"""The reports of scripts/benchmark.py (docs/benchmarks.md, Outputs): a point's CSV row with its matmul FLOPs, the
measured table, the paper's Table 3 ratios of time and memory saved, and the time-vs-length plot."""

import statistics

from linformer_tools import models
from linformer_tools.common import markdown_table, write_csv, write_text

MIB = 1024**2
VOCAB_SIZE = 50265  # RoBERTa's GPT-2 BPE vocabulary
MASKED_SHARE = 0.15  # of the positions, which the masked-LM head maps (fairseq's masked_lm task)
BASELINES = ("fused", "explicit")
# Paper Table 3, Linformer (layerwise sharing) over the Transformer on a 16 GB V100, for k = 128, 256, ..., 2048 < n:
# time saved | memory saved (the largest batch that fits)
PAPER_KS = (128, 256, 512, 1024, 2048)
PAPER = {
    512: "1.5 1.3 | 1.7 1.5",
    1024: "1.7 1.6 1.3 | 3.0 2.9 1.8",
    2048: "2.6 2.4 2.1 1.3 | 6.1 5.6 3.6 2.0",
    4096: "3.4 3.2 2.8 2.2 1.3 | 14 13 8.3 4.3 2.3",
    8192: "5.5 5.0 4.4 3.5 2.1 | 28 26 17 8.5 4.5",
    16384: "8.6 7.8 7.0 5.6 3.3 | 56 48 32 16 8",
    32768: "13 12 11 8.8 5.0 | 56 48 36 18 16",
    65536: "20 18 16 14 7.9 | 60 52 40 20 18",
}


def encoder_flops(n, d, f, layers, k=None, sharing="layerwise", kind="linear", original=False, window=0):
    """Matmul FLOPs of the encoder layers on one sequence (docs/benchmarks.md: FLOP-ideal ratio); k=None: RoBERTa.
    original: fairseq's original example, which applies a projection that keys and values share twice. window: a
    local band of W keys a query, which also needs every position's own keys and values (under sharing none they
    are made anyway): 4 n W d for its scores and values, 4 n d^2 for those maps."""
    ffn = 4 * n * d * f
    if k is None:
        return layers * (8 * n * d * d + 4 * n * n * d + ffn)
    rows = k if kind == "linear" else -(-n // (n // k))
    kv_maps = 4 * (n if sharing == "none" else rows) * d * d
    projections = 2 if sharing in ("none", "headwise") or original else 1
    per_projection = {"linear": 2 * k * n * d, "conv": 2 * n * d}.get(kind, 0)
    band = 4 * n * window * d + (4 * n * d * d if window and sharing != "none" else 0)
    return layers * (4 * n * d * d + kv_maps + projections * per_projection + 4 * n * rows * d + band + ffn)


def step_flops(s, roberta=False, masked_share=MASKED_SHARE):
    """Matmul FLOPs per sequence of a point's timed step (its spec ``s``; roberta: RoBERTa's at its sizes): the
    encoder's in inference; in training 3x (a backward costs two forwards) the encoder's and the masked-LM head's,
    whose dense and vocabulary maps run on the masked share of the positions only."""
    dims = (s["n"], s["encoder_embed_dim"], s["encoder_ffn_embed_dim"], s["encoder_layers"])
    k = None if roberta else s["k"]
    window = 0 if roberta else s.get("local_window", 0)  # points measured before the band have none
    flops = encoder_flops(*dims, k, s["compress_sharing"], s["compress_type"], s["model"] == "original", window)
    if s["mode"] == "inference":
        return flops
    d = s["encoder_embed_dim"]
    return 3 * (flops + 2 * masked_share * s["n"] * (d * d + d * VOCAB_SIZE))


CSV_FIELDS = (
    "model n k ffn_chunk batch_size dtype device ms_per_seq ms_min ms_max words_per_s seqs_per_s peak_mib max_batch "
    "ms_per_seq_at_max_batch flops_per_seq flop_ideal status note"
).split()


def row(point):
    """A point as its CSV row, None where not measured; the markdown tables and the plot read these rows."""
    s, r = point["spec"], dict.fromkeys(CSV_FIELDS)
    flops = step_flops(s)
    r |= {f: s[f] for f in CSV_FIELDS if f in s} | {"model": s["label"], "status": point["status"]}
    r |= {"note": point.get("note"), "flops_per_seq": flops, "flop_ideal": step_flops(s, roberta=True) / flops}
    if point["status"] == "ok":
        ms = [1000 * t / s["batch_size"] for t in point["seconds"]]
        r |= {"ms_per_seq": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms)}
        r |= {"seqs_per_s": 1000 / r["ms_per_seq"], "words_per_s": 1000 * s["n"] / r["ms_per_seq"]}
        r |= {"peak_mib": point["peak_bytes"] / MIB, "max_batch": point.get("max_batch")}
    if r["max_batch"]:
        r["ms_per_seq_at_max_batch"] = 1000 * statistics.median(point["max_batch_seconds"]) / r["max_batch"]
    return r


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else None


def saved_tables(rows, mode):
    """Each measured Linformer against the baselines at its n (fairseq's original example: also at its k), as the
    paper's Table 3: time saved and memory saved, each also at the largest batch that fits (the paper's measure)."""
    ok = {(r["model"], r["n"]): r for r in rows if r["status"] == "ok"}
    times, memories = [], []
    for r in sorted((r for r in ok.values() if r["model"].startswith("linformer")), key=lambda r: (r["n"], r["k"])):
        base = {b: ok.get((f"roberta-{b}", r["n"]), {}) for b in BASELINES}
        base["original"] = ok.get((f"original-k{r['k']}", r["n"]), {})
        paper = [dict(zip(PAPER_KS, map(float, p.split()))).get(r["k"]) for p in PAPER.get(r["n"], "|").split("|")]
        paper = paper if mode == "inference" else [None, None]
        point = {"n": r["n"], "k": r["k"], "model": r["model"]}
        at_max = {b: base[b].get("ms_per_seq_at_max_batch") for b in BASELINES}
        times.append(
            point
            | {f"vs {b}": ratio(ref.get("ms_per_seq"), r["ms_per_seq"]) for b, ref in base.items()}
            | {f"max batch vs {b}": ratio(t, r["ms_per_seq_at_max_batch"]) for b, t in at_max.items()}
            | {"FLOP-ideal": ratio(r["flop_ideal"], 1), "paper": ratio(paper[0], 1)}
            | {"FLOP-ideal vs original": ratio(base["original"].get("flops_per_seq"), r["flops_per_seq"])}
        )
        memories.append(
            point
            | {f"peak vs {b}": ratio(ref.get("peak_mib"), r["peak_mib"]) for b, ref in base.items()}
            | {f"max batch vs {b}": ratio(r["max_batch"], base[b].get("max_batch")) for b in BASELINES}
            | {"paper (max batch)": ratio(paper[1], 1)}
        )
    return times, memories


def describe(s):
    return (
        f"{s['mode'].capitalize()}, {s['encoder_layers']} layers, d={s['encoder_embed_dim']}, "
        f"ffn={s['encoder_ffn_embed_dim']}, {s['encoder_attention_heads']} heads, batch {s['batch_size']}, "
        f"{s['dtype']}, {s['device']}" + (", activation checkpointing" if s["checkpoint_activations"] else "")
    )


def markdown(report, rows):
    env, s = report["environment"], report["points"][0]["spec"]
    times, memories = saved_tables(rows, s["mode"])
    return "\n".join(
        [
            f"Command: `{env['command']}`\n",
            f"{env['hardware']}; torch {env['torch']}, fairseq {env['fairseq']}, {env['threads']} threads, "
            f"{env['date']}. {describe(s)}; Linformer: {s['compress_sharing']} sharing, {s['compress_type']} "
            "projection.\n",
            f"Measured points (milliseconds per sequence: median, min and max of the samples; words and sequences per "
            f"second; peak memory of one {'forward' if s['mode'] == 'inference' else 'training step'}):\n",
            markdown_table(
                rows, leave_out=("ffn_chunk", "batch_size", "dtype", "device", "flops_per_seq", "flop_ideal")
            ),
            "Time saved: baseline time per sequence / Linformer's (paper: Table 3, V100, layerwise sharing):\n",
            markdown_table(times),
            "Memory saved: baseline peak / Linformer's (max batch: Linformer's / baseline's, the paper's measure):\n",
            markdown_table(memories),
        ]
    )


def write_reports(report, out_dir):
    """benchmark.{md,csv} and time_vs_length.png from benchmark.json's content; returns the markdown."""
    rows = [row(p) for p in report["points"]]
    text = markdown(report, rows)
    write_text(out_dir / "benchmark.md", text)
    write_csv(out_dir / "benchmark.csv", rows, CSV_FIELDS)
    plot(rows, report["points"][0]["spec"], out_dir / "time_vs_length.png")
    return text


def plot(rows, s, path):
    plt = models.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name in dict.fromkeys(r["model"] for r in rows if r["status"] == "ok"):
        points = sorted((r["n"], r["ms_per_seq"]) for r in rows if r["model"] == name and r["status"] == "ok")
        ax.plot(*zip(*points), "-" if name.startswith("roberta") else "--", marker="o", markersize=3, label=name)
    ax.set(yscale="log", xlabel="sequence length n", ylabel="time per sequence (ms)")
    ax.set_xscale("log", base=2)
    ax.set_title(describe(s), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    models.save_figure(fig, path)
    plt.close(fig)
