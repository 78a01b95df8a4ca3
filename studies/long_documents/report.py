"""The long-document study's report: OUT/report.md (accuracy overall, by seed and by review
length, what the further training did, the Linformers' fidelity), OUT/results.json,
OUT/records.json (one record a seed: long_documents/records.py) and OUT/accuracy_by_length.png,
from whatever runs have finished."""

import json
import statistics

from linformer_tools.common import write_text
from linformer_tools.logs import records
from linformer_tools.models import pyplot, save_figure

from common import mean_sd
from long_documents.data import corpus_name, length_bins, test_lengths
from long_documents.records import seed_records
from long_documents.runs import cost_of, step_batch


def report(args, specs):
    n, corpus = args.n, corpus_name(args)
    what = f"{args.hf_dir} (imported, n={n})" if args.hf_dir else f"pretrained at n={n} ({args.quality})"
    further = (
        f"linearized with {' or '.join(map(str, args.linearize_steps))} distillation steps on the unlabeled "
        f"reviews of {corpus} ("
        + ", ".join(
            f"{args.linearize_tokens} tokens of running text a step"
            if on == "blocks"
            else f"{args.batch} whole reviews a step: runs named -docs"
            for on in args.linearize_on
        )  # fmt: skip
        + ")"
        if args.hf_dir
        else f"continued pretraining {args.continue_updates} updates at lr {args.continue_lr}"
    )
    lines = [
        f"Long-document study: {what}, {corpus} {args.train_size} train / {args.test_size} test reviews "
        f"(stratified, seed 1), {args.epochs} epochs, batch {args.batch}, lr {args.lr}, "
        f"seeds {args.first_seed}..{args.seeds}; {further}.",
        "",
    ]
    lengths = test_lengths(args)
    shares = ", ".join(
        f"longer than {m}: {100 * sum(x > m for x in lengths) / len(lengths):.1f}%"
        for m in sorted({n} | {n * f for f in args.factors})
    )
    lines += [f"Test reviews ({len(lengths)}, with <s> and </s>): {shares}.", ""]
    steps = ", ".join(f"{step_batch(args, m)} reviews a step at {m}" for m in sorted({r.reads for r in specs.values()}))
    lines += [f"An update of {args.batch} reviews in steps of at most {args.step_tokens} tokens: {steps}.", ""]
    bins = length_bins(n, args.factors)
    reviews = [sum(keep(x) for x in lengths) for _, keep in bins]
    header = ["run", "reads", "longer cut to", "accuracy", f"<= {n} tokens", f"> {n} tokens", "s/update", "peak MB"]
    lines += ["| " + " | ".join(header + ["docs/s"]) + " |", "| --- " * (len(header) + 1) + "|"]
    results = {}
    for name, run in specs.items():
        finished = {s: rows for s in range(1, args.seeds + 1) if (rows := predictions(args, name, s))}
        seeds = list(finished.values())
        if not seeds:  # not run yet
            continue

        def accuracy(keep):  # per seed, in %; none when no review is of that length
            if not any(keep(x) for rows in seeds for x, _, _ in rows):
                return []
            return [
                100 * sum(c for x, _, c in rows if keep(x)) / max(1, sum(1 for x, _, _ in rows if keep(x)))
                for rows in seeds
            ]

        cost = cost_of(args, name, run)
        results[name] = dict(
            all=accuracy(lambda x: True), short=accuracy(lambda x: x <= n), long=accuracy(lambda x: x > n), **cost
        )
        results[name]["by_length"] = {
            label: dict(reviews=count, accuracy=accuracy(keep)) for (label, keep), count in zip(bins, reviews)
        }
        results[name]["valid"] = [validation_accuracy(args, name, s) for s in finished]
        r = results[name]
        cells = [name, str(run.reads), f"{run.truncation} {run.reads}"]
        cells += [mean_sd(r["all"]), mean_sd(r["short"]), mean_sd(r["long"])]
        if cost:
            cells += [
                f"{cost['seconds_per_update']:.3f}",
                f"{cost['peak_mb']:.0f}",
                f"{cost['documents_per_second']:.1f}",
            ]
        else:
            cells += ["not timed"] * 3
        lines.append("| " + " | ".join(cells) + " |")
    lines += seeds_table(results)
    lines += further_training(args, specs, results)
    lines += fidelity_table(args, results, bins)
    lines += probe_table(args, specs, results)
    lines += ["", "Accuracy (mean of seeds) by review length, in tokens with <s> and </s>:", ""]
    lines += ["| run | " + " | ".join(label for label, _ in bins) + " |", "| --- " * (len(bins) + 1) + "|"]
    lines.append("| reviews | " + " | ".join(map(str, reviews)) + " |")
    for name, r in results.items():
        cells = [f"{statistics.mean(b['accuracy']):.1f}" if b["accuracy"] else "-" for b in r["by_length"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_text(args.out / "report.md", "\n".join(lines) + "\n")
    write_text(args.out / "results.json", json.dumps(results, indent=1))
    seeds = seed_records(args, specs, predictions, validation_accuracy)
    write_text(args.out / "records.json", json.dumps(seeds, indent=1))
    plot_by_length(results, args.out / "accuracy_by_length.png", n, corpus)
    print("\n".join(lines))


def predictions(args, name, seed=1):
    path = args.out / "runs" / name / f"seed{seed}" / "predictions.json"
    return json.loads(path.read_text()) if path.exists() else []


def validation_accuracy(args, name, seed):
    """The accuracy of a finetuning's last validation (fairseq's, on the --valid-size reviews), or
    None if it logged none."""
    found = records(args.out / "runs" / name / f"seed{seed}" / "hydra_train.log", "valid")
    return found[-1]["accuracy"] if found else None


def seeds_table(results):
    """The report's table of each seed's validation and test accuracy, and the test accuracy of the
    seed a user would keep: the one best on validation (where seeds differ by more than the runs
    do, it ranks runs as a user of one finetuning would meet them)."""
    lines = ["", "Seeds: accuracy on fairseq's validation reviews after the last epoch, and on the test reviews; "
             "the test accuracy of the seed best on validation:", "",
             "| run | validation, by seed | test, by seed | test, seed best on validation |",
             "| --- " * 4 + "|"]  # fmt: skip
    for name, r in results.items():
        valid = r["valid"]
        kept = max(range(len(valid)), key=lambda i: (valid[i] is not None, valid[i] or 0))  # first of ties
        r["test_of_best_on_validation"] = r["all"][kept]
        cells = [", ".join("-" if v is None else f"{v:.1f}" for v in valid), ", ".join(f"{a:.1f}" for a in r["all"]),
                 f"{r['all'][kept]:.1f}"]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def further_training(args, specs, results):
    """The report's table of what the further training did (each record also goes to results)."""
    made = {name: run for name, run in specs.items() if run.record and run.record.exists()}
    if not made:
        return []
    if args.hf_dir:
        lines = ["", "Linearization (linearize.py) at the length each run reads: mean cosine of the final hidden "
                 "states to the teacher's on held-out blocks, after each stage, and minutes per stage:", "",
                 "| run | converted | transfer | distillation | minutes |", "| --- " * 5 + "|"]  # fmt: skip
        for name, run in made.items():
            stages = json.loads(run.record.read_text())["stages"]
            if name in results:  # finetuned
                results[name]["linearize"] = {s: v["fidelity"]["cosine"] for s, v in stages.items()}
            cosines = [f"{stages[s]['fidelity']['cosine']:.3f}" if s in stages else "-" for s in
                       ("converted", "transfer", "distillation")]  # fmt: skip
            minutes = sum(v.get("seconds", 0) for v in stages.values()) / 60
            lines.append(f"| {name} | " + " | ".join(cosines) + f" | {minutes:.1f} |")
        return lines
    n = args.n
    lines = ["", "Masked-LM loss (bits/token) on validation blocks of the length each run reads, read whole and "
             f"cut into pieces of {n}, before and after the further pretraining:", "",
             f"| run | before: T={n} | before: T=n' | after: T={n} | after: T=n' |", "| --- " * 5 + "|"]  # fmt: skip
    for name, run in made.items():
        found = json.loads(run.record.read_text())
        if "after" not in found:
            continue
        before, after = ({int(k): v for k, v in found[s].items()} for s in ("before", "after"))
        if name in results:
            results[name]["losses"] = found
        cells = [before[args.n], before[run.reads], after[args.n], after[run.reads]]
        lines.append(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return lines


def probe_table(args, specs, results):
    """The report's table of the linear probes (--probe), beside what finetuning reached if it ran
    (the probe also goes to results, for a finetuned run)."""
    measured = {name: json.loads(path.read_text()) for name in specs
                if (path := args.out / "probe" / f"{name}.json").is_file()}  # fmt: skip
    if not measured:
        return []
    n = args.n
    lines = ["", "Linear probe (--probe): a logistic regression on the frozen model's final hidden states "
             "averaged over each review (before finetuning), fit on the training reviews as the run reads them, "
             "the L2 penalty picked on the validation reviews; test accuracy beside finetuning's (mean of seeds):",
             "", f"| run | L2 penalty | validation | test | <= {n} tokens | > {n} tokens | <s> alone: validation, test "
             "| finetuned |", "| --- " * 8 + "|"]  # fmt: skip
    for name, found in measured.items():

        def accuracy(keep, rows=found["test"]):
            picked = [right for x, right in rows if keep(x)]
            return 100 * sum(picked) / len(picked) if picked else None

        probe = dict(penalty=found["penalty"], valid=found["valid"], all=accuracy(lambda x: True),
                     short=accuracy(lambda x: x <= n), long=accuracy(lambda x: x > n))  # fmt: skip
        if name in results:
            results[name]["probe"] = probe
        cells = [f"{probe[key]:.1f}" if probe[key] is not None else "-" for key in ("valid", "all", "short", "long")]
        first = found.get("first")  # probes made before <s> was probed too have none
        first = f"{first['valid']:.1f}, {accuracy(lambda x: True, first['test']):.1f}" if first else "-"
        cells = [f"{found['penalty']:g}", *cells, first, mean_sd(results[name]["all"]) if name in results else "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def fidelity_table(args, results, bins):
    """The report's table of the finetuned Linformers' fidelity on test reviews by length (also to results)."""
    measured = {name: json.loads(path.read_text()) for name in results
                if (path := args.out / "fidelity" / f"{name}.json").is_file()}  # fmt: skip
    if not measured:
        return []
    lines = ["", "Fidelity on test reviews (the first of each length bin that the run reads whole; before "
             "finetuning): mean cosine of the final hidden states, token by token, to the original's at the same "
             "length (full attention); in brackets, the reviews:", "",
             "| run | " + " | ".join(label for label, _ in bins) + " |", "| --- " * (len(bins) + 1) + "|"]  # fmt: skip
    for name, found in measured.items():
        results[name]["fidelity_by_length"] = found["bins"]
        cells = [f"{b['cosine']:.4f} ({b['reviews']})" if b["reviews"] else "-" for b in found["bins"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot_by_length(results, path, n, corpus):
    fig, ax = pyplot().subplots(figsize=(8, 5))
    for name, r in results.items():
        bins = r["by_length"].items()
        points = [(f"{label}\n({b['reviews']})", statistics.mean(b["accuracy"])) for label, b in bins if b["accuracy"]]
        style = dict(linestyle="--") if f"-n{n}-" in name else dict(linewidth=2.5)  # truncated runs dashed
        ax.plot(*zip(*points), marker="o", label=name, **style)
    ax.set(xlabel="review length in tokens (reviews)", ylabel="test accuracy, mean of seeds (%)")
    ax.set_title(f"{corpus} accuracy by review length (dashed: reads n={n} tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
