"""The long-document study's runs: the models each run finetunes (imported, extended to n',
pretrained further or linearized at n'), their finetuning and predictions on the test reviews,
each Linformer's fidelity to the original by review length, and the cost of each run."""

import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linformer_tools import checkpoints, fidelity
from linformer_tools.common import SCRIPTS_DIR as SCRIPTS
from linformer_tools.common import fail, write_text
from linformer_tools.probe import fit_linear_probe

from common import command_line, context_losses, finetuning_cost, load, log, sh
from long_documents.data import labeled_reviews, length_bins, test_lengths, test_reviews


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


# ---------------------------------------------------------------- the models at n


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
            [SCRIPTS / "pretrain.sh", *launcher_device(args), "--batch-size", batch, "--global-batch", batch]
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
        sh([sys.executable, SCRIPTS / "linearize.py", args.hf_dir, "--text", args.unlabeled, "--out", out, *recipe,
            "--device", device(args)], out.with_suffix(".log"), args.threads)  # fmt: skip
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
        for long_n in longer if args.pooler_tokens == "mean" else []:  # chunks of n, the head on their mean
            chunked = (f"++model.chunk_length={n}", f"task.max_positions={long_n}")
            found[f"original-n{n}-chunks-n{long_n}"] = Run(
                lambda base=base: base, long_n, "head_tail", overrides=chunked
            )
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
    checkpoint = probed(args, name, run) if args.lp_ft else run.pretrained()
    total = -(-args.train_size // args.batch) * args.epochs
    step = step_batch(args, run.reads)
    if not (out.parent / f"seed{seed}.log").exists():
        log(f"{name}: finetuning, seed {seed}")
        out.parent.mkdir(parents=True, exist_ok=True)
        sh(
            [SCRIPTS / "finetune.sh", *launcher_device(args), "--batch-size", step, "--global-batch", args.batch]
            + ["--data", args.imdb_bin, "--seed", seed, "--save-dir", out, "imdb", checkpoint]
            + [f"truncation={run.truncation}", f"++task.truncation_head_tokens={args.n // 4}"]
            + [f"optimization.max_epoch={args.epochs}", f"optimization.max_update={total}"]
            + [f"optimization.lr=[{args.lr}]", f"lr_scheduler.warmup_updates={max(1, total * 6 // 100)}"]
            # every review of a step fits: the same reviews per update at every length
            + [f"dataset.max_tokens={step * run.reads}", "dataset.num_workers=0"]
            + ["common.log_format=simple", f"common.log_interval={max(1, total // 20)}", *run.overrides]
            # first is every model's default: only mean is said, so a model without the flag never meets it
            + (["++model.pooler_tokens=mean"] if args.pooler_tokens == "mean" else [])
            + args.finetune_overrides,
            out.parent / f"seed{seed}.log",
            threads=args.threads,
        )
    write_text(out / "record.json", json.dumps(seed_record(args, name, run, seed), indent=1) + "\n")
    finetuned = out / f"checkpoint_{args.predict_with}.pt"
    banded = getattr(checkpoints.model_namespace(checkpoints.read_checkpoint(finetuned)), "local_window", 0)
    for reading in [*READINGS][::-1] if banded else ["as finetuned"]:  # predictions.json, the mark of done, last
        write_text(out / READINGS[reading], json.dumps(predict(args, finetuned, reading)))
    for path in out.glob("checkpoint*.pt"):  # the predictions are what the report needs
        path.unlink()


def head_of(args):
    """How a finetuning's classification head starts and what it reads: probe-mean (--lp-ft: a
    linear probe's head on the mean of the final states), random-mean, or random-first (fairseq's
    random head on <s>)."""
    return f"{'probe' if args.lp_ft else 'random'}-{args.pooler_tokens}"


def study_command(args):
    """The study's command line as run, its machine's paths named: HF_DIR, DATA/TARBALL, OUT."""
    named = {"--hf-dir": "HF_DIR", "--quality": "QUALITY", "--out": "OUT", "--imdb": f"DATA/{args.imdb.name}"}
    return command_line("studies/study_long_documents.py", named)


def seed_record(args, name, run, seed):
    """What a finetuning seed was: its head, reading and recipe, the command and the date (its
    accuracy is computed from predictions.json beside it)."""
    return dict(
        run=name, seed=seed, head=head_of(args), reads=run.reads, truncation=run.truncation,
        frozen_projections="++model.freeze_compress=1" in args.finetune_overrides,
        recipe=dict(train_size=args.train_size, valid_size=args.valid_size, test_size=args.test_size,
                    epochs=args.epochs, batch=args.batch, lr=args.lr, predict_with=args.predict_with,
                    overrides=[*run.overrides, *args.finetune_overrides]),
        command=study_command(args), date=time.strftime("%Y-%m-%d", time.gmtime()),
    )  # fmt: skip


def probed(args, name, run):
    """--lp-ft: the run's model with the classification head of a linear probe of its frozen
    features (scripts/probe_head.py), which finetuning starts from."""
    out = args.out / "probed" / f"{name}.pt"
    if not out.exists():
        log(f"{name}: a linear probe's head to start finetuning from")
        chunked = any(o.startswith("++model.chunk_length=") for o in run.overrides)  # the probe reads chunks too
        reads = ["--chunk-length", args.n, "--max-positions", run.reads] if chunked else []
        sh([sys.executable, SCRIPTS / "probe_head.py", run.pretrained(), "--data", args.imdb_bin, "--out", out]
           + ["--truncation", run.truncation, "--truncation-head-tokens", args.n // 4, "--device", device(args)]
           + ["--pooler-tokens", args.pooler_tokens, *reads],
           out.with_suffix(".log"), args.threads)  # fmt: skip
    return out


# how a finetuned model with a band reads the test reviews: as finetuned, with its rows masked out
# (the band alone), or with its band off (the rows alone); a file of predictions each
READINGS = {
    "as finetuned": "predictions.json",
    "band only": "predictions-band-only.json",
    "rows only": "predictions-rows-only.json",
}


def read_as(model, reading):
    """MODEL's attention with a band read as READING says: band only, its far field's offset at
    -1e4 (no row gets weight: exp(-1e4) is 0 in float32); rows only, its band off (the plain
    Linformer of its weights)."""
    import torch

    for module in model.modules():
        if hasattr(module, "local_far_bias") and reading == "band only":
            with torch.no_grad():
                module.local_far_bias.fill_(-1e4)
        elif hasattr(module, "local_far_bias") and reading == "rows only":
            module.local_window = 0
    return model


def predict(args, checkpoint, reading="as finetuned"):
    """Test reviews as the finetuned model reads them (its truncation; a band model as READING
    says): (length, label, correct), in the test set's order."""
    import torch
    from fairseq import utils
    from fairseq.data import data_utils

    model, task = load(checkpoint, args.imdb_bin)
    read_as(model, reading)
    model.to(device(args))
    task.load_dataset("test")
    dataset = task.datasets["test"]
    reviews = data_utils.load_indexed_dataset(str(args.imdb_bin / "input0" / "test"), task.source_dictionary)
    by_length = sorted(range(len(dataset)), key=lambda i: reviews.sizes[i])  # batches padded to a close length
    rows = {}
    with torch.no_grad():
        for start in range(0, len(dataset), 16):
            sample = dataset.collater([dataset[i] for i in by_length[start : start + 16]])
            sample = utils.apply_to_sample(lambda tensor: tensor.to(device(args)), sample)
            logits, _ = model(
                **sample["net_input"], features_only=True, classification_head_name="sentence_classification_head"
            )
            labels = sample["target"].view(-1).tolist()
            for i, guess, label in zip(sample["id"].tolist(), logits.argmax(-1).tolist(), labels):
                rows[i] = (int(reviews.sizes[i]) + 1, label, guess == label)  # + <s>
    return [rows[i] for i in range(len(dataset))]


def do_run(args, name, run):
    if args.probe:
        linear_probe(args, name, run)
    if args.probe_only:
        return
    for seed in range(args.first_seed, args.seeds + 1):
        finetune(args, name, run, seed)
    if args.hf_dir and name.startswith("linformer-") and args.fidelity_reviews:
        fidelity_by_length(args, name, run)


def linear_probe(args, name, run):
    """What the run's model knows of the labels before finetuning: a logistic regression on its
    frozen final hidden states, averaged over each review's tokens (all-MiniLM-L6-v2's own
    sentence embedding), of the training reviews as the run reads them; the L2 penalty picked on
    fairseq's validation reviews. OUT/probe/NAME.json: the penalty, the validation accuracy and
    each test review's (length, correct), in the test set's order; under "first", the same for
    the state of <s> alone, which fairseq's classification head reads."""
    path = args.out / "probe" / f"{name}.json"
    if path.is_file():
        return
    import torch

    use_threads(args)
    log(f"{name}: linear probe on frozen features")
    model = fidelity.load(run.pretrained(), device(args))[0]
    features, labels = {"mean": {}, "first": {}}, {}
    for split in ("train", "valid", "test"):
        reviews, labels[split] = labeled_reviews(args, split, run.reads, run.truncation)
        features["mean"][split], features["first"][split] = review_features(model, reviews, fidelity.PAD)
    labels = {s: torch.tensor(y) for s, y in labels.items()}

    def fit(pooling):
        probe = fit_linear_probe(features[pooling], labels)
        guesses = probe.logits(features[pooling]["test"]).argmax(1).tolist()
        rows = [(x, guess == y) for x, guess, y in zip(test_lengths(args), guesses, labels["test"].tolist())]
        return dict(penalty=probe.penalty, valid=100 * probe.valid, test=rows)

    write_text(path, json.dumps(dict(**fit("mean"), first=fit("first"))))


def review_features(model, reviews, pad, tokens_a_batch=4096):
    """Each review's final hidden states averaged over its tokens, and the state of its first
    token (<s>): two ``len(reviews) x C`` tensors, float64."""
    import torch

    mean, first = [None] * len(reviews), [None] * len(reviews)
    order = sorted(range(len(reviews)), key=lambda i: len(reviews[i]))  # batches padded to a close length
    device = next(model.parameters()).device
    with torch.no_grad():
        start = 0
        while start < len(order):
            size = max(1, tokens_a_batch // len(reviews[order[start]]))
            batch = order[start : start + size]
            start += size
            x = torch.nn.utils.rnn.pad_sequence([reviews[i] for i in batch], batch_first=True, padding_value=pad)
            hidden = model(x.to(device), features_only=True)[0].double()
            real = x.ne(pad).unsqueeze(-1).to(hidden)
            for i, average, start_state in zip(batch, ((hidden * real).sum(1) / real.sum(1)).cpu(), hidden[:, 0].cpu()):
                mean[i], first[i] = average, start_state
    return torch.stack(mean), torch.stack(first)


def use_threads(args):
    """torch on --threads threads in this process, as the runs' subprocesses are (the probe and
    the fidelity measure run here)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def fidelity_by_length(args, name, run):
    """What reading through the projection costs, by review length, on test reviews (never
    distilled on), the first --fidelity-reviews of each bin; OUT/fidelity/NAME.json (remade when
    --fidelity-reviews changes)."""
    path = args.out / "fidelity" / f"{name}.json"
    if path.is_file() and json.loads(path.read_text())["reviews_a_bin"] == args.fidelity_reviews:
        return
    import torch

    use_threads(args)  # fidelity.fidelity(): the measure of linearize.py's own report
    log(f"{name}: fidelity on test reviews by length")
    teacher = extended(args, "original", run.reads) if run.reads > args.n else base_checkpoint(args, "original")
    student, teacher = fidelity.load(run.pretrained(), device(args))[0], fidelity.load(teacher, device(args))[0]
    reviews = test_reviews(args, run.reads)
    found = {}
    for label, keep in length_bins(args.n, args.factors):
        picked = sorted([r for r in reviews if keep(len(r))][: args.fidelity_reviews], key=len)  # less padding
        cosine = None
        if picked:
            rows = torch.nn.utils.rnn.pad_sequence(picked, batch_first=True, padding_value=fidelity.PAD)
            cosine = fidelity.fidelity(student, teacher, rows)["cosine"]
        found[label] = dict(reviews=len(picked), cosine=cosine)
    write_text(path, json.dumps(dict(reviews_a_bin=args.fidelity_reviews, bins=found), indent=1))


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


def device(args):
    return "cuda" if args.gpu else "cpu"


def launcher_device(args):
    """The launchers' flags: on the GPU their configs' fp16 mixed precision, on the CPU fp32."""
    return ["--gpus", "1"] if args.gpu else ["--cpu"]


def step_batch(args, reads):
    """Reviews a finetuning step holds at this length: --batch, fewer past --step-tokens (an update
    then takes several steps): the original at n' = 2048 with full attention, 8 reviews a step,
    was killed for memory at 16 GB."""
    step = max(1, min(args.batch, args.step_tokens // reads))
    while args.batch % step:
        step -= 1
    return step
