#!/usr/bin/env python3
"""What the Linformer's projection costs on a real pretrained encoder (all-MiniLM-L6-v2):
linearize it (scripts/linearize.py) under each setting and read the fidelity it reaches. Its
report fills docs/linearize.md.

    python studies/study_linearize.py --hf-dir work/minilm/hf --wikitext WIKITEXT2_DIR \\
        --sts glue_data/STS-B/dev.tsv --out OUT [--runs NAME ...] [--glue glue_data]

Runs (each a linearize.py folder under OUT/runs, resumable; --runs picks some, --help lists them):

  long text, n = 512 (WikiText-2 train blocks; held out: the first blocks of WikiText-2 valid):
    k = 128 (the reference: headwise, linear, avg init), 64, 256, 32; per-layer k read from the
    spectrum at a mean of 128 (in every layer, or in layers 1-5 with the last at 128); then a
    grid at k = 128 with a shorter distillation (--grid-steps, its own k = 128 reference among
    them): subsample init; mean pooling; convolution; kv and layerwise sharing; no key scale
    (--key-scale 1), also with the full distillation; an exact local band beside the projection
    (--local-window W): W = 32, 64, 128 at k = 128, and W = 64 at k = 64; at W = 128 the far
    field weighted by its log count alone (--far-offset count), another seed, and the band's
    tokens left out of the rows' counts (--local-count-once)
  short inputs, n = 128 (STS-B dev zero-shot, mean pooling, against the teacher at n = 128):
    k = 8, 16, 32 with each way of handling inputs shorter than n at k = 16 (slice: the first T
    columns of E; length norm linear; resample; mean pooling); remedies at k = 16 (direct: no
    attention transfer; short: three quarters of the distillation blocks cut short; noscale:
    window means for the keys)

With --glue, the original at n = 128 and the n = 128 Linformers are finetuned on SST-2 and CoLA
(fixed training subsets, --seeds seeds each) the same way, under OUT/finetune.

The spectrum of the teacher's attention (paper Figure 1) at n = 128, 256 and 512 comes from
scripts/attention_spectrum.py on WikiText-2 valid. OUT/report.md, OUT/results.json and the plots
are rewritten from whatever runs have finished (--report-only: just that).
"""

import argparse
import json
import sys
from pathlib import Path

from linformer_tools import fairseq_train
from linformer_tools.common import REPO, SCRIPTS_DIR, fail, markdown_table, write_text
from linformer_tools.models import pyplot, save_figure

from common import GLUE_TASKS, dev_scores, finetune_flags, glue_subset, log, mean_sd, sh

LONG, SHORT = 512, 128
# name: (n, linearize.py flags); GRID: the comparison grid's shorter distillation. The runs made
# before linearize.py's key scale became 1 (the grid found it) name the n/k scale (window).
RUNS = {
    "n512-k128": (LONG, ["--key-scale", "window", "--k", "128"]),
    "n512-k64": (LONG, ["--key-scale", "window", "--k", "64"]),
    "n512-k256": (LONG, ["--key-scale", "window", "--k", "256"]),
    "n512-k32": (LONG, ["--key-scale", "window", "--k", "32"]),
    "n512-spectrum-k": (LONG, ["--key-scale", "window", "--k", "128", "--layer-compressed-dims", "SPECTRUM"]),
    # the spectrum's k in layers 1-5 only: the last layer's weights look low-rank, its output is not
    # (made after the key scale became 1: against n512-k128-noscale)
    "n512-spectrum-k-last128": (LONG, ["--k", "128", "--layer-compressed-dims", "SPECTRUM-LAST"]),
    "n512-k128-grid": (LONG, ["--key-scale", "window", "--k", "128", "GRID"]),
    "n512-k128-subsample": (LONG, ["--key-scale", "window", "--k", "128", "--init", "subsample", "GRID"]),
    "n512-k128-mean": (LONG, ["--key-scale", "window", "--k", "128", "--compress-type", "mean", "GRID"]),
    "n512-k128-kv": (LONG, ["--key-scale", "window", "--k", "128", "--compress-sharing", "kv", "GRID"]),
    "n512-k128-layerwise": (LONG, ["--key-scale", "window", "--k", "128", "--compress-sharing", "layerwise", "GRID"]),
    "n512-k128-conv": (LONG, ["--key-scale", "window", "--k", "128", "--compress-type", "conv", "GRID"]),
    # window means for the keys too (no n/k key scale, as mean pooling and kv/layerwise sharing have)
    "n512-k128-noscale-grid": (LONG, ["--k", "128", "--key-scale", "1", "GRID"]),
    "n512-k128-noscale": (LONG, ["--k", "128", "--key-scale", "1"]),
    "n128-k16-resample": (SHORT, ["--key-scale", "window", "--k", "16", "--compress-length-norm", "resample"]),
    "n128-k16-slice": (SHORT, ["--key-scale", "window", "--k", "16", "--compress-length-norm", "none"]),
    "n128-k16-linear": (SHORT, ["--key-scale", "window", "--k", "16", "--compress-length-norm", "linear"]),
    "n128-k16-mean": (SHORT, ["--key-scale", "window", "--k", "16", "--compress-type", "mean"]),
    "n128-k8-resample": (SHORT, ["--key-scale", "window", "--k", "8", "--compress-length-norm", "resample"]),
    "n128-k32-resample": (SHORT, ["--key-scale", "window", "--k", "32", "--compress-length-norm", "resample"]),
    # remedies for short inputs: no transfer on full WikiText blocks; most distillation blocks cut short
    "n128-k16-direct": (SHORT, ["--key-scale", "window", "--k", "16", "--transfer-steps", "0"]),
    "n128-k16-short": (SHORT, ["--k", "16", "--key-scale", "1", "--short-fraction", "0.75"]),
    "n128-k16-noscale": (SHORT, ["--k", "16", "--key-scale", "1"]),
}
# E/F's lr scaled by the window (1e-3 x min(1, 4k/n)) against the 1e-3 the runs above were made
# with, linearize.py's default at n <= 512
RUNS["n128-k16-lrscaled"] = (SHORT, ["--k", "16", "--transfer-lr", "5e-4", "--projection-lr", "5e-4"])
# a sentence of at most k tokens read exactly (each token its own key and value), longer ones resampled
RUNS["n128-k16-exact"] = (SHORT, ["--k", "16", "--compress-length-norm", "exact"])
RUNS["n128-k8-exact"] = (SHORT, ["--k", "8", "--compress-length-norm", "exact"])
RUNS["n128-k32-exact"] = (SHORT, ["--k", "32", "--compress-length-norm", "exact"])
# three times the distillation: is the gap at k = 16 the projection or the steps spent on it?
RUNS["n128-k16-exact-s600"] = (SHORT, ["--k", "16", "--compress-length-norm", "exact", "--distill-steps", "600"])
# per-layer k from the spectrum at n = 128 (a mean of 16): under exact a layer reads exactly what fits its k
RUNS["n128-spectrum-k16-exact"] = (SHORT, ["--k", "16", "--compress-length-norm", "exact", "--layer-compressed-dims",
                                           "SPECTRUM"])  # fmt: skip
# the same mean with the last layer kept at 16 (the classifier reads it; at n = 512 held low it lost most)
RUNS["n128-spectrum-k16-last-exact"] = (SHORT, ["--k", "16", "--compress-length-norm", "exact",
                                                "--layer-compressed-dims", "SPECTRUM-LAST"])  # fmt: skip
# linearized again with another seed (data order, blocks cut short): how far apart two
# linearizations of one recipe finetune, against the gaps between recipes
RUNS["n128-k16-exact-seed2"] = (SHORT, [*RUNS["n128-k16-exact"][1], "--seed", "2"])
RUNS["n128-spectrum-k16-exact-seed2"] = (SHORT, [*RUNS["n128-spectrum-k16-exact"][1], "--seed", "2"])
# the first try, before a layer held at k = 8 left the others the rest (a mean of 16.5)
RUNS["n128-spectrum-k16.5-exact"] = (SHORT, ["--k", "16", "--compress-length-norm", "exact",
                                             "--layer-compressed-dims", "22,23,20,13,13,8"])  # fmt: skip
# the control of finetuning: mean pooling over windows of one position (k = n; empty windows are
# masked), untrained: the original's attention exactly, on inputs of any length, in the Linformer's code
RUNS["n128-full-attention"] = (SHORT, ["--k", "128", "--compress-type", "mean", "--transfer-steps", "0",
                                       "--distill-steps", "0"])  # fmt: skip
# an exact local band of W neighbours beside the projection (--local-window), against n512-k128-noscale (W = 0)
for k, window in ((128, 32), (128, 64), (128, 128), (64, 64)):
    RUNS[f"n512-k{k}-w{window}"] = (LONG, ["--k", str(k), "--key-scale", "1", "--local-window", str(window)])
# the far field's weight against the band: log(tokens a row stands for) alone, no learned offset; and
# the learned run again with another seed, for the spread a seed makes
RUNS["n512-k128-w128-count"] = (LONG, [*RUNS["n512-k128-w128"][1], "--far-offset", "count"])
RUNS["n512-k128-w128-seed2"] = (LONG, [*RUNS["n512-k128-w128"][1], "--seed", "2"])
# the band's tokens left out of the rows' counts (--local-count-once), which they otherwise count again
RUNS["n512-k128-w128-once"] = (LONG, [*RUNS["n512-k128-w128"][1], "--local-count-once"])
RUNS["n512-k128-w128-once-seed2"] = (LONG, [*RUNS["n512-k128-w128-once"][1], "--seed", "2"])
SPECTRUM_LENGTHS = (128, 256, 512)
SHORT_RUNS = [name for name, (n, _) in RUNS.items() if n == SHORT]
# where the finetuned gap comes from: a run finetuned from another of its stages, or with other
# finetuning flags (name: (run, its checkpoint, fairseq-train flags))
PROBES = {
    "n128-k16-noscale-converted": ("n128-k16-noscale", "converted.pt", []),
    "n128-k16-noscale-frozen": ("n128-k16-noscale", "checkpoint.pt", ["--freeze-compress", 1]),
}
TEACHER = "teacher-n128"  # the original at n = 128, finetuned beside the n = 128 Linformers


def spectrum(args, n):
    """attention_spectrum.py on the teacher at n (WikiText-2 valid in the teacher's tokens)."""
    out = args.out / "spectrum" / f"n{n}"
    if not (out / "spectrum.json").is_file():
        encoded = args.out / "spectrum" / "wiki.valid.wordpiece"
        if not encoded.is_file():
            sh([sys.executable, "-m", "dataprep.spm", "encode", "--model", args.out / "teacher" / "tokenizer.json",
                "--inputs", args.wikitext / "wiki.valid.tokens", "--outputs", encoded, "--workers", "1"])  # fmt: skip
        teacher = args.out / "teacher"
        sh([sys.executable, SCRIPTS_DIR / "attention_spectrum.py", "--checkpoint", teacher / "model.pt",
            "--text", encoded, "--data", teacher, "--seq-len", n, "--max-sentences", args.spectrum_sequences,
            "--index", n // 4, "--out-dir", out], out.with_suffix(".log"))  # fmt: skip
    return json.loads((out / "spectrum.json").read_text())


def spectrum_dims(result, mean_k, n, keep_last=False):
    """Per-layer k proportional to each layer's K(90%), in 8..n, at the mean ``mean_k``: a layer
    held at 8 or n leaves the others the rest (``keep_last``: the last layer keeps mean_k)."""
    need = [layer["index_of_mass"] for layer in result["layers"]]
    share, last = (need[:-1], [mean_k]) if keep_last else (need, [])
    held = {}  # layer: the bound it is held at
    while True:
        free = [i for i in range(len(share)) if i not in held]
        budget = mean_k * len(need) - sum(last) - sum(held.values())
        dims = {i: budget * share[i] / sum(share[j] for j in free) for i in free}
        # those above n first: what they give back may lift the others above 8
        out = {i: n for i, k in dims.items() if k > n} or {i: 8 for i, k in dims.items() if k < 8}
        if not out:
            break
        held.update(out)
    # largest remainders: rounding each layer alone can move the mean off mean_k
    whole = {i: int(k) for i, k in dims.items()}
    for i in sorted(dims, key=lambda i: whole[i] - dims[i])[: round(budget - sum(whole.values()))]:
        whole[i] += 1
    return ",".join(str({**whole, **held}[i]) for i in range(len(share))) + "".join(f",{k}" for k in last)


def run(args, name):
    n, flags = RUNS[name]
    folder = args.out / "runs" / name
    if "SPECTRUM" in flags or "SPECTRUM-LAST" in flags:
        dims = {"SPECTRUM": False, "SPECTRUM-LAST": True}
        mean_k = int(flags[flags.index("--k") + 1])
        flags = [spectrum_dims(spectrum(args, n), mean_k, n, dims[f]) if f in dims else f for f in flags]
    if "GRID" in flags:
        flags = [*(f for f in flags if f != "GRID"), "--distill-steps", args.grid_steps]
    text, valid = args.wikitext / "wiki.train.tokens", args.wikitext / "wiki.valid.tokens"
    # resample: the runs were made when it was linearize.py's default
    command = [sys.executable, SCRIPTS_DIR / "linearize.py", args.hf_dir, "--text", text, "--valid-text", valid,
               "--max-positions", n, "--out", folder, "--no-export", "--compress-length-norm", "resample"]  # fmt: skip
    if n == SHORT:
        command += ["--sts", args.sts, "--distill-steps", args.short_steps, "--batch-blocks", 16]
    else:
        command += ["--heads"]
    command += flags  # last, so that a run's own flags win
    # what makes the run (its paths aside): a finished run made otherwise is refused, not kept silently
    recipe = [str(c) for c in command[command.index("--no-export") :] if c != args.sts]
    recorded = folder.with_suffix(".recipe.json")
    if recorded.is_file() and json.loads(recorded.read_text()) != recipe:
        fail(f"{folder} was made with {' '.join(json.loads(recorded.read_text()))}, not {' '.join(recipe)} "
             "(another --short-steps or --grid-steps?): use another --out, or delete the run to remake it")  # fmt: skip
    if folder.with_suffix(".log").is_file():  # finished (a rerun would replace its log)
        return
    write_text(recorded, json.dumps(recipe) + "\n")
    log(f"{name}: linearize.py {' '.join(map(str, flags))}")
    sh(command, folder.with_suffix(".log"))


def glue_data(args):
    """Each --tasks task's training subset of --train-rows rows (all if fewer) and its dev set in
    the teacher's ids (OUT/glue/ROWSrows/TASK-bin); returns {task: (its data-bin, its rows)}."""
    bins, folder, teacher = {}, args.out / "glue" / f"{args.train_rows}rows", args.out / "teacher"
    for task in args.tasks:
        subsets = folder / "subsets"
        rows = glue_subset(args.glue, task, args.train_rows, subsets)
        if not (folder / f"{task}-bin").is_dir():
            sh([REPO / "data-prep" / "glue.sh", "--glue-dir", subsets, "--tasks", task, "--tokenizer",
                teacher / "tokenizer.json", "--srcdict", teacher / "dict.txt", "--destdir", folder])  # fmt: skip
        bins[task] = (folder / f"{task}-bin", rows)
    return bins


def finetune(args, name, bins):
    """NAME (an n = 128 run's Linformer, or the teacher it was made from) finetuned on each task,
    one log per seed under OUT/finetune/NAME."""
    import torch

    import linformer_fairseq  # noqa: F401  (allow-lists the checkpoint's types)
    from linformer_tools.checkpoints import fairseq_train_model_flags, model_namespace

    probe_flags = []
    if name == TEACHER:  # every n = 128 run holds the same one
        made = [path for run in SHORT_RUNS if (path := args.out / "runs" / run / f"{TEACHER}.pt").is_file()]
        checkpoint = made[0] if made else args.out / "runs" / SHORT_RUNS[0] / f"{TEACHER}.pt"
    else:
        run, stage, probe_flags = PROBES.get(name, (name, "checkpoint.pt", []))
        checkpoint = args.out / "runs" / run / stage
    if not checkpoint.is_file():
        fail(f"{checkpoint}: missing (finetuning needs the run {checkpoint.parent.name} made first)")
    model_flags = fairseq_train_model_flags(model_namespace(torch.load(checkpoint, weights_only=True)))
    out = args.out / "finetune" / name
    out.mkdir(parents=True, exist_ok=True)
    for task in args.tasks:
        for seed in range(1, args.seeds + 1):
            if not (out / f"{task}-seed{seed}.log").exists():
                log(f"{name}: {task} finetuning, seed {seed}")
                data, rows = bins[task]
                sh([sys.executable, "-m", "fairseq_cli.train", data, *model_flags,
                    *fairseq_train.shared_flags(cpu=True), "--clip-norm", "1.0", "--finetune-from-model", checkpoint,
                    *finetune_flags(task, rows, args.finetune_epochs, args.finetune_lr, seed), *probe_flags],
                   out / f"{task}-seed{seed}.log")  # fmt: skip


def finetune_table(args):
    """Each finetuned model's dev scores (mean ± sd over seeds) and its difference to the
    teacher's: (table rows, {model: {task: scores}})."""
    import statistics

    folder = args.out / "finetune"
    names = [name for name in (TEACHER, *SHORT_RUNS, *PROBES) if (folder / name).is_dir()]
    scores = {name: {task: dev_scores(folder / name, task) for task in GLUE_TASKS} for name in names}
    lines = []
    for name in names:
        row = {"model": name}
        for task, (metric, _, _) in GLUE_TASKS.items():
            mine, base = scores[name][task], scores.get(TEACHER, {}).get(task)
            row[f"{task} {metric}"] = mean_sd(mine)
            gap = statistics.mean(mine) - statistics.mean(base) if mine and base and name != TEACHER else None
            row[f"{task} vs teacher"] = "-" if gap is None else f"{gap:+.1f}"
        lines.append(row)
    return lines, scores


def results(args):
    rows = {}
    for name in RUNS:
        report = args.out / "runs" / name / "report.json"
        if report.is_file() and (args.out / "runs" / f"{name}.log").is_file():
            rows[name] = json.loads(report.read_text())
    return rows


def table(rows):
    lines = []
    for name, r in rows.items():
        stages, a = r["stages"], r["args"]
        row = {"run": name, "k": a.get("layer_compressed_dims") or a["k"], "sharing": a["compress_sharing"],
               "projection": a["compress_type"] if a["compress_type"] != "linear" else f"linear {a['init']}",
               # the converter scales keys only where they have projections of their own, with weights
               "key scale": a.get("key_scale", "window")
               if a["compress_sharing"] in ("none", "headwise") and a["compress_type"] in ("linear", "conv") else "-",
               "short inputs": a["compress_length_norm"], "E/F lr": f"{a['projection_lr']:g}"}  # fmt: skip
        for stage in ("converted", "transfer", "distillation"):
            fid = stages.get(stage, {}).get("fidelity", {})
            row[f"cosine {stage}"] = f"{fid['cosine']:.3f}" if fid else "-"
            row[f"STS {stage}"] = f"{fid['sts']:.4f} ({fid['sts'] / r['teacher_sts']:.1%})" if "sts" in fid else None
        row["transfer s"] = f"{stages.get('transfer', {}).get('seconds', 0):.0f}"
        row["distillation s"] = f"{stages.get('distillation', {}).get('seconds', 0):.0f}"
        lines.append(row)
    return lines


def plot_layers(rows, path):
    """Hidden-state error by layer after each stage, one panel per n = 512 run."""
    long = {name: r for name, r in rows.items() if name.startswith("n512")}
    if not long:
        return
    plt = pyplot()
    fig, axes = panels(plt, len(long), 3.2, 3)
    for ax, (name, r) in zip(axes.flat, long.items()):
        for stage, style in (("converted", ":"), ("transfer", "--"), ("distillation", "-")):
            fid = r["stages"].get(stage, {}).get("fidelity")
            if fid:
                ax.plot(range(1, len(fid["hidden"]) + 1), fid["hidden"], style, label=f"{stage} ({fid['cosine']:.3f})")
        ax.set(title=name, xlabel="layer")
        ax.legend(fontsize=6)
    for row in axes:
        row[0].set_ylabel("relative error of the hidden states")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_heads(rows, path):
    """Each head's attention error after distillation against how local the teacher's head is."""
    with_heads = {name: r["heads"] for name, r in rows.items() if "heads" in r}
    if not with_heads:
        return
    plt = pyplot()
    fig, axes = panels(plt, len(with_heads), 4, 3.3)
    for ax, (name, heads) in zip(axes.flat, with_heads.items()):
        for layer, (errors, local) in enumerate(zip(heads["error"], heads["local"]), 1):
            ax.scatter(local, errors, s=12, label=f"layer {layer}")
        ax.set(title=name, xlabel=f"teacher head's attention within {heads['near']} positions")
        ax.legend(fontsize=6)
    for row in axes:
        row[0].set_ylabel("relative error of the head's output")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def panels(plt, count, width, height, columns=4):
    """A figure of ``count`` panels sharing their y axis, at most ``columns`` a row (unused ones hidden)."""
    rows = -(-count // columns)
    cols = min(count, columns)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False, sharey=True)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, axes


def head_summary(heads, local=0.3, spread=0.1):
    """Mean error of the local heads (share >= local) and of the spread-out ones (< spread)."""
    pairs = [(e, s) for errors, shares in zip(heads["error"], heads["local"]) for e, s in zip(errors, shares)]
    near = [e for e, s in pairs if s >= local]
    far = [e for e, s in pairs if s < spread]
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    return (
        f"{len(near)} local heads (>= {local:.0%} within {heads['near']}): error {mean(near):.2f}; "
        f"{len(far)} spread-out heads (< {spread:.0%}): {mean(far):.2f}"
    )


def plot_spectrum(spectra, path):
    if not spectra:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(spectra), figsize=(3.6 * len(spectra), 3.2), squeeze=False)
    for ax, (n, result) in zip(axes[0], spectra.items()):
        for layer in result["layers"]:
            curve = layer["mean_curve"]
            ax.plot(range(1, len(curve) + 1), curve, label=f"layer {layer['layer']} (90%: {layer['index_of_mass']})")
        ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
        ax.set(title=f"n={n}", xlabel="singular value index")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("normalised cumulative singular value")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def report(args):
    rows = results(args)
    spectra = {n: json.loads(p.read_text()) for n in SPECTRUM_LENGTHS
               if (p := args.out / "spectrum" / f"n{n}" / "spectrum.json").is_file()}  # fmt: skip
    plot_layers(rows, args.out / "fidelity_by_layer.png")
    plot_spectrum(spectra, args.out / "spectrum.png")
    plot_heads(rows, args.out / "heads.png")
    imported = args.out / "teacher" / "import.json"  # import_hf.py records the folder it read
    source = json.loads(imported.read_text())["source"] if imported.is_file() else "the imported encoder"
    lines = [f"# Linearizing {source}: results", ""]
    if spectra:
        lines += ["K holding 90% of each layer's attention spectrum (heads' mean curve; min and max over heads):", ""]
        spec_rows = []
        for i in range(len(next(iter(spectra.values()))["layers"])):
            row = {"layer": i + 1}
            for n, result in spectra.items():
                heads = result["layers"][i]["heads_index_of_mass"]
                row[f"n={n}"] = f"{result['layers'][i]['index_of_mass']} ({min(heads)}-{max(heads)})"
            spec_rows.append(row)
        lines += [markdown_table(spec_rows), ""]
    if rows:
        teacher = next((r["teacher_sts"] for r in rows.values() if "teacher_sts" in r), None)
        if teacher is not None:
            lines += [f"Teacher STS-B dev Spearman (zero-shot, mean pooling, n=128): {teacher:.4f}", ""]
        lines += [markdown_table(table(rows)), ""]
        lines += [f"- {name}: {head_summary(r['heads'])}" for name, r in rows.items() if "heads" in r] + [""]
    finetuned, finetune_scores = finetune_table(args)
    if finetuned:
        how = json.loads((args.out / "finetune" / "settings.json").read_text())
        budgets = "; ".join(f"{task}: {h['train_rows']}-row training subset, {h['finetune_epochs']} epoch"
                            f"{'s' * (h['finetune_epochs'] != 1)}, lr {h['finetune_lr']}"
                            for task, h in how.items())  # fmt: skip
        lines += [f"Finetuned at n=128 ({budgets}; dev metric after the last epoch; mean ± sd over seeds):", ""]
        lines += [markdown_table(finetuned), ""]
    write_text(args.out / "report.md", "\n".join(lines))
    # each head's whole curve stays in OUT/spectrum/nN/spectrum.json (1.3 MB); the summary keeps the means
    for result in spectra.values():
        for layer in result["layers"]:
            layer.pop("head_curves", None)
    everything = {"runs": rows, "spectra": spectra, "finetune": finetune_scores}
    write_text(args.out / "results.json", json.dumps(everything, indent=1, default=str) + "\n")
    print("\n".join(lines))


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    needed = "; required unless --report-only"
    p.add_argument("--hf-dir", type=Path, help="all-MiniLM-L6-v2 (scripts/fetch_minilm.sh)" + needed)
    p.add_argument("--wikitext", type=Path, help="folder with wiki.train.tokens and wiki.valid.tokens" + needed)
    p.add_argument("--sts", type=Path, help="GLUE STS-B dev.tsv" + needed)
    p.add_argument("--out", type=Path, required=True, help="study folder (keep it outside the checkout)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), help="runs to make (default: all)")
    p.add_argument("--spectrum-sequences", type=int, default=16, help="sequences per spectrum (default: 16)")
    p.add_argument("--short-steps", type=int, default=200, help="distillation steps at n=128 (default: 200)")
    p.add_argument("--grid-steps", type=int, default=100, help="distillation steps of the n=512 grid (default: 100)")
    g = p.add_argument_group("finetuning the n=128 Linformers and their teacher on SST-2 and CoLA (with --glue)")
    g.add_argument("--glue", type=Path, help="glue_data folder with SST-2 and CoLA (train.tsv, dev.tsv)")
    g.add_argument(
        "--finetune",
        nargs="+",
        choices=[*SHORT_RUNS, *PROBES],
        help="n=128 runs (or probes) to finetune (default: every run)",
    )
    g.add_argument("--tasks", nargs="+", choices=GLUE_TASKS, default=list(GLUE_TASKS), help="default: SST-2 CoLA")
    g.add_argument(
        "--train-rows", type=int, default=4000, help="each task's training subset, drawn with seed 0 (default: 4000)"
    )
    g.add_argument("--finetune-epochs", type=int, default=2, help="default: 2")
    g.add_argument("--finetune-lr", type=float, default=1e-4, help="default: 1e-4")
    g.add_argument("--seeds", type=int, default=3, help="finetuning seeds per model and task (default: 3)")
    p.add_argument("--report-only", action="store_true", help="only rewrite the report from finished runs")
    return p


def inputs(args):
    """The inputs every run but --report-only reads, by flag."""
    return {"--hf-dir": args.hf_dir, "--wikitext": args.wikitext, "--sts": args.sts}


def check_required(p, args):
    """The inputs, which argparse cannot require of every run but --report-only (tests/test_readme.py
    checks the README's commands with it too)."""
    missing = [name for name, path in inputs(args).items() if path is None]
    if missing and not args.report_only:
        p.error(f"the following arguments are required (unless --report-only): {', '.join(missing)}")


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    check_required(p, args)
    if not args.report_only:
        for name, path in inputs(args).items():
            if not path.exists():
                p.error(f"{name} {path}: not found")
        if args.glue and not all((args.glue / t / f).is_file() for t in args.tasks for f in ("train.tsv", "dev.tsv")):
            p.error(f"--glue {args.glue}: needs {' and '.join(args.tasks)} with train.tsv and dev.tsv")
        if not (args.out / "teacher" / "model.pt").is_file():
            sh([sys.executable, SCRIPTS_DIR / "import_hf.py", args.hf_dir, "--out", args.out / "teacher"])
        for n in SPECTRUM_LENGTHS:
            spectrum(args, n)
        for name in args.runs or RUNS:
            run(args, name)
        if args.glue:  # one budget per task, for every model
            bins = glue_data(args)
            made = args.out / "finetune" / "settings.json"
            settings = json.loads(made.read_text()) if made.is_file() else {}
            for task in args.tasks:
                mine = dict(
                    train_rows=bins[task][1], finetune_epochs=args.finetune_epochs, finetune_lr=args.finetune_lr
                )
                if settings.setdefault(task, mine) != mine:
                    fail(f"{made.parent}: {task} was finetuned with other settings ({settings[task]})")
            write_text(made, json.dumps(settings) + "\n")
            for name in (TEACHER, *(args.finetune or SHORT_RUNS)):
                finetune(args, name, bins)
    elif not args.out.is_dir():
        fail(f"{args.out}: no such study folder")
    report(args)


if __name__ == "__main__":
    main()
