#!/usr/bin/env python3
"""Print the finetuning results as a table like the Linformer paper's Table 2.

Reads ROOT/<model>/<task>/seed<S>/ as scripts/finetune.sh and scripts/slurm/finetune.sbatch
write them: hydra_train.log (fairseq's json log) and .hydra/config.yaml (the run's config,
which names the metric: accuracy, or mcc for CoLA, pearson for STS-B). Each cell is the best
dev score of a run, as mean +- standard deviation over its seeds (n runs); Average is the mean
of a row's cells when every column has a score.

With --quickstart PRETRAIN_DIR FINETUNE_DIR, it prints the quickstart's summary instead.
"""

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

import yaml

from linformer_tools.common import fail
from linformer_tools.logs import records

# the paper's Table 2 columns first, then the rest of GLUE
TASK_ORDER = ["sst_2", "imdb", "qnli", "qqp", "mnli", "mrpc", "rte", "cola", "sts_b"]
TITLES = {"sst_2": "SST-2", "sts_b": "STS-B", "cola": "CoLA"}


def best_dev_score(run: Path):
    """(metric, best dev score, number of validations) of one finetuning run."""
    config_file = run / ".hydra" / "config.yaml"
    if not config_file.is_file():
        fail(f"{config_file} is missing: {run} is not a fairseq-hydra-train run")
    checkpoint = yaml.safe_load(config_file.read_text())["checkpoint"]
    metric, maximize = checkpoint["best_checkpoint_metric"], checkpoint["maximize_best_checkpoint_metric"]
    log = run / "hydra_train.log"
    try:
        scores = [float(r[metric]) for r in records(log, "valid") if metric in r]
    except ValueError as e:
        fail(f"{log}: unreadable validation record ({e})")
    if not scores:
        return metric, None, 0
    return metric, (max if maximize else min)(scores), len(scores)


def collect(root: Path):
    """{model: {task: [best score per seed]}} and {task: metric}."""
    scores, metrics = defaultdict(lambda: defaultdict(list)), {}
    for log in sorted(root.glob("*/*/seed*/hydra_train.log")):
        run = log.parent
        model, task = run.parent.parent.name, run.parent.name
        metric, score, validations = best_dev_score(run)
        if score is None:
            print(f"skipped {run}: no validation yet", file=sys.stderr)
            continue
        if metrics.setdefault(task, metric) != metric:
            fail(f"{run} reports {metric}, other {task} runs {metrics[task]}")
        scores[model][task].append(score)
    if not scores:
        fail(
            f"no finetuning runs with a validation under {root} (expected "
            f"{root}/<model>/<task>/seed<S>/hydra_train.log, as scripts/finetune.sh writes)"
        )
    return scores, metrics


def cell(values):
    mean = statistics.mean(values)
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.1f} ± {spread:.1f} ({len(values)})"


def table(scores, metrics) -> str:
    tasks = [t for t in TASK_ORDER if t in metrics] + sorted(set(metrics) - set(TASK_ORDER))
    header = ["model"] + [f"{TITLES.get(t, t.upper())} ({metrics[t]})" for t in tasks] + ["Average"]
    rows = [header, ["---"] * len(header)]
    for model in sorted(scores):
        runs = scores[model]
        means = [statistics.mean(runs[t]) for t in tasks if runs.get(t)]
        average = f"{statistics.mean(means):.2f}" if len(means) == len(tasks) else "-"
        rows.append([model] + [cell(runs[t]) if runs.get(t) else "-" for t in tasks] + [average])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def quickstart_summary(pretrain: Path, finetune: Path, dev_tsv: Path) -> str:
    """Validation loss and perplexity of the pretraining, SST-2 dev accuracy against the
    majority class, and where the outputs are."""
    loss = records(pretrain / "hydra_train.log", "valid")
    accuracy = [r["accuracy"] for r in records(finetune / "hydra_train.log", "valid")]
    if not (loss and accuracy):
        fail(f"no validation results in {pretrain}/hydra_train.log and {finetune}/hydra_train.log")
    labels = Counter(line.rsplit("\t", 1)[-1] for line in dev_tsv.read_text().splitlines()[1:])
    first, last = loss[0], loss[-1]
    return "\n".join(
        [
            f"pretraining validation loss: {first['loss']:.3f} -> {last['loss']:.3f} (base 2; "
            f"perplexity {first['ppl']:.1f} -> {last['ppl']:.1f}, {len(loss)} validations)",
            f"SST-2 dev accuracy: {accuracy[-1]:.1f}% after the last epoch, best {max(accuracy):.1f}% "
            f"(majority class: {100 * max(labels.values()) / sum(labels.values()):.1f}%)",
            f"checkpoints: {pretrain}/ and {finetune}/",
            f"tensorboard: tensorboard --logdir {pretrain.parent}",
            f"logs: {pretrain}/hydra_train.log and {finetune}/hydra_train.log",
        ]
    )


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "root",
        type=Path,
        nargs="?",
        default=Path("checkpoints/finetune"),
        help="the finetuning runs' root folder (default: checkpoints/finetune)",
    )
    p.add_argument(
        "--quickstart",
        nargs=2,
        type=Path,
        metavar=("PRETRAIN_DIR", "FINETUNE_DIR"),
        help="print the quickstart's summary of these two runs instead",
    )
    p.add_argument("--dev-tsv", type=Path, help="with --quickstart: SST-2 dev.tsv, for the majority class")
    return p


def main():
    args = build_parser().parse_args()
    if args.quickstart:
        if not (args.dev_tsv and args.dev_tsv.is_file()):
            fail(f"--quickstart needs --dev-tsv, an SST-2 dev.tsv (got {args.dev_tsv})")
        print(quickstart_summary(*args.quickstart, args.dev_tsv))
        return
    if not args.root.is_dir():
        fail(f"{args.root} is not a folder")
    print(table(*collect(args.root)))


if __name__ == "__main__":
    main()
