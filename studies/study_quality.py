"""Quality study: Linformer variants side by side with RoBERTa of the same size, data, budget
and seed. Its report fills docs/quality.md, which has the method and the results.

Steps, each reused when the study runs again (a killed pretraining resumes from its
checkpoint_last.pt):

1. data: WikiText-2 train + books -> corpus, sentencepiece, data-bin; WikiText-2 valid is the
   validation text; for each GLUE task a fixed training subset with the full dev set.
2. per run, in OUT/runs/NAME/: masked-LM pretraining (pretrain.log), the masked-LM loss on
   validation text cut to shorter contexts (short_inputs.json), finetuning on each GLUE task
   with several seeds (TASK-seedS.log).
3. report: wall time and peak memory of a training update of every model, measured alone one
   after another as the benchmark measures them (timing.json), then OUT/report.md,
   OUT/results.json, OUT/logs-summary.txt and OUT/perplexity.png.
"""

import argparse
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from linformer_tools import fairseq_train
from linformer_tools.common import REPO, atomic, fail, write_text
from linformer_tools.logs import by_update, records
from linformer_tools.models import pyplot, save_figure

from common import (
    GLUE_TASKS,
    context_losses,
    dev_scores,
    finetune_flags,
    glue_subset,
    load,
    log,
    mean_sd,
    sh,
    update_cost,
)

DATA_PREP = REPO / "data-prep"

# The model, n and the pretraining recipe of each study size; --batch, --budget, --lr,
# --vocab-size, --dropout, --mask-prob and --pre-ln override the recipe. "context" is the scale
# at which the models use context (docs/quality/context-search.md); "small" the 800-update
# small-budget reading.
SIZES = {
    "context": dict(layers=4, dim=256, ffn=1024, heads=4, n=256, batch=16, vocab=2000, lr=1e-3, budget=3000),
    "small": dict(layers=4, dim=256, ffn=1024, heads=4, n=256, batch=8, vocab=8000, lr=5e-4, budget=800),
    "tiny": dict(layers=2, dim=32, ffn=64, heads=4, n=64, batch=8, vocab=1000, lr=5e-3, budget=16),
}
RECIPE_DEFAULTS = dict(dropout=0.1, mask_prob=0.15)
# GLUE folder -> (the metric fairseq logs for it, criterion flags, train.tsv starts with a header)


def linformer(n, k=None, **changes):
    """Flags of a Linformer run: k = n/4 (the plugin's default ratio), headwise, linear
    projection, linear length norm, N(0, 0.02) init, each overridden by ``changes`` (all
    explicit: no run depends on the plugin's defaults)."""
    flags = dict(
        compressed_dim=k or n // 4,
        compress_sharing="headwise",
        compress_type="linear",
        compress_length_norm="linear",
        compress_init="normal",
    )
    flags.update(changes)
    return ["--arch", "linformer_roberta_base"] + [
        x for key, value in flags.items() for x in ("--" + key.replace("_", "-"), str(value))
    ]


def run_specs(n):
    """Name -> (model flags, extra pretraining flags, the run whose pretraining it shares), in
    the order they run, so a study cut short keeps what matters most. The first ``CORE`` runs
    are the study; the rest are the alternatives the small-budget reading also tried (``--runs``
    picks them). Runs that differ from the reference only in the length handling share its
    pretraining: every pretraining block is n tokens long, where the handling is the identity."""
    # blocks of whole lines (paragraphs) up to n tokens; fairseq gives a line longer than the
    # block a block of its own, too long for n, so such lines are skipped (train and valid)
    varied = ["--sample-break-mode", "complete", "--skip-invalid-size-inputs-valid-test"]
    return {
        "roberta": (["--arch", "roberta_base"], [], None),
        "linformer": (linformer(n), [], None),
        "conv": (linformer(n, compress_type="conv"), [], None),
        "mean-pooling": (linformer(n, compress_type="mean"), [], None),
        "resample": (linformer(n, compress_length_norm="resample"), [], "linformer"),
        "k-n8": (linformer(n, n // 8), [], None),
        "k-n16": (linformer(n, n // 16), [], None),
        "sharing-kv": (linformer(n, compress_sharing="kv"), [], None),
        "sharing-layerwise": (linformer(n, compress_sharing="layerwise"), [], None),
        "linformer-seed2": (linformer(n), ["--seed", "2"], None),  # the pretraining seed's noise
        "length-norm-none": (linformer(n, compress_length_norm="none"), [], "linformer"),
        "length-norm-sqrt": (linformer(n, compress_length_norm="sqrt"), [], "linformer"),
        "varied-blocks-norm-none": (linformer(n, compress_length_norm="none"), varied, None),
        "init-xavier": (linformer(n, compress_init="xavier"), [], None),
        "init-mean": (linformer(n, compress_init="mean"), [], None),
        "sharing-none": (linformer(n, compress_sharing="none"), [], None),
        "nonuniform-k": (linformer(n, layer_compressed_dims=",".join(str(n // d) for d in (2, 4, 8, 8))), [], None),
    }


CORE = 10


# ------------------------------------------------------------------------------- data


def prepare_data(args, work):
    """Corpus, sentencepiece, data-bin and the GLUE subsets under work/; returns their paths and
    each task's number of training rows (train_rows)."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    wt, books = args.wikitext, args.books
    tsvs = [args.glue / task / f"{split}.tsv" for task in args.tasks for split in ("train", "dev")]
    for path in (wt / "wiki.train.tokens", wt / "wiki.valid.tokens", books, *tsvs):
        if not path.exists():
            fail(f"{path} not found (see --help for the data flags)")
    # The corpus builder always holds out documents; the train corpus gives 1 document to its
    # unused valid split, and all of WikiText-2 valid becomes the validation text.
    corpus = [DATA_PREP / "corpus.sh", "--valid-docs", 1]
    sh(
        [*corpus, "--out", data / "corpus-train", "--wikitext", wt / "wiki.train.tokens"]
        + ["--books", books, "--books-encoding", "auto"]
    )
    sh([*corpus, "--out", data / "corpus-valid", "--wikitext", wt / "wiki.valid.tokens"])
    valid_txt = data / "valid.txt"
    if not valid_txt.exists():
        text = "".join((data / "corpus-valid" / f).read_text() for f in ("train.txt", "valid.txt"))
        write_text(valid_txt, text)
    spm = data / "spm"
    sh(
        [DATA_PREP / "spm.sh", "train", "--corpus", data / "corpus-train" / "train.txt", "--out", spm]
        + ["--vocab-size", args.vocab_size, "--workers", 2]
    )
    inputs, outputs = [data / "corpus-train" / "train.txt", valid_txt], [data / "train.spm", data / "valid.spm"]
    sh(
        [
            DATA_PREP / "spm.sh",
            "encode",
            "--model",
            spm / "spm.model",
            "--workers",
            2,
            "--inputs",
            *inputs,
            "--outputs",
            *outputs,
        ]
    )
    sh(
        [DATA_PREP / "binarize.sh", "--train", data / "train.spm", "--valid", data / "valid.spm"]
        + ["--srcdict", spm / "dict.txt", "--destdir", data / "data-bin", "--shards", 1, "--workers", 2]
    )

    subsets = data / "glue-subsets"
    rows = {task: glue_subset(args.glue, task, args.train_rows, subsets) for task in args.tasks}
    sh(
        [DATA_PREP / "glue.sh", "--glue-dir", subsets, "--tasks", *args.tasks, "--spm-model", spm / "spm.model"]
        + ["--srcdict", spm / "dict.txt", "--destdir", data / "glue", "--workers", 2]
    )
    shards = sorted((data / "data-bin").glob("shard*"))
    return {
        "data_bin": ":".join(map(str, shards)) or str(data / "data-bin"),
        **{task: data / "glue" / f"{task}-bin" for task in args.tasks},
        "train_rows": rows,
    }


# ------------------------------------------------------------------------------- one run


def size_flags(s):
    flags = ["--encoder-layers", s["layers"], "--encoder-embed-dim", s["dim"], "--encoder-ffn-embed-dim", s["ffn"]]
    flags += ["--encoder-attention-heads", s["heads"], "--max-positions", s["n"]]
    return flags + (["--encoder-normalize-before"] if s["pre_ln"] else [])


COMMON = [*fairseq_train.shared_flags(cpu=True), "--clip-norm", "1.0"]


def pretrain(args, paths, model_flags, extra_flags, out):
    s, updates = args.shape, args.budget
    every = max(1, updates // 8)
    sh(
        [sys.executable, "-m", "fairseq_cli.train", paths["data_bin"], *model_flags, *size_flags(s), *COMMON]
        + ["--task", "masked_lm", "--criterion", "masked_lm", "--tokens-per-sample", s["n"]]
        + ["--dropout", s["dropout"], "--attention-dropout", s["dropout"], "--mask-prob", s["mask_prob"]]
        + ["--sample-break-mode", "none", "--batch-size", s["batch"], "--seed", 1, "--lr", s["lr"]]
        + ["--warmup-updates", max(1, updates // 10), "--total-num-update", updates, "--max-update", updates]
        # --max-valid-steps stops validation early; with fairseq's prefetch thread on, the
        # process then aborts at exit ("terminate called without an active exception")
        + ["--validate-interval-updates", every, "--batch-size-valid", 32, "--max-valid-steps", args.valid_batches]
        + ["--save-interval-updates", every, "--keep-interval-updates", 1]
        + ["--no-epoch-checkpoints", "--log-interval", max(1, updates // 40), "--save-dir", out / "checkpoints"]
        + extra_flags,  # last, so that a run's own --seed or break mode wins
        out / "pretrain.log",
        threads=args.threads,
    )


def finetune(args, paths, task, model_flags, out, seed):
    """TASK from the pretrained checkpoint (common.finetune_flags)."""
    sh(
        [sys.executable, "-m", "fairseq_cli.train", paths[task], *model_flags, *size_flags(args.shape), *COMMON]
        + ["--finetune-from-model", out / "checkpoints" / "checkpoint_last.pt"]
        + finetune_flags(task, paths["train_rows"][task], args.finetune_epochs, args.finetune_lr, seed),
        out / f"{task}-seed{seed}.log",
        threads=args.threads,
    )


def short_input_losses(args, paths, out):
    """Masked-LM loss (bits/token) on the same masked tokens of the validation blocks, read
    with the whole n-token block as context and with the block cut into pieces of T tokens."""
    n = args.shape["n"]
    model, task = load(out / "checkpoints" / "checkpoint_last.pt", paths["data_bin"])
    return context_losses(model, task, n, (n // 16, n // 8, n // 4, n), args.eval_blocks)


def share_pretraining(base, out, length_norm):
    """OUT's pretraining is BASE's: its log, and its last checkpoint with ``length_norm`` in
    every linear projection (loading restores what the checkpoint holds)."""
    import torch
    from fairseq import checkpoint_utils

    import linformer_fairseq  # noqa: F401  (allow-lists the checkpoint's types)
    from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS

    state = checkpoint_utils.load_checkpoint_to_cpu(str(base / "checkpoints" / "checkpoint_last.pt"))
    for key in [k for k in state["model"] if k.endswith("length_norm_power")]:
        state["model"][key] = torch.tensor(LENGTH_NORM_POWERS[length_norm])
    (out / "checkpoints").mkdir(exist_ok=True)
    with atomic(out / "checkpoints" / "checkpoint_last.pt") as tmp:
        torch.save(state, tmp)
    write_text(out / "pretrain.log", (base / "pretrain.log").read_text())


def do_run(args, paths, name, spec, shared=None):
    """Pretraining, the short-input table and finetuning of one run; ``shared``: the finished
    run whose pretraining it shares."""
    model_flags, extra_flags, _ = spec
    out = args.out / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    if shared and not (out / "pretrain.log").exists():
        log(f"{name}: the pretraining of {shared.name}")
        share_pretraining(shared, out, model_flags[model_flags.index("--compress-length-norm") + 1])
    if not (out / "pretrain.log").exists():
        log(f"{name}: pretraining {args.budget} updates")
        pretrain(args, paths, model_flags, extra_flags, out)
    if not (out / "short_inputs.json").exists():
        losses = short_input_losses(args, paths, out)
        write_text(out / "short_inputs.json", json.dumps(losses, indent=1))
    for task in args.tasks if args.finetune_runs is None or name in args.finetune_runs else ():
        for seed in range(1, args.seeds + 1):
            if not (out / f"{task}-seed{seed}.log").exists():
                log(f"{name}: {task} finetuning, seed {seed}")
                finetune(args, paths, task, model_flags, out, seed)
    log(f"{name}: done")


# ------------------------------------------------------------------------------- report


def valid_curve(log):
    """(updates, perplexity) of every validation; a resumed run may repeat one: keep the last."""
    return sorted(by_update(records(log, "valid"), "ppl").items())


def time_updates(args, paths, out):
    """Seconds (median) and peak memory of a pretraining update at the study's batch shape."""
    model, task = load(out / "checkpoints" / "checkpoint_last.pt", paths["data_bin"])
    return update_cost(model, task, args.shape["batch"], args.shape["n"], args.timing_seconds)


def report(args, specs):
    rows, curves = [], {}
    n = args.shape["n"]
    for name in specs:
        out = args.out / "runs" / name
        if not (out / "short_inputs.json").exists():
            continue
        curves[name] = curve = valid_curve(out / "pretrain.log")
        short = {int(t): v for t, v in json.loads((out / "short_inputs.json").read_text()).items()}
        scores = {task: dev_scores(out, task) for task in args.tasks}
        timing = json.loads((out / "timing.json").read_text()) if (out / "timing.json").exists() else {}
        flags = " ".join(map(str, specs[name][0] + specs[name][1]))
        rows.append(dict(name=name, flags=flags, ppl=curve[-1][1] if curve else None, short=short, **scores, **timing))
    if not rows:
        fail(f"no finished run under {args.out}/runs")
    base = next((r for r in rows if r["name"] == "roberta"), None)
    lengths = sorted(rows[0]["short"])

    def pct(a, b):
        return f"{100 * (a / b - 1):+.1f}%" if a and b else ""

    metrics = [f"{task} {GLUE_TASKS[task][0]} (mean ± sd)" for task in args.tasks]
    header = ["run", "valid ppl", "vs RoBERTa", *(f"loss T={t}" for t in lengths), f"T={lengths[0]} minus T={n}"]
    header += [*metrics, "s/update", "peak MB", "params"]
    lines = [
        f"Study: {args.size} models ({args.shape}), {args.budget} pretraining updates, "
        f"{', '.join(args.tasks)} on at most {args.train_rows} training rows, {args.finetune_epochs} epochs, "
        f"seeds 1..{args.seeds}.",
        "",
        "| " + " | ".join(header) + " |",
        "| --- " * len(header) + "|",
    ]
    for r in rows:
        cells = [r["name"], f"{r['ppl']:.1f}", pct(r["ppl"], base and base["ppl"])]
        cells += [f"{r['short'][t]:.3f}" for t in lengths] + [f"{r['short'][lengths[0]] - r['short'][n]:+.3f}"]
        cells += [mean_sd(r[task]) for task in args.tasks]
        if "parameters" in r:
            cells += [f"{r['seconds_per_update']:.3f}", f"{r['peak_mb']:.0f}", f"{r['parameters']:,}"]
        else:
            cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Flags of each run (besides the shared size and recipe):", ""]
    lines += [f"- {r['name']}: `{r['flags']}`" for r in rows]
    write_text(args.out / "report.md", "\n".join(lines) + "\n")
    write_text(args.out / "logs-summary.txt", log_summary(args.out, [r["name"] for r in rows]))
    write_text(args.out / "results.json", json.dumps({"rows": rows, "curves": curves}, indent=1))
    plot(curves, args.out / "perplexity.png", f"validation perplexity ({args.size}, n={n})")
    print("\n".join(lines))
    log(f"wrote {args.out}/report.md, results.json, logs-summary.txt and perplexity.png")


def log_summary(out, names):
    """The validation lines of every pretraining and finetuning log, without the checkpoints."""
    keep = re.compile(r"valid on 'valid' subset.*")
    text = []
    for name in names:
        for path in sorted((out / "runs" / name).glob("*.log")):
            text.append(f"== {name}/{path.name}")
            text += [m.group(0) for m in map(keep.search, path.read_text().splitlines()) if m]
    return "\n".join(text) + "\n"


def plot(curves, path, title):
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for name, curve in curves.items():
        if curve:
            style = dict(color="black", linewidth=2.5) if name == "roberta" else dict(linewidth=1)
            ax.plot(*zip(*curve), label=name, **style)
    ax.set(xlabel="updates", ylabel="validation perplexity", yscale="log", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)


# ------------------------------------------------------------------------------- main


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    needed = "; required unless --list"

    def arg(*names, **kw):
        if "default" in kw and "%(default)s" not in kw.get("help", ""):
            default = kw["default"]  # paths as the checkout sees them, not as this machine does
            shown = os.path.relpath(default, REPO) if isinstance(default, Path) else "%(default)s"
            kw["help"] = kw.get("help", "") + f" (default: {shown})"
        p.add_argument(*names, **kw)

    arg("--out", type=Path, default=REPO / "work" / "study", help="output folder")
    arg("--wikitext", type=Path, help="folder with wiki.train.tokens and wiki.valid.tokens" + needed)
    arg("--books", type=Path, help="folder of plain-text books, one per *.txt" + needed)
    arg("--glue", type=Path, help="GLUE folder with one folder per task (train.tsv, dev.tsv)" + needed)
    arg("--tasks", nargs="+", choices=GLUE_TASKS, default=list(GLUE_TASKS), help="GLUE tasks to finetune on")
    arg("--size", choices=SIZES, default="context", help="model size, n and pretraining recipe")
    arg("--batch", type=int, help="sequences of n tokens per update (default: the size's)")
    arg("--budget", type=int, help="pretraining updates of every run (default: the size's)")
    arg("--lr", type=float, help="pretraining peak learning rate (default: the size's)")
    arg("--vocab-size", type=int, help="sentencepiece vocabulary (default: the size's)")
    arg("--dropout", type=float, help=f"dropout and attention dropout (default: {RECIPE_DEFAULTS['dropout']})")
    arg(
        "--mask-prob",
        type=float,
        help=f"share of tokens masked in pretraining (default: {RECIPE_DEFAULTS['mask_prob']})",
    )
    arg("--pre-ln", action="store_true", help="layer norm before each block (--encoder-normalize-before) in every run")
    arg("--train-rows", type=int, default=4000, help="each task's fixed training subset, drawn with seed 0")
    arg("--finetune-epochs", type=int, default=3)
    arg("--finetune-lr", type=float, default=3e-4)
    arg("--seeds", type=int, default=3, help="finetuning seeds per run and task, 0 for none")
    arg("--eval-blocks", type=int, default=200, help="validation blocks of n tokens read by the short-input table")
    arg("--valid-batches", type=int, default=16, help="validation perplexity on the first N batches of 32 blocks")
    arg("--runs", nargs="+", metavar="NAME", help=f"only these runs (default: the first {CORE}; see --list)")
    arg(
        "--finetune-runs",
        nargs="+",
        metavar="NAME",
        help="finetune only these runs (default: all); the others get perplexity and the short-input table",
    )
    arg("--list", action="store_true", help="print the runs and their flags, then exit")
    arg("--jobs", type=int, default=1, help="runs trained at once, each on --threads threads")
    arg("--threads", type=int, default=0, help="threads per training process, 0 for torch's default")
    arg("--timing-seconds", type=float, default=10, help="timed updates per run last at least this long (default: 10)")
    arg("--report-only", action="store_true", help="only time the finished runs and write the report")
    return p


def check_required(p, args):
    """The data, which argparse cannot require of every run but --list (tests/test_readme.py
    checks the README's commands with it too)."""
    given = {"--wikitext": args.wikitext, "--books": args.books, "--glue": args.glue}
    missing = [name for name, path in given.items() if path is None]
    if missing and not args.list:
        p.error(f"the following arguments are required (unless --list): {', '.join(missing)}")


def main():
    p = build_parser()
    args = p.parse_args()
    check_required(p, args)
    positive = ("batch", "budget", "lr", "vocab_size", "train_rows", "finetune_epochs", "jobs", "eval_blocks")
    for name in (*positive, "timing_seconds"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.seeds < 0 or args.valid_batches < 1:
        p.error("--seeds must be >= 0 and --valid-batches >= 1")

    # the recipe: the size's, with what the flags override
    size = RECIPE_DEFAULTS | SIZES[args.size]
    if not 0 <= (args.dropout or 0) < 1 or not 0 < (args.mask_prob or 0.15) < 1:
        p.error("--dropout must be in [0, 1) and --mask-prob in (0, 1)")
    args.shape = dict(size, batch=args.batch or size["batch"], lr=args.lr or size["lr"], pre_ln=args.pre_ln)
    args.shape.update(
        dropout=size["dropout"] if args.dropout is None else args.dropout, mask_prob=args.mask_prob or size["mask_prob"]
    )
    args.budget, args.vocab_size = args.budget or size["budget"], args.vocab_size or size["vocab"]
    args.shape.update(budget=args.budget, vocab=args.vocab_size)
    specs = run_specs(args.shape["n"])
    if args.list:
        for i, (name, (model_flags, extra_flags, base)) in enumerate(specs.items()):
            extra = ("" if i < CORE else " (not in the default set)") + (f" (pretraining of {base})" if base else "")
            print(f"{name}{extra}: {' '.join(map(str, model_flags + extra_flags))}")
        return
    unknown = (set(args.runs or []) | set(args.finetune_runs or [])) - set(specs)
    if unknown:
        p.error(f"unknown run(s) {sorted(unknown)}; --list shows the names")
    names = args.runs or list(specs)[:CORE]
    specs = {k: v for k, v in specs.items() if k in names}
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    # what the results depend on; more tasks or seeds may be added to a study later
    settings = {k: str(getattr(args, k)) for k in ("shape", "wikitext", "books", "glue", "train_rows")}
    settings |= {k: str(getattr(args, k)) for k in ("finetune_epochs", "finetune_lr", "eval_blocks", "valid_batches")}
    saved = args.out / "settings.json"
    if saved.exists() and json.loads(saved.read_text()) != settings:
        fail(f"{args.out} holds a study made with other settings ({saved}); use another --out")
    saved.write_text(json.dumps(settings, indent=1))

    paths = prepare_data(args, args.out)
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            runs = {name: pool.submit(do_run, args, paths, name, spec) for name, spec in specs.items() if not spec[2]}
            for name, spec in specs.items():
                if base := spec[2]:  # once the run whose pretraining it shares is done
                    if base not in runs:
                        runs[base] = pool.submit(do_run, args, paths, base, run_specs(args.shape["n"])[base])
                    runs[base].result()
                    runs[name] = pool.submit(do_run, args, paths, name, spec, args.out / "runs" / base)
            for run in runs.values():
                run.result()
    for name in specs:
        out = args.out / "runs" / name
        if (out / "short_inputs.json").exists() and not (out / "timing.json").exists():  # finished runs
            log(f"{name}: timing updates")
            write_text(out / "timing.json", json.dumps(time_updates(args, paths, out)))
    report(args, specs)


if __name__ == "__main__":
    main()
