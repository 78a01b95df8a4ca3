"""Long-document study: on IMDB, does a model that reads whole reviews beat one that reads their
truncated n tokens? (docs/long_documents.md has the method and the results.)

Two kinds of models, one mode each:

  --hf-dir HF_DIR   an encoder imported from transformers (all-MiniLM-L6-v2: n = 512). The
                    original reads n tokens (head, and head+tail truncation) and is extended to
                    n' with full attention (scripts/extend_max_positions.py, positions copied
                    periodically); Linformers of it are made at each n' by scripts/linearize.py
                    on IMDB's unlabeled reviews, the teacher being the original extended to n'
                    the same way, with each k of --ks (a number, or n/D: k growing with n')
  --quality DIR     the RoBERTa and Linformer a quality study (scripts/study_quality.py --out
                    DIR) pretrained at n: each extended to n' and pretrained further at n'
                    (scripts/pretrain.sh --from CHECKPOINT extend), a Linformer for each
                    --projections way of extending its projections

--control (--hf-dir only, for now) adds each Linformer's linearization at n followed by
head+tail truncation: whatever it gains is not from reading more.
Folders of further training carry its length (-uUPDATES, -sSTEPS), so another length is
another run.

Steps, each skipped when its output exists (a killed study resumes where it stopped):

1. data: a fixed stratified IMDB subset (data-prep/imdb.sh --train-size/--test-size), reviews
   kept whole, in the models' tokens (and with --hf-dir, train/unsup as text for linearize.py);
2. the models each run finetunes (above);
3. runs: finetuned with scripts/finetune.sh imdb over --seeds seeds (reviews longer than the
   model reads cut head+tail: the first n/4 tokens and the rest from the end, as Sun et al.
   2019); each final model predicts the test subset: accuracy overall and by review length,
   and that of the seed best on fairseq's validation reviews (what a user keeping one of
   several finetunings would get);
4. the cost at the length each run reads, measured alone after the runs: seconds per
   finetuning update (--batch documents, in steps of at most --step-tokens tokens) and the peak
   memory of a step, documents per second when predicting; with --hf-dir, each Linformer's
   fidelity to the original on test reviews by length (measured when the run is run: a finished
   run named in --runs gets it too); OUT/report.md, OUT/results.json and OUT/accuracy_by_length.png.
"""

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from linformer_tools import checkpoints
from linformer_tools.common import REPO, fail, write_text
from linformer_tools.logs import records
from linformer_tools.models import pyplot, save_figure
from linformer_tools.study import context_losses, finetuning_cost, load, log, mean_sd, sh

SCRIPTS = REPO / "scripts"


@dataclass
class Run:
    """A finetuning run: the checkpoint it starts from (``pretrained()`` makes it if missing),
    the length it reads and how longer reviews are cut, what the further training recorded
    (losses.json of continued pretraining, report.json of a linearization) if any, hydra
    overrides of its finetuning, and a check that what it starts from was made as asked (run
    before anything runs)."""

    pretrained: Callable[[], Path]
    reads: int
    truncation: str
    record: Path = None
    overrides: tuple[str, ...] = ()
    check: Callable[[], object] = lambda: None


# ---------------------------------------------------------------- data and the models at n


def prepare_imdb(args):
    if args.hf_dir:
        encoder, srcdict = args.original / "tokenizer.json", args.original / "dict.txt"
        unlabeled = ["--unlabeled", args.unlabeled]
    else:
        encoder, srcdict = args.quality / "data" / "spm" / "spm.model", args.quality / "data" / "spm" / "dict.txt"
        unlabeled = []
    sh(
        [REPO / "data-prep" / "imdb.sh", "--tarball", args.imdb, "--destdir", args.out / "data", "--workers", 2]
        + ["--spm-model", encoder, "--srcdict", srcdict, *unlabeled]
        + ["--train-size", args.train_size, "--test-size", args.test_size, "--valid-size", args.valid_size]
    )
    return args.out / "data" / "IMDB-bin"


def import_original(args):
    """The transformers encoder as a fairseq checkpoint (OUT/original: model.pt, dict.txt, tokenizer.json)."""
    if not (args.out / "original.log").exists():
        log(f"importing {args.hf_dir}")
        sh([sys.executable, SCRIPTS / "import_hf.py", args.hf_dir, "--out", args.original, "--overwrite"],
           args.out / "original.log")  # fmt: skip
    return args.original / "model.pt"


def base_checkpoint(args, model):
    if args.hf_dir:
        return args.original / "model.pt"
    path = args.quality / "runs" / model / "checkpoints" / "checkpoint_last.pt"
    if not path.exists():
        fail(f"{path} not found: run the quality study's {model} run first (see --help)")
    return path


def model_kind(path):
    return checkpoints.model_kind(checkpoints.read_checkpoint(path), path)


# ---------------------------------------------------------------- further training


def extended(args, model, long_n, projections="periodic"):
    """The model extended to n' positions (no further training); returns its checkpoint."""
    suffix = "" if projections == "periodic" else f"-{projections}"
    path = args.out / "extended" / f"{model}-n{long_n}{suffix}.pt"
    if not path.with_suffix(".log").exists():
        log(f"{model}: extending to n'={long_n}")
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, SCRIPTS / "extend_max_positions.py", base_checkpoint(args, model), path]
        sh(cmd + ["--max-positions", long_n, "--projections", projections], path.with_suffix(".log"), args.threads)
    return path


def continued_folder(args, model, long_n, projections):
    """The continuation's folder, named by its length (-uUPDATES) so that another length is another run."""
    suffix = "" if projections == "periodic" else f"-{projections}"
    return args.out / "continued" / f"{model}-n{long_n}{suffix}-u{args.continue_updates}"


def continued(args, model, long_n, projections):
    """The model extended to n' and pretrained args.continue_updates more updates at n'; returns the checkpoint."""
    work = continued_folder(args, model, long_n, projections)
    work.mkdir(parents=True, exist_ok=True)
    start = extended(args, model, long_n, projections)
    losses = work / "losses.json"
    found = json.loads(losses.read_text()) if losses.exists() else {}
    if "before" not in found:
        found["before"] = long_losses(args, start, long_n)
        write_text(losses, json.dumps(found, indent=1))
    out = work / "checkpoints"
    if not (work / "continue.log").exists():
        log(f"{model}: continued pretraining at n={long_n}, {args.continue_updates} updates")
        batch = max(1, args.continue_tokens // long_n)
        every = max(1, args.continue_updates // 4)
        sh(
            [SCRIPTS / "pretrain.sh", "--cpu", "--batch-size", batch, "--global-batch", batch]
            + ["--save-dir", out, "--from", start, "extend", args.data_bin]
            + [f"optimization.max_update={args.continue_updates}", f"optimization.lr=[{args.continue_lr}]"]
            + [f"lr_scheduler.warmup_updates={max(1, args.continue_updates // 10)}", "dataset.num_workers=0"]
            + [f"checkpoint.save_interval_updates={every}", "checkpoint.keep_interval_updates=1"]
            + ["common.log_format=simple", f"common.log_interval={every}", "dataset.max_valid_steps=8"],
            work / "continue.log",
            threads=args.threads,
        )
    if "after" not in found:
        found["after"] = long_losses(args, out / "checkpoint_last.pt", long_n)
        write_text(losses, json.dumps(found, indent=1))
    return out / "checkpoint_last.pt"


def long_losses(args, checkpoint, long_n):
    """Masked-LM bits/token on validation blocks of n' tokens read whole and cut at n."""
    model, task = load(checkpoint, args.data_bin)
    return context_losses(model, task, long_n, sorted({args.n, long_n}), args.eval_blocks)


def linearize_folder(args, long_n, k, on, steps):
    return args.out / "linearized" / f"n{long_n}-k{k}-s{steps}{'-docs' if on == 'documents' else ''}"


def linearize_recipe(args, long_n, k, on, steps):
    """linearize.py's flags for this folder (its paths aside). The folder's name holds n', k, steps
    and text only, so one made with other flags is refused, not reused (folders made before the
    recipe was recorded are accepted)."""
    out = linearize_folder(args, long_n, k, on, steps)
    batch = args.batch if on == "documents" else max(1, args.linearize_tokens // long_n)
    # resample: the runs' default when they were made
    recipe = ["--max-positions", long_n, "--k", k, "--no-export", "--distill-steps", steps, "--batch-blocks", batch,
              *(["--documents"] if on == "documents" else []), "--transfer-steps", args.transfer_steps,
              "--valid-blocks", args.valid_blocks, "--compress-length-norm", "resample",
              *args.linearize_flags]  # fmt: skip
    recipe = [str(flag) for flag in recipe]
    recorded = out.with_suffix(".recipe.json")
    if recorded.is_file() and json.loads(recorded.read_text()) != recipe:
        fail(
            f"{out} was made with {' '.join(json.loads(recorded.read_text()))}, not {' '.join(recipe)} "
            "(other --linearize-flags, --transfer-steps, --batch?): use another --out, or delete it to remake it"
        )
    return recipe


def linearized(args, long_n, k, on, steps):
    """A Linformer of the imported encoder at n' positions with projected length k, made by
    linearize.py on IMDB's unlabeled reviews (on blocks: --linearize-tokens tokens of running
    text a step; on documents: --batch whole reviews a step); returns its checkpoint."""
    out, recipe = linearize_folder(args, long_n, k, on, steps), linearize_recipe(args, long_n, k, on, steps)
    if not out.with_suffix(".log").exists():
        log(f"linearizing at n={long_n}, k={k}, {steps} steps on {on}")
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text(out.with_suffix(".recipe.json"), json.dumps(recipe) + "\n")
        sh([sys.executable, SCRIPTS / "linearize.py", args.hf_dir, "--text", args.unlabeled, "--out", out, *recipe],
           out.with_suffix(".log"), args.threads)  # fmt: skip
    return out / "checkpoint.pt"


def read_exact(checkpoint):
    """CHECKPOINT's Linformer with its projections switched to ``exact`` length handling (a
    review of at most k tokens is read with each token its own key and value; longer ones as
    before), written to exact/checkpoint.pt beside it: the same weights, no further training."""
    out = checkpoint.parent / "exact" / "checkpoint.pt"
    if not out.is_file():
        out.parent.mkdir(exist_ok=True)
        sh([sys.executable, SCRIPTS / "extend_max_positions.py", checkpoint, out, "--compress-length-norm", "exact"],
           out.parent / "switch.log")  # fmt: skip
    return out


def k_at(spec, long_n):
    """--ks entry at n': a number, or n/D (D a divisor)."""
    return long_n // int(spec[2:]) if spec.startswith("n/") else int(spec)


# ---------------------------------------------------------------- runs


def runs(args):
    """name -> Run, in the order the report lists them."""
    n, found = args.n, {}
    for model in args.models:
        base = base_checkpoint(args, model)
        for truncation in ("head", "head_tail"):
            found[f"{model}-n{n}-{truncation}"] = Run(lambda base=base: base, n, truncation)
    longer = [n * f for f in args.factors]
    if args.hf_dir:
        for long_n in longer:  # full attention, no further training
            found[f"original-n{long_n}"] = Run(lambda m=long_n: extended(args, "original", m), long_n, "head_tail")
        for long_n in ([n] if args.control else []) + longer:
            ks = dict.fromkeys(k_at(spec, long_n) for spec in args.ks)
            for how in itertools.product([long_n], ks, args.linearize_on, args.linearize_steps):
                folder = linearize_folder(args, *how)
                name = f"linformer-{folder.name}" + ("-head_tail" if long_n == n else "")
                made = lambda how=how: linearized(args, *how)  # noqa: E731
                check = lambda how=how: linearize_recipe(args, *how)  # noqa: E731
                found[name] = Run(made, long_n, "head_tail", folder / "report.json", check=check)
                if args.read_exact and long_n != n:
                    exact = lambda made=made: read_exact(made())  # noqa: E731
                    found[f"{name}-exact"] = Run(exact, long_n, "head_tail", check=check)
                    for p in args.resample_probs:
                        mixed = (f"++model.compress_resample_prob={p}",)
                        found[f"{name}-exact-resample{p:g}"] = Run(exact, long_n, "head_tail", overrides=mixed,
                                                                   check=check)  # fmt: skip
        return found
    for model in args.models:  # a RoBERTa has no projections: one extension (--control: --hf-dir only)
        for long_n in longer:
            for projections in args.projections if args.kinds[model] == "linformer" else ["periodic"]:
                folder = continued_folder(args, model, long_n, projections)
                make = lambda m=model, ln=long_n, p=projections: continued(args, m, ln, p)  # noqa: E731
                found[folder.name] = Run(make, long_n, "head_tail", folder / "losses.json")
    return found


def finetune(args, name, run, seed):
    out = args.out / "runs" / name / f"seed{seed}"
    if (out / "predictions.json").exists():
        return
    checkpoint = run.pretrained()
    total = -(-args.train_size // args.batch) * args.epochs
    step = step_batch(args, run.reads)
    if not (out.parent / f"seed{seed}.log").exists():
        log(f"{name}: finetuning, seed {seed}")
        out.parent.mkdir(parents=True, exist_ok=True)
        sh(
            [SCRIPTS / "finetune.sh", "--cpu", "--batch-size", step, "--global-batch", args.batch]
            + ["--data", args.imdb_bin, "--seed", seed, "--save-dir", out, "imdb", checkpoint]
            + [f"truncation={run.truncation}", f"++task.truncation_head_tokens={args.n // 4}"]
            + [f"optimization.max_epoch={args.epochs}", f"optimization.max_update={total}"]
            + [f"optimization.lr=[{args.lr}]", f"lr_scheduler.warmup_updates={max(1, total * 6 // 100)}"]
            # every review of a step fits: the same reviews per update at every length
            + [f"dataset.max_tokens={step * run.reads}", "dataset.num_workers=0"]
            + ["common.log_format=simple", f"common.log_interval={max(1, total // 20)}", *run.overrides],
            out.parent / f"seed{seed}.log",
            threads=args.threads,
        )
    write_text(out / "predictions.json", json.dumps(predict(args, out / "checkpoint_last.pt")))
    for path in out.glob("checkpoint*.pt"):  # the predictions are what the report needs
        path.unlink()


def predict(args, checkpoint):
    """Test reviews as the finetuned model reads them (its truncation): (length, label, correct),
    in the test set's order."""
    import torch
    from fairseq.data import data_utils

    model, task = load(checkpoint, args.imdb_bin)
    task.load_dataset("test")
    dataset = task.datasets["test"]
    reviews = data_utils.load_indexed_dataset(str(args.imdb_bin / "input0" / "test"), task.source_dictionary)
    by_length = sorted(range(len(dataset)), key=lambda i: reviews.sizes[i])  # batches padded to a close length
    rows = {}
    with torch.no_grad():
        for start in range(0, len(dataset), 16):
            sample = dataset.collater([dataset[i] for i in by_length[start : start + 16]])
            logits, _ = model(
                **sample["net_input"], features_only=True, classification_head_name="sentence_classification_head"
            )
            labels = sample["target"].view(-1).tolist()
            for i, guess, label in zip(sample["id"].tolist(), logits.argmax(-1).tolist(), labels):
                rows[i] = (int(reviews.sizes[i]) + 1, label, guess == label)  # + <s>
    return [rows[i] for i in range(len(dataset))]


def do_run(args, name, run):
    for seed in range(args.first_seed, args.seeds + 1):
        finetune(args, name, run, seed)
    if args.hf_dir and name.startswith("linformer-") and args.fidelity_reviews:
        fidelity_by_length(args, name, run)


# ---------------------------------------------------------------- report


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
    lines += ["", "Accuracy (mean of seeds) by review length, in tokens with <s> and </s>:", ""]
    lines += ["| run | " + " | ".join(label for label, _ in bins) + " |", "| --- " * (len(bins) + 1) + "|"]
    lines.append("| reviews | " + " | ".join(map(str, reviews)) + " |")
    for name, r in results.items():
        cells = [f"{statistics.mean(b['accuracy']):.1f}" if b["accuracy"] else "-" for b in r["by_length"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    write_text(args.out / "report.md", "\n".join(lines) + "\n")
    write_text(args.out / "results.json", json.dumps(results, indent=1))
    plot_by_length(results, args.out / "accuracy_by_length.png", n, corpus)
    print("\n".join(lines))


def corpus_name(args):
    """IMDB for aclImdb's own tarball, else the tarball's name: data-prep/polarity.sh writes Pang &
    Lee's reviews in the same layout, and a report on them must not say IMDB."""
    return "IMDB" if args.imdb.name.startswith("aclImdb") else args.imdb.name


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


def fidelity_by_length(args, name, run):
    """What reading through the projection costs, by review length, on test reviews (never
    distilled on), the first --fidelity-reviews of each bin; OUT/fidelity/NAME.json (remade when
    --fidelity-reviews changes)."""
    path = args.out / "fidelity" / f"{name}.json"
    if path.is_file() and json.loads(path.read_text())["reviews_a_bin"] == args.fidelity_reviews:
        return
    import linearize  # its fidelity(): the measure of the linearization's own report
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"{name}: fidelity on test reviews by length")
    teacher = extended(args, "original", run.reads) if run.reads > args.n else base_checkpoint(args, "original")
    student, teacher = linearize.load(run.pretrained())[0], linearize.load(teacher)[0]
    reviews = test_reviews(args, run.reads)
    found = {}
    for label, keep in length_bins(args.n, args.factors):
        picked = sorted([r for r in reviews if keep(len(r))][: args.fidelity_reviews], key=len)  # less padding
        cosine = None
        if picked:
            rows = torch.nn.utils.rnn.pad_sequence(picked, batch_first=True, padding_value=linearize.PAD)
            cosine = linearize.fidelity(student, teacher, rows)["cosine"]
        found[label] = dict(reviews=len(picked), cosine=cosine)
    write_text(path, json.dumps(dict(reviews_a_bin=args.fidelity_reviews, bins=found), indent=1))


def test_reviews(args, reads):
    """The test reviews of at most READS tokens as the models read them (<s> review </s>), in the
    test set's order."""
    import torch
    from fairseq.data import data_utils

    reviews = data_utils.load_indexed_dataset(str(args.imdb_bin / "input0" / "test"))
    bos = torch.tensor([0])  # <s>: sentence prediction prepends it; the review ends with </s>
    return [torch.cat([bos, reviews[i].long()]) for i in range(len(reviews)) if reviews.sizes[i] + 1 <= reads]


def length_bins(n, factors):
    """(label, keep) for review lengths split at n, 2n and each n'."""
    edges = sorted({n, 2 * n} | {n * f for f in factors})
    bins = [(f"<= {edges[0]}", lambda x: x <= edges[0])]
    bins += [(f"{lo + 1}-{hi}", lambda x, lo=lo, hi=hi: lo < x <= hi) for lo, hi in zip(edges, edges[1:])]
    return bins + [(f"> {edges[-1]}", lambda x: x > edges[-1])]


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


def test_lengths(args):
    """Each test review's length as the models see it whole (with <s> and </s>)."""
    from fairseq.data import data_utils

    reviews = data_utils.load_indexed_dataset(str(args.imdb_bin / "input0" / "test"))
    return [int(size) + 1 for size in reviews.sizes]  # read while the dataset (its memory map) is open


def predictions(args, name, seed=1):
    path = args.out / "runs" / name / f"seed{seed}" / "predictions.json"
    return json.loads(path.read_text()) if path.exists() else []


def cost_of(args, name, run):
    """Finetuning and prediction cost at the length the run reads, measured once per run ({} under
    --no-timing when not measured yet)."""
    path = args.out / "timing" / f"{name}.json"
    if not path.exists() and args.no_timing:
        return {}
    if not path.exists():
        model, task = load(run.pretrained(), args.original if args.hf_dir else args.data_bin)  # its dict.txt
        step = step_batch(args, run.reads)
        cost = finetuning_cost(model, task, step, run.reads, args.timing_seconds)
        cost["seconds_per_update"] *= args.batch // step  # an update is batch // step steps
        write_text(path, json.dumps({**cost, "reviews_per_step": step}))
    return json.loads(path.read_text())


def step_batch(args, reads):
    """Reviews a finetuning step holds at this length: --batch, fewer past --step-tokens (an update
    then takes several steps): the original at n' = 2048 with full attention, 8 reviews a step,
    was killed for memory at 16 GB."""
    step = max(1, min(args.batch, args.step_tokens // reads))
    while args.batch % step:
        step -= 1
    return step


# ---------------------------------------------------------------- command line


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = REPO.parent / "shared" / "data"
    a = p.add_argument
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--hf-dir", type=Path, help="a transformers encoder folder (e.g. all-MiniLM-L6-v2)")
    mode.add_argument("--quality", type=Path, help="a quality study's --out folder (runs/roberta, runs/linformer)")
    a("--imdb", type=Path, default=shared / "imdb" / "aclImdb_v1_text.tar.gz", help="aclImdb_v1 tarball")
    a("--out", type=Path, default=REPO / "work" / "long", help="output folder (default: work/long)")
    a("--factors", nargs="+", type=int, default=[4], help="n' = factor x n (default: 4)")
    a("--control", action="store_true", help="--hf-dir: also each linearization at n, then head+tail truncation")
    a("--train-size", type=int, default=1000, help="training reviews, half of each class (default: 1000)")
    a("--test-size", type=int, default=1000, help="test reviews, half of each class (default: 1000)")
    a("--valid-size", type=int, default=200, help="training reviews held out for fairseq's validation")
    a("--epochs", type=int, default=2, help="finetuning epochs (default: 2)")
    a("--batch", type=int, default=8, help="reviews per update (default: 8)")
    a("--step-tokens", type=int, default=4096,
      help="tokens a finetuning step holds: at longer lengths an update of --batch reviews takes several steps, "
           "each of fewer reviews; the cost is measured on one step (default: 4096)")  # fmt: skip
    a("--lr", type=float, default=1e-4, help="finetuning peak lr (default: 1e-4)")
    a("--seeds", type=int, default=3, help="finetuning seeds (default: 3)")
    a("--first-seed", type=int, default=1,
      help="finetune seeds FIRST..--seeds only: a study continued in another folder (default: 1)")  # fmt: skip
    g = p.add_argument_group("--hf-dir: linearization (scripts/linearize.py)")
    g.add_argument("--ks", nargs="+", default=["128", "n/4"], help="k at each n': a number or n/D (default: 128 n/4)")
    g.add_argument(
        "--linearize-steps",
        nargs="+",
        type=int,
        default=[300],
        help="distillation steps, each its own run (-sSTEPS; 0: the converted model; default: 300)",
    )
    g.add_argument("--linearize-tokens", type=int, default=2048, help="tokens a distillation step (default: 2048)")
    g.add_argument("--linearize-on", nargs="+", choices=["blocks", "documents"], default=["blocks"],
                   help="distil on blocks of n' tokens of running text, or on whole reviews as finetuning reads "
                   "them (--batch a step; runs named ...-docs); each is its own run (default: blocks)")  # fmt: skip
    g.add_argument("--transfer-steps", type=int, default=100, help="attention transfer steps a layer (default: 100)")
    g.add_argument("--valid-blocks", type=int, default=8, help="held-out blocks for the fidelity (default: 8)")
    g.add_argument("--fidelity-reviews", type=int, default=24,
                   help="test reviews a length bin on which each Linformer's fidelity to the original is reported "
                   "(0: none; default: 24)")  # fmt: skip
    g.add_argument("--read-exact", action="store_true",
                   help="also each Linformer at n' switched to compress_length_norm exact before finetuning: "
                   "a review of at most k tokens read with each token its own key and value, not E stretched "
                   "over it (runs named ...-exact)")  # fmt: skip
    g.add_argument("--resample-probs", nargs="+", type=float, default=[], metavar="P",
                   help="with --read-exact: also each -exact run finetuned with --compress-resample-prob P (a "
                   "review that fits k read through the projection with probability P, so that finetuning also "
                   "sees the reading longer reviews get; runs named ...-exact-resampleP)")  # fmt: skip
    g.add_argument("--linearize-flags", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the command line goes to linearize.py, after --compress-length-norm "
                   "resample (the study's runs were made under it; exact from the start: its own --out)")  # fmt: skip
    g = p.add_argument_group("--quality")
    g.add_argument("--models", nargs="+", default=["roberta", "linformer"], help="runs of the quality study to extend")
    g.add_argument(
        "--projections",
        nargs="+",
        choices=["periodic", "stretch"],
        default=["periodic"],
        help="how a Linformer's projections are extended (extend_max_positions.py --projections); "
        "each is its own run, named MODEL-nN'-stretch-u... for stretch (default: periodic)",
    )
    g.add_argument("--continue-updates", type=int, default=500, help="continued pretraining updates (default: 500)")
    g.add_argument("--continue-lr", type=float, default=1e-4, help="its peak lr (default: 1e-4)")
    g.add_argument("--continue-tokens", type=int, default=4096, help="tokens per continued update (default: 4096)")
    g.add_argument("--eval-blocks", type=int, default=50, help="validation blocks for the loss table (default: 50)")
    a("--jobs", type=int, default=1, help="runs at once, each on --threads threads (default: 1)")
    a("--threads", type=int, default=0, help="threads per process, 0 for torch's default")
    a("--timing-seconds", type=float, default=10, help="timed updates per run last at least this long (default: 10)")
    a(
        "--no-timing",
        action="store_true",
        help="report runs not yet timed without their cost (timings taken while other jobs share the CPU are noise)",
    )
    a("--runs", nargs="+", metavar="NAME", help="only these runs, in this order (default: all; names as the report's)")
    a("--report-only", action="store_true", help="only write the report of what has finished")
    args = p.parse_args()
    positive = ["train_size", "test_size", "valid_size", "epochs", "batch", "step_tokens", "seeds", "jobs"]
    positive += ["continue_updates", "first_seed"]
    for name in positive + ["linearize_tokens", "valid_blocks"]:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.fidelity_reviews < 0:
        p.error("--fidelity-reviews must be >= 0")
    if args.first_seed > args.seeds:
        p.error(f"--first-seed {args.first_seed} is past --seeds {args.seeds}: no seed to finetune")
    if args.resample_probs and not args.read_exact:
        p.error("--resample-probs makes variants of the -exact runs: add --read-exact")
    if any(not 0 < prob <= 1 for prob in args.resample_probs):
        p.error("--resample-probs must be in (0, 1]")
    if min(args.linearize_steps) < 0:
        p.error("--linearize-steps must be >= 0")
    if args.timing_seconds <= 0:
        p.error("--timing-seconds must be > 0")
    if any(f < 2 for f in args.factors):
        p.error("--factors must be >= 2 (n' = factor x n)")
    for spec in args.ks:
        if not (spec.isdigit() and int(spec) > 0 or spec.startswith("n/") and spec[2:].isdigit() and int(spec[2:]) > 0):
            p.error(f"--ks {spec}: expected a positive number or n/D")
    if not args.imdb.is_file():
        p.error(f"--imdb {args.imdb} not found")
    if args.control and args.quality:  # pretrain.sh --from the base checkpoint at n aborts at exit (SIGABRT)
        p.error(
            "--control with --quality is not available yet (its continuation at n aborts when it exits); "
            "docs/long_documents.md shows the control made with the launchers"
        )
    if args.hf_dir and not (args.hf_dir / "config.json").is_file():
        p.error(f"--hf-dir {args.hf_dir}: no config.json (not a transformers model folder)")
    return args


def main():
    args = parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hf_dir:
        args.hf_dir, args.models, args.data_bin = args.hf_dir.resolve(), ["original"], None
        args.original, args.unlabeled = args.out / "original", args.out / "unsup.txt"
        import_original(args)
    else:
        args.quality = args.quality.resolve()
        args.data_bin = next(iter(sorted((args.quality / "data" / "data-bin").glob("shard*"))), None)
        if args.data_bin is None:
            fail(f"--quality {args.quality} has no data/data-bin/shard*: not a quality study's folder")
    args.kinds = {m: model_kind(base_checkpoint(args, m)) for m in args.models}
    base = checkpoints.read_checkpoint(base_checkpoint(args, args.models[0]))
    args.n = checkpoints.model_namespace(base).max_positions
    for spec in args.ks if args.hf_dir else []:
        for long_n in [args.n * f for f in args.factors]:
            if not 0 < k_at(spec, long_n) <= long_n:
                fail(f"--ks {spec} gives k = {k_at(spec, long_n)} at n' = {long_n}: k must be in 1..n'")
    args.imdb_bin = prepare_imdb(args)
    specs = runs(args)
    unknown = sorted(set(args.runs or []) - set(specs))
    if unknown:
        fail(f"--runs {' '.join(unknown)}: not runs of this study; its runs are {' '.join(specs)}")
    if not args.report_only:
        for name in args.runs or specs:  # now: a finished run never asks for its checkpoint again
            specs[name].check()
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in [pool.submit(do_run, args, name, specs[name]) for name in args.runs or specs]:
                done.result()
    report(args, specs)


if __name__ == "__main__":
    main()
