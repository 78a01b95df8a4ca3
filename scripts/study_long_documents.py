"""Long-document study: on IMDB, does a model that reads whole reviews beat one that reads their
truncated n tokens? (docs/long_documents.md has the method and the results.)

It starts from a finished quality study (scripts/study_quality.py --out QUALITY: its data and the
RoBERTa and Linformer it pretrained at n) and goes the README's long path with the launchers:

1. data: a fixed stratified IMDB subset (data-prep/imdb.sh --train-size/--test-size), reviews
   kept whole, with the quality study's sentencepiece model and dictionary;
2. for each model and factor f (and for a Linformer each --projections way of extending its
   projections): scripts/extend_max_positions.py to n' = f n, the masked-LM
   loss at T = n and T = n' on validation blocks of n' tokens, continued pretraining at n'
   (scripts/pretrain.sh --from CHECKPOINT extend), and the losses again;
3. runs: each model at n with head and with head+tail truncation (first n/4 tokens, the rest
   from the end, as Sun et al. 2019 at 512), and each extended model at n' (reviews longer than
   n' cut head+tail), finetuned with scripts/finetune.sh imdb over several seeds; each final
   model predicts the test subset: accuracy overall and split by review length (<= n, > n);
4. the cost of a training update of each model at the length it reads, measured alone after the
   runs (linformer_tools.study.update_cost), and OUT/report.md, OUT/results.json and
   OUT/accuracy_by_length.png.

Every step is skipped when its output exists, so a killed study resumes where it stopped.
"""

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from linformer_tools import checkpoints
from linformer_tools.common import REPO, fail, write_text
from linformer_tools.models import pyplot, save_figure
from linformer_tools.study import context_losses, load, log, mean_sd, sh, update_cost

SCRIPTS = REPO / "scripts"


def prepare_imdb(args):
    quality = args.quality / "data"
    dest = args.out / "data"
    sh(
        [REPO / "data-prep" / "imdb.sh", "--tarball", args.imdb, "--destdir", dest, "--workers", 2]
        + ["--spm-model", quality / "spm" / "spm.model", "--srcdict", quality / "spm" / "dict.txt"]
        + ["--train-size", args.train_size, "--test-size", args.test_size, "--valid-size", args.valid_size]
    )
    return dest / "IMDB-bin"


def base_checkpoint(args, model):
    path = args.quality / "runs" / model / "checkpoints" / "checkpoint_last.pt"
    if not path.exists():
        fail(f"{path} not found: run the quality study's {model} run first (see --help)")
    return path


def model_kind(path):
    return checkpoints.model_kind(checkpoints.read_checkpoint(path), path)


def extended_name(args, model, factor, projections):
    """The extended model's folder and run name: MODEL-nN' (periodic projections), or with -stretch."""
    return f"{model}-n{args.n * factor}" + ("" if projections == "periodic" else f"-{projections}")


def extend_and_continue(args, model, factor, projections):
    """The model extended to n' = factor n and continued at n'; returns its checkpoint."""
    n, data_bin = args.n, args.data_bin
    long_n = n * factor
    work = args.out / "extended" / extended_name(args, model, factor, projections)
    work.mkdir(parents=True, exist_ok=True)
    extended, continued = work / "extended.pt", work / "continued"
    if not (work / "extend.log").exists():
        log(f"{model}: extending to n'={long_n}")
        cmd = [sys.executable, SCRIPTS / "extend_max_positions.py", base_checkpoint(args, model), extended]
        cmd += ["--max-positions", long_n, "--projections", projections]
        sh(cmd, work / "extend.log", threads=args.threads)
    losses = work / "losses.json"
    found = json.loads(losses.read_text()) if losses.exists() else {}
    if "extended" not in found:
        found["extended"] = long_losses(args, extended, long_n)
        write_text(losses, json.dumps(found, indent=1))
    if not (work / "continue.log").exists():
        log(f"{model}: continued pretraining at n'={long_n}, {args.continue_updates} updates")
        batch = max(1, args.continue_tokens // long_n)
        every = max(1, args.continue_updates // 4)
        sh(
            [SCRIPTS / "pretrain.sh", "--cpu", "--batch-size", batch, "--global-batch", batch]
            + ["--save-dir", continued, "--from", extended, "extend", data_bin]
            + [f"optimization.max_update={args.continue_updates}", f"optimization.lr=[{args.continue_lr}]"]
            + [f"lr_scheduler.warmup_updates={max(1, args.continue_updates // 10)}", "dataset.num_workers=0"]
            + [f"checkpoint.save_interval_updates={every}", "checkpoint.keep_interval_updates=1"]
            + ["common.log_format=simple", f"common.log_interval={every}", "dataset.max_valid_steps=8"],
            work / "continue.log",
            threads=args.threads,
        )
    if "continued" not in found:
        found["continued"] = long_losses(args, continued / "checkpoint_last.pt", long_n)
        write_text(losses, json.dumps(found, indent=1))
    return continued / "checkpoint_last.pt"


def long_losses(args, checkpoint, long_n):
    """Masked-LM bits/token on validation blocks of n' tokens read whole and cut at n."""
    model, task = load(checkpoint, args.data_bin)
    return context_losses(model, task, long_n, (args.n, long_n), args.eval_blocks)


def finetune(args, name, checkpoint, truncation, seed):
    out = args.out / "runs" / name / f"seed{seed}"
    if (out / "predictions.json").exists():
        return
    n_model = load(checkpoint, args.data_bin)[0].max_positions()
    total = -(-args.train_size // args.batch) * args.epochs
    if not (out.parent / f"seed{seed}.log").exists():
        log(f"{name}: finetuning, seed {seed}")
        out.parent.mkdir(parents=True, exist_ok=True)
        sh(
            [SCRIPTS / "finetune.sh", "--cpu", "--batch-size", args.batch, "--global-batch", args.batch]
            + ["--data", args.imdb_bin, "--seed", seed, "--save-dir", out, "imdb", checkpoint]
            + [f"truncation={truncation}", f"++task.truncation_head_tokens={args.n // 4}"]
            + [f"optimization.max_epoch={args.epochs}", f"optimization.max_update={total}"]
            + [f"optimization.lr=[{args.lr}]", f"lr_scheduler.warmup_updates={max(1, total * 6 // 100)}"]
            # every review of a batch fits: the same reviews per update at every length
            + [f"dataset.max_tokens={args.batch * n_model}", "dataset.num_workers=0"]
            + ["common.log_format=simple", f"common.log_interval={max(1, total // 20)}"],
            out.parent / f"seed{seed}.log",
            threads=args.threads,
        )
    write_text(out / "predictions.json", json.dumps(predict(args, out / "checkpoint_last.pt")))
    for checkpoint in out.glob("checkpoint*.pt"):  # the predictions are what the report needs
        checkpoint.unlink()


def predict(args, checkpoint):
    """Test reviews as the finetuned model reads them (its truncation): (length, label, correct)."""
    import torch
    from fairseq.data import data_utils

    model, task = load(checkpoint, args.imdb_bin)
    task.load_dataset("test")
    dataset = task.datasets["test"]
    reviews = data_utils.load_indexed_dataset(str(args.imdb_bin / "input0" / "test"), task.source_dictionary)
    rows = []
    with torch.no_grad():
        for start in range(0, len(dataset), 16):
            sample = dataset.collater([dataset[i] for i in range(start, min(start + 16, len(dataset)))])
            logits, _ = model(
                **sample["net_input"], features_only=True, classification_head_name="sentence_classification_head"
            )
            labels = sample["target"].view(-1).tolist()
            for i, guess, label in zip(sample["id"].tolist(), logits.argmax(-1).tolist(), labels):
                rows.append((int(reviews.sizes[i]) + 1, label, guess == label))  # + <s>
    return rows


def runs(args):
    """name -> (model, extension: (factor, projections) or None, truncation, length it reads)."""
    found = {}
    for model in args.models:
        for truncation in ("head", "head_tail"):
            found[f"{model}-n{args.n}-{truncation}"] = (model, None, truncation, args.n)
        for factor in args.factors:  # a RoBERTa has no projections: one extension
            for projections in args.projections if args.kinds[model] == "linformer" else ["periodic"]:
                name = extended_name(args, model, factor, projections)
                found[name] = (model, (factor, projections), "head_tail", args.n * factor)
    return found


def do_run(args, name, spec):
    model, extension, truncation, _ = spec
    checkpoint = extend_and_continue(args, model, *extension) if extension else base_checkpoint(args, model)
    for seed in range(1, args.seeds + 1):
        finetune(args, name, checkpoint, truncation, seed)


def checkpoint_of(args, model, extension):
    """The pretrained model a run finetunes: the quality study's, or its extended continuation."""
    if not extension:
        return base_checkpoint(args, model)
    return args.out / "extended" / extended_name(args, model, *extension) / "continued" / "checkpoint_last.pt"


def report(args, specs, trained):
    n = args.n
    lines = [
        f"Long-document study: pretrained at n={n} ({args.quality}), IMDB {args.train_size} train / "
        f"{args.test_size} test reviews (stratified, seed 1), {args.epochs} epochs, batch {args.batch}, "
        f"lr {args.lr}, seeds 1..{args.seeds}; continued pretraining {args.continue_updates} updates "
        f"at lr {args.continue_lr}.",
        "",
    ]
    lengths = [row[0] for row in predictions(args, next(iter(specs)))] or [0]
    shares = ", ".join(
        f"longer than {m}: {100 * sum(x > m for x in lengths) / len(lengths):.1f}%"
        for m in sorted({n} | {n * f for f in args.factors})
    )
    lines += [f"Test reviews ({len(lengths)}, with <s> and </s>): {shares}.", ""]
    bins = length_bins(n, args.factors)
    reviews = [sum(keep(x) for x in lengths) for _, keep in bins]
    header = ["run", "reads", "truncation", "accuracy", f"<= {n} tokens", f"> {n} tokens", "s/update", "peak MB"]
    lines += ["| " + " | ".join(header) + " |", "| --- " * len(header) + "|"]
    results = {}
    for name, (model, extension, truncation, reads) in specs.items():
        seeds = [predictions(args, name, s) for s in range(1, args.seeds + 1)]
        seeds = [rows for rows in seeds if rows]

        def accuracy(keep):  # per seed, in %; none when no review is of that length
            if not any(keep(x) for rows in seeds for x, _, _ in rows):
                return []
            return [
                100 * sum(c for x, _, c in rows if keep(x)) / max(1, sum(1 for x, _, _ in rows if keep(x)))
                for rows in seeds
            ]

        cost = cost_of(args, name, trained[model, extension], reads)
        results[name] = dict(
            all=accuracy(lambda x: True), short=accuracy(lambda x: x <= n), long=accuracy(lambda x: x > n), **cost
        )
        results[name]["by_length"] = {
            label: dict(reviews=count, accuracy=accuracy(keep)) for (label, keep), count in zip(bins, reviews)
        }
        r = results[name]
        cells = [name, str(reads), truncation, mean_sd(r["all"]), mean_sd(r["short"]), mean_sd(r["long"])]
        lines.append("| " + " | ".join(cells + [f"{cost['seconds_per_update']:.3f}", f"{cost['peak_mb']:.0f}"]) + " |")
    lines += ["", "Masked-LM loss (bits/token) of the extended models on validation blocks of n' tokens:", ""]
    lines += [f"| model | n' | before: T={n} | before: T=n' | after: T={n} | after: T=n' |", "| --- " * 6 + "|"]
    for model, extension in trained:
        if extension:
            name = extended_name(args, model, *extension)
            found = json.loads((args.out / "extended" / name / "losses.json").read_text())
            before, after = ({int(k): v for k, v in found[s].items()} for s in ("extended", "continued"))
            long_n = n * extension[0]
            cells = [name, long_n, before[n], before[long_n], after[n], after[long_n]]
            lines.append("| " + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells) + " |")
    lines += ["", "Accuracy (mean of seeds) by review length, in tokens with <s> and </s>:", ""]
    lines += ["| run | " + " | ".join(label for label, _ in bins) + " |", "| --- " * (len(bins) + 1) + "|"]
    lines.append("| reviews | " + " | ".join(map(str, reviews)) + " |")
    for name, r in results.items():
        cells = [f"{statistics.mean(b['accuracy']):.1f}" if b["accuracy"] else "-" for b in r["by_length"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_text(args.out / "report.md", "\n".join(lines) + "\n")
    write_text(args.out / "results.json", json.dumps(results, indent=1))
    plot_by_length(results, args.out / "accuracy_by_length.png", n)
    print("\n".join(lines))


def length_bins(n, factors):
    """(label, keep) for review lengths split at n, 2n and each n'."""
    edges = sorted({n, 2 * n} | {n * f for f in factors})
    bins = [(f"<= {edges[0]}", lambda x: x <= edges[0])]
    bins += [(f"{lo + 1}-{hi}", lambda x, lo=lo, hi=hi: lo < x <= hi) for lo, hi in zip(edges, edges[1:])]
    return bins + [(f"> {edges[-1]}", lambda x: x > edges[-1])]


def plot_by_length(results, path, n):
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for name, r in results.items():
        bins = r["by_length"].items()
        points = [(f"{label}\n({b['reviews']})", statistics.mean(b["accuracy"])) for label, b in bins if b["accuracy"]]
        style = dict(linestyle="--") if f"-n{n}-" in name else dict(linewidth=2.5)  # truncated runs dashed
        ax.plot(*zip(*points), marker="o", label=name, **style)
    ax.set(xlabel="review length in tokens (reviews)", ylabel="test accuracy, mean of seeds (%)")
    ax.set_title(f"IMDB accuracy by review length (pretrained at n={n}; dashed: truncated to n)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def predictions(args, name, seed=1):
    path = args.out / "runs" / name / f"seed{seed}" / "predictions.json"
    return json.loads(path.read_text()) if path.exists() else []


def cost_of(args, name, checkpoint, reads):
    """Timing of an update at the length the run reads, measured once per model and length."""
    path = args.out / "timing" / f"{name}.json"
    if not path.exists():
        model, task = load(checkpoint, args.data_bin)
        write_text(path, json.dumps(update_cost(model, task, args.batch, reads, args.timing_seconds)))
    return json.loads(path.read_text())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = REPO.parent / "shared" / "data"
    a = p.add_argument
    a("--quality", type=Path, required=True, help="a quality study's --out folder with runs/roberta and runs/linformer")
    a("--imdb", type=Path, default=shared / "imdb" / "aclImdb_v1_text.tar.gz", help="aclImdb_v1 tarball")
    a("--out", type=Path, default=REPO / "work" / "long", help="output folder (default: work/long)")
    a("--models", nargs="+", default=["roberta", "linformer"], help="runs of the quality study to extend")
    a("--factors", nargs="+", type=int, default=[4], help="n' = factor x n (default: 4)")
    a(
        "--projections",
        nargs="+",
        choices=["periodic", "stretch"],
        default=["periodic"],
        help="how a Linformer's projections are extended (extend_max_positions.py --projections); "
        "each is its own run, named MODEL-nN'-stretch for stretch (default: periodic)",
    )
    a("--train-size", type=int, default=1000, help="IMDB training reviews, half of each class (default: 1000)")
    a("--test-size", type=int, default=1000, help="IMDB test reviews, half of each class (default: 1000)")
    a("--valid-size", type=int, default=200, help="training reviews held out for fairseq's validation")
    a("--epochs", type=int, default=2, help="finetuning epochs (default: 2)")
    a("--batch", type=int, default=8, help="reviews per update (default: 8)")
    a("--lr", type=float, default=1e-4, help="finetuning peak lr (default: 1e-4)")
    a("--seeds", type=int, default=3, help="finetuning seeds (default: 3)")
    a("--continue-updates", type=int, default=500, help="continued pretraining at n' (default: 500)")
    a("--continue-lr", type=float, default=1e-4, help="its peak lr (default: 1e-4)")
    a("--continue-tokens", type=int, default=4096, help="tokens per continued-pretraining update (default: 4096)")
    a("--eval-blocks", type=int, default=50, help="validation blocks of n' tokens for the loss table (default: 50)")
    a("--jobs", type=int, default=1, help="runs at once, each on --threads threads (default: 1)")
    a("--threads", type=int, default=0, help="threads per process, 0 for torch's default")
    a("--timing-seconds", type=float, default=10, help="timed updates per model last at least this long (default: 10)")
    a("--report-only", action="store_true", help="only write the report of what has finished")
    args = p.parse_args()
    for name in ("train_size", "test_size", "valid_size", "epochs", "batch", "seeds", "continue_updates", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.timing_seconds <= 0:
        p.error("--timing-seconds must be > 0")
    if any(f < 2 for f in args.factors):
        p.error("--factors must be >= 2 (n' = factor x n)")
    if not args.imdb.is_file():
        p.error(f"--imdb {args.imdb} not found")
    args.quality, args.out = args.quality.resolve(), args.out.resolve()
    args.data_bin = next(iter(sorted((args.quality / "data" / "data-bin").glob("shard*"))), None)
    if args.data_bin is None:
        p.error(f"--quality {args.quality} has no data/data-bin/shard*: not a quality study's folder")
    base, _ = load(base_checkpoint(args, args.models[0]), args.data_bin)
    args.n = base.max_positions()
    args.out.mkdir(parents=True, exist_ok=True)
    args.imdb_bin = prepare_imdb(args)
    args.kinds = {m: model_kind(base_checkpoint(args, m)) for m in args.models}
    specs = runs(args)
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in [pool.submit(do_run, args, name, spec) for name, spec in specs.items()]:
                done.result()
    trained = {(model, ext): checkpoint_of(args, model, ext) for model, ext, _, _ in specs.values()}
    report(args, specs, trained)


if __name__ == "__main__":
    main()
