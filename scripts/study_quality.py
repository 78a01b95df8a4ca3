"""Quality study: Linformer variants side by side with RoBERTa of the same size, data, budget
and seed (docs/quality.md has the method and the results).

Steps, each reused when the study runs again (a killed pretraining resumes from its
checkpoint_last.pt):

1. data: WikiText-2 train + books -> corpus, sentencepiece, data-bin; WikiText-2 valid is the
   validation text; a fixed SST-2 training subset with the full dev set.
2. per run, in OUT/runs/NAME/: masked-LM pretraining (pretrain.log), the masked-LM loss on
   validation text cut to shorter contexts (short_inputs.json), SST-2 finetuning with several
   seeds (sst2-seedS.log).
3. report: wall time per training update of every model, measured alone one after another
   (timing.json), then OUT/report.md, OUT/results.json, OUT/logs-summary.txt and
   OUT/perplexity.png.
"""

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dataprep.common import guess_encoding
from linformer_tools.common import PLUGIN_DIR, REPO, atomic, fail, write_text
from linformer_tools.logs import by_update, records

DATA_PREP = REPO / "data-prep"

SIZES = {  # layers, width, ffn, heads, n, batch (sequences per update)
    "small": dict(layers=4, dim=256, ffn=1024, heads=4, n=256, batch=8),
    "tiny": dict(layers=2, dim=32, ffn=64, heads=4, n=64, batch=8),
}


def linformer(n, k=None, **changes):
    """Flags of a Linformer run: k = n/8, headwise, linear projection, linear length norm,
    N(0, 0.02) init, each overridden by ``changes`` (all explicit: no run depends on the
    plugin's defaults)."""
    flags = dict(
        compressed_dim=k or n // 8,
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
    """Name -> (model flags, extra pretraining flags), in the order they run: the transfer to
    short inputs and its alternatives first, then k, sharing, init, so a study cut short
    keeps what matters most."""
    # blocks of whole lines (paragraphs) up to n tokens; fairseq gives a line longer than the
    # block a block of its own, too long for n, so such lines are skipped (train and valid)
    varied = ["--sample-break-mode", "complete", "--skip-invalid-size-inputs-valid-test"]
    return {
        "roberta": (["--arch", "roberta_base"], []),
        "linformer": (linformer(n), []),
        "length-norm-none": (linformer(n, compress_length_norm="none"), []),
        "mean-pooling": (linformer(n, compress_type="mean"), []),
        "varied-blocks-norm-none": (linformer(n, compress_length_norm="none"), varied),
        "k-n16": (linformer(n, n // 16), []),
        "k-n4": (linformer(n, n // 4), []),
        "init-xavier": (linformer(n, compress_init="xavier"), []),
        "sharing-kv": (linformer(n, compress_sharing="kv"), []),
        "sharing-layerwise": (linformer(n, compress_sharing="layerwise"), []),
        "init-mean": (linformer(n, compress_init="mean"), []),
        "sharing-none": (linformer(n, compress_sharing="none"), []),
        "length-norm-sqrt": (linformer(n, compress_length_norm="sqrt"), []),
        "conv": (linformer(n, compress_type="conv"), []),
        "nonuniform-k": (linformer(n, layer_compressed_dims=",".join(str(n // d) for d in (4, 8, 16, 16))), []),
    }


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd, logfile=None, threads=None):
    """Run a command; its output goes to logfile (kept on failure) or to ours."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHON=sys.executable)  # data-prep wrappers run $PYTHON
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [str(c) for c in cmd]
    if logfile is None:
        if subprocess.run(cmd, env=env).returncode:
            fail(f"{' '.join(cmd[:3])} ... failed")
        return
    partial = Path(str(logfile) + ".partial")
    with open(partial, "a") as out:  # a resumed run adds to what it logged before the kill
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        tail = "".join(partial.read_text().splitlines(keepends=True)[-15:])
        fail(f"{cmd[2] if len(cmd) > 2 else cmd[0]} failed (exit {code}); see {partial}:\n{tail}")
    partial.rename(logfile)  # the final name marks the step done


# ------------------------------------------------------------------------------- data


def prepare_data(args, work):
    """Corpus, sentencepiece, data-bin and the SST-2 subset under work/; returns paths."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    wt, books = args.wikitext, args.books
    for path in (
        wt / "wiki.train.tokens",
        wt / "wiki.valid.tokens",
        books,
        args.sst2 / "train.tsv",
        args.sst2 / "dev.tsv",
    ):
        if not path.exists():
            fail(f"{path} not found (see --help for the data flags)")
    books = utf8_books(books, data / "books")
    # The corpus builder always holds out documents; the train corpus gives 1 document to its
    # unused valid split, and all of WikiText-2 valid becomes the validation text.
    sh(
        [
            DATA_PREP / "corpus.sh",
            "--out",
            data / "corpus-train",
            "--valid-docs",
            "1",
            "--wikitext",
            wt / "wiki.train.tokens",
            "--books",
            books,
        ]
    )
    sh(
        [
            DATA_PREP / "corpus.sh",
            "--out",
            data / "corpus-valid",
            "--valid-docs",
            "1",
            "--wikitext",
            wt / "wiki.valid.tokens",
        ]
    )
    valid_txt = data / "valid.txt"
    if not valid_txt.exists():
        text = "".join((data / "corpus-valid" / f).read_text() for f in ("train.txt", "valid.txt"))
        write_text(valid_txt, text)
    spm = data / "spm"
    sh(
        [
            DATA_PREP / "spm.sh",
            "train",
            "--corpus",
            data / "corpus-train" / "train.txt",
            "--out",
            spm,
            "--vocab-size",
            args.vocab_size,
            "--workers",
            2,
        ]
    )
    sh(
        [
            DATA_PREP / "spm.sh",
            "encode",
            "--model",
            spm / "spm.model",
            "--workers",
            2,
            "--inputs",
            data / "corpus-train" / "train.txt",
            valid_txt,
            "--outputs",
            data / "train.spm",
            data / "valid.spm",
        ]
    )
    sh(
        [
            DATA_PREP / "binarize.sh",
            "--train",
            data / "train.spm",
            "--valid",
            data / "valid.spm",
            "--srcdict",
            spm / "dict.txt",
            "--destdir",
            data / "data-bin",
            "--shards",
            1,
            "--workers",
            2,
        ]
    )

    subset = data / "sst2-subset" / "SST-2"
    if not (subset / "dev.tsv").exists():
        subset.mkdir(parents=True, exist_ok=True)
        header, *rows = (args.sst2 / "train.tsv").read_text().splitlines(keepends=True)
        if len(rows) < args.sst2_train_rows:
            fail(f"{args.sst2}/train.tsv has {len(rows)} rows, fewer than --sst2-train-rows {args.sst2_train_rows}")
        rows = random.Random(0).sample(rows, args.sst2_train_rows)
        (subset / "train.tsv").write_text(header + "".join(rows))
        (subset / "dev.tsv").write_text((args.sst2 / "dev.tsv").read_text())
    sh(
        [
            DATA_PREP / "glue.sh",
            "--glue-dir",
            subset.parent,
            "--tasks",
            "SST-2",
            "--spm-model",
            spm / "spm.model",
            "--srcdict",
            spm / "dict.txt",
            "--destdir",
            data / "glue",
            "--workers",
            2,
        ]
    )
    shards = sorted((data / "data-bin").glob("shard*"))
    return {"data_bin": ":".join(map(str, shards)) or str(data / "data-bin"), "sst2_bin": data / "glue" / "SST-2-bin"}


def utf8_books(src, dest):
    """Copies of the books in UTF-8 (two of the Gutenberg books are Latin-1), made once."""
    if not dest.exists():
        with atomic(dest) as tmp:
            tmp.mkdir()
            for book in sorted(src.glob("*.txt")):
                text = book.read_bytes().decode(guess_encoding(book, fallback="latin-1"))
                (tmp / book.name).write_text(text, encoding="utf-8")
    return dest


# ------------------------------------------------------------------------------- one run


def size_flags(size):
    s = SIZES[size]
    return [
        "--encoder-layers",
        s["layers"],
        "--encoder-embed-dim",
        s["dim"],
        "--encoder-ffn-embed-dim",
        s["ffn"],
        "--encoder-attention-heads",
        s["heads"],
        "--max-positions",
        s["n"],
        "--dropout",
        0.1,
        "--attention-dropout",
        0.1,
    ]


COMMON = [
    "--user-dir",
    PLUGIN_DIR,
    "--optimizer",
    "adam",
    "--adam-betas",
    "(0.9,0.98)",
    "--adam-eps",
    "1e-6",
    "--weight-decay",
    "0.01",
    "--clip-norm",
    "1.0",
    "--lr-scheduler",
    "polynomial_decay",
    "--num-workers",
    "0",
    "--log-format",
    "simple",
    "--cpu",
]


def pretrain(args, paths, name, model_flags, task_flags, out):
    s, updates = SIZES[args.size], args.budget
    sh(
        [
            sys.executable,
            "-m",
            "fairseq_cli.train",
            paths["data_bin"],
            *model_flags,
            *size_flags(args.size),
            *COMMON,
            "--task",
            "masked_lm",
            "--criterion",
            "masked_lm",
            "--tokens-per-sample",
            s["n"],
            "--sample-break-mode",
            "none",
            *task_flags,
            "--batch-size",
            s["batch"],
            "--seed",
            1,
            "--lr",
            args.lr,
            "--warmup-updates",
            max(1, updates // 10),
            "--total-num-update",
            updates,
            "--max-update",
            updates,
            "--validate-interval-updates",
            max(1, updates // 8),
            # --max-valid-steps stops validation early; with fairseq's prefetch thread on, the
            # process then aborts at exit ("terminate called without an active exception")
            "--batch-size-valid",
            32,
            "--max-valid-steps",
            args.valid_batches,
            "--data-buffer-size",
            0,
            "--save-interval-updates",
            max(1, updates // 8),
            "--keep-interval-updates",
            1,
            "--no-epoch-checkpoints",
            "--log-interval",
            max(1, updates // 40),
            "--save-dir",
            out / "checkpoints",
        ],
        out / "pretrain.log",
        threads=args.threads,
    )


def finetune(args, paths, model_flags, out, seed):
    updates_per_epoch = math.ceil(args.sst2_train_rows / 32)
    total = updates_per_epoch * args.finetune_epochs
    sh(
        [
            sys.executable,
            "-m",
            "fairseq_cli.train",
            paths["sst2_bin"],
            *model_flags,
            *size_flags(args.size),
            *COMMON,
            "--finetune-from-model",
            out / "checkpoints" / "checkpoint_last.pt",
            "--task",
            "sentence_prediction",
            "--criterion",
            "sentence_prediction",
            "--num-classes",
            2,
            "--init-token",
            0,
            "--separator-token",
            2,
            "--shorten-method",
            "truncate",
            "--batch-size",
            32,
            "--lr",
            args.finetune_lr,
            "--warmup-updates",
            max(1, total // 16),
            "--total-num-update",
            total,
            "--max-epoch",
            args.finetune_epochs,
            "--seed",
            seed,
            "--no-save",
            "--log-interval",
            max(1, updates_per_epoch // 2),
            "--best-checkpoint-metric",
            "accuracy",
            "--maximize-best-checkpoint-metric",
        ],
        out / f"sst2-seed{seed}.log",
        threads=args.threads,
    )


def load(checkpoint, data_bin):
    import torch
    from fairseq import checkpoint_utils

    import linformer_fairseq  # noqa: F401  (registers the model)

    torch.manual_seed(0)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": data_bin.split(":")[0]}
    )
    return models[0].eval(), task


def short_input_losses(args, paths, out):
    """Masked-LM loss (bits/token) on the same masked tokens of the validation blocks, read
    with the whole n-token block as context and with the block cut into pieces of T tokens."""
    import torch

    n = SIZES[args.size]["n"]
    model, task = load(out / "checkpoints" / "checkpoint_last.pt", paths["data_bin"])
    d = task.source_dictionary
    stream = torch.from_numpy(_valid_tokens(task))
    body = n - 1  # every piece is <s> + text, as in pretraining
    blocks = stream[: len(stream) // body * body].view(-1, body)[: args.eval_blocks]
    g = torch.Generator().manual_seed(0)
    masked = torch.rand(blocks.shape, generator=g) < 0.15
    inputs = blocks.masked_fill(masked, d.index("<mask>"))
    lengths = (n // 16, n // 8, n // 4, n)
    # score only masked tokens that every cut keeps, so every length is scored on the same tokens
    scored = min(body // (T - 1) * (T - 1) for T in lengths)
    masked &= torch.arange(body) < scored
    results = {}
    for T in lengths:
        piece = T - 1
        usable = body // piece * piece
        x = inputs[:, :usable].reshape(-1, piece)
        y, m = blocks[:, :usable].reshape(-1, piece), masked[:, :usable].reshape(-1, piece)
        x = torch.cat([torch.full((x.size(0), 1), d.bos()), x], 1)
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, x.size(0), 64):
                logits, _ = model(x[i : i + 64])
                mm = m[i : i + 64]
                lp = torch.log_softmax(logits[:, 1:][mm].float(), -1)
                total -= lp.gather(1, y[i : i + 64][mm].unsqueeze(1)).sum().item()
                count += int(mm.sum())
        results[T] = total / count / math.log(2)
    return results


def _valid_tokens(task):
    """The validation split as one token stream (its lines concatenated, as break mode none reads it)."""
    import numpy as np
    from fairseq.data import data_utils

    path = os.path.join(task.cfg.data.split(":")[0], "valid")
    ds = data_utils.load_indexed_dataset(path, task.source_dictionary)
    return np.concatenate([ds[i].numpy() for i in range(len(ds))])


def do_run(args, paths, name, spec):
    model_flags, task_flags = spec
    out = args.out / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "pretrain.log").exists():
        log(f"{name}: pretraining {args.budget} updates")
        pretrain(args, paths, name, model_flags, task_flags, out)
    if not (out / "short_inputs.json").exists():
        losses = short_input_losses(args, paths, out)
        write_text(out / "short_inputs.json", json.dumps(losses, indent=1))
    for seed in range(1, args.seeds + 1) if args.sst2_runs is None or name in args.sst2_runs else ():
        if not (out / f"sst2-seed{seed}.log").exists():
            log(f"{name}: SST-2 finetuning, seed {seed}")
            finetune(args, paths, model_flags, out, seed)
    log(f"{name}: done")


# ------------------------------------------------------------------------------- report


def valid_curve(log):
    """(updates, perplexity) of every validation; a resumed run may repeat one: keep the last."""
    return sorted(by_update(records(log, "valid"), "ppl").items())


def dev_accuracy(log):
    """Dev accuracy after the last epoch (no selection on dev)."""
    found = records(log, "valid")
    return found[-1]["accuracy"] if found else None


def time_updates(args, paths, name, out, steps=6):
    """Median wall seconds of a pretraining update (forward, backward, Adam step) on random
    tokens at the study's batch shape, measured in this process (nothing else running)."""
    import torch

    s = SIZES[args.size]
    model, task = load(out / "checkpoints" / "checkpoint_last.pt", paths["data_bin"])
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    x = torch.randint(4, len(task.source_dictionary) - 1, (s["batch"], s["n"]))
    masked = torch.rand(x.shape) < 0.15
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        logits, _ = model(x, masked_tokens=masked)
        torch.nn.functional.cross_entropy(logits, x[masked]).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    return {"seconds_per_update": statistics.median(times[2:]), "parameters": params}


def report(args, specs):
    rows, curves = [], {}
    n = SIZES[args.size]["n"]
    for name in specs:
        out = args.out / "runs" / name
        if not (out / "short_inputs.json").exists():
            continue
        curve = valid_curve(out / "pretrain.log")
        curves[name] = curve
        short = {int(t): v for t, v in json.loads((out / "short_inputs.json").read_text()).items()}
        accs = [a for a in (dev_accuracy(p) for p in sorted(out.glob("sst2-seed*.log"))) if a is not None]
        timing = json.loads((out / "timing.json").read_text()) if (out / "timing.json").exists() else {}
        rows.append(
            dict(
                name=name,
                flags=" ".join(map(str, specs[name][0] + specs[name][1])),
                ppl=curve[-1][1] if curve else None,
                short=short,
                sst2=accs,
                **timing,
            )
        )
    if not rows:
        fail(f"no finished run under {args.out}/runs")
    base = next((r for r in rows if r["name"] == "roberta"), None)
    lengths = sorted(rows[0]["short"])

    def pct(a, b):
        return f"{100 * (a / b - 1):+.1f}%" if a and b else ""

    lines = [
        f"Study: {args.size} models ({SIZES[args.size]}), {args.budget} pretraining updates, "
        f"SST-2 on {args.sst2_train_rows} training rows, {args.finetune_epochs} epochs, seeds 1..{args.seeds}.",
        "",
        "| run | valid ppl | vs RoBERTa | "
        + " | ".join(f"loss T={t}" for t in lengths)
        + f" | T={lengths[0]} minus T={n} | SST-2 dev % (mean ± sd) | s/update | params |",
        "| --- " * (7 + len(lengths)) + "|",
    ]
    for r in rows:
        acc = r["sst2"]
        acc_txt = (
            (
                f"{statistics.mean(acc):.1f} ± {statistics.stdev(acc) if len(acc) > 1 else 0:.1f}"
                f" ({', '.join(f'{a:.1f}' for a in acc)})"
            )
            if acc
            else "-"
        )
        lines.append(
            f"| {r['name']} | {r['ppl']:.1f} | {pct(r['ppl'], base and base['ppl'])} | "
            + " | ".join(f"{r['short'][t]:.3f}" for t in lengths)
            + f" | {r['short'][lengths[0]] - r['short'][n]:+.3f} | {acc_txt} | "
            + (f"{r['seconds_per_update']:.3f} | {r['parameters']:,} |" if "parameters" in r else "- | - |")
        )
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
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq set the root logger to DEBUG
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, curve in curves.items():
        if curve:
            style = dict(color="black", linewidth=2.5) if name == "roberta" else dict(linewidth=1)
            ax.plot(*zip(*curve), label=name, **style)
    ax.set(xlabel="updates", ylabel="validation perplexity", yscale="log", title=title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------- main


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shared = REPO.parent / "shared" / "data"
    p.add_argument("--out", type=Path, default=REPO / "work" / "study", help="output folder (default: %(default)s)")
    p.add_argument(
        "--wikitext",
        type=Path,
        default=shared / "wikitext-2",
        help="folder with wiki.train.tokens and wiki.valid.tokens (default: %(default)s)",
    )
    p.add_argument(
        "--books",
        type=Path,
        default=shared / "gutenberg",
        help="folder of plain-text books, one per *.txt (default: %(default)s)",
    )
    p.add_argument(
        "--sst2",
        type=Path,
        default=shared / "glue" / "SST-2",
        help="folder with SST-2 train.tsv and dev.tsv (default: %(default)s)",
    )
    p.add_argument("--size", choices=SIZES, default="small", help="model size and n (default: %(default)s)")
    p.add_argument("--budget", type=int, default=2000, help="pretraining updates of every run (default: %(default)s)")
    p.add_argument("--lr", type=float, default=5e-4, help="pretraining peak learning rate (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=8000, help="sentencepiece vocabulary (default: %(default)s)")
    p.add_argument(
        "--sst2-train-rows",
        type=int,
        default=4000,
        help="the fixed SST-2 training subset, drawn with seed 0 (default: %(default)s)",
    )
    p.add_argument("--finetune-epochs", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--finetune-lr", type=float, default=3e-4, help="(default: %(default)s)")
    p.add_argument("--seeds", type=int, default=3, help="SST-2 finetuning seeds per run (default: %(default)s)")
    p.add_argument(
        "--eval-blocks",
        type=int,
        default=200,
        help="validation blocks of n tokens read by the short-input table (default: %(default)s)",
    )
    p.add_argument(
        "--valid-batches",
        type=int,
        default=16,
        help="validation perplexity on the first N batches of 32 blocks (default: %(default)s)",
    )
    p.add_argument("--runs", nargs="+", metavar="NAME", help="only these runs (default: all; see --list)")
    p.add_argument(
        "--sst2-runs",
        nargs="+",
        metavar="NAME",
        help="finetune only these runs on SST-2 (default: all); the others get perplexity and the short-input table",
    )
    p.add_argument("--list", action="store_true", help="print the runs and their flags, then exit")
    p.add_argument(
        "--jobs", type=int, default=1, help="runs trained at once, each on --threads threads (default: %(default)s)"
    )
    p.add_argument("--threads", type=int, default=0, help="threads per training process (0: torch's default)")
    p.add_argument("--report-only", action="store_true", help="only time the finished runs and write the report")
    args = p.parse_args()
    for name in ("budget", "sst2_train_rows", "finetune_epochs", "seeds", "jobs", "eval_blocks", "valid_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")

    specs = run_specs(SIZES[args.size]["n"])
    if args.list:
        for name, (model_flags, task_flags) in specs.items():
            print(f"{name}: {' '.join(map(str, model_flags + task_flags))}")
        return
    unknown = (set(args.runs or []) | set(args.sst2_runs or [])) - set(specs)
    if unknown:
        p.error(f"unknown run(s) {sorted(unknown)}; --list shows the names")
    if args.runs:
        specs = {k: v for k, v in specs.items() if k in args.runs}
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    settings = {
        k: str(v)
        for k, v in vars(args).items()
        if k not in ("runs", "sst2_runs", "jobs", "threads", "report_only", "list", "out")
    }
    saved = args.out / "settings.json"
    if saved.exists() and json.loads(saved.read_text()) != settings:
        fail(f"{args.out} holds a study made with other settings ({saved}); use another --out")
    saved.write_text(json.dumps(settings, indent=1))

    paths = prepare_data(args, args.out)
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            for f in [pool.submit(do_run, args, paths, name, spec) for name, spec in specs.items()]:
                f.result()
    for name in specs:
        out = args.out / "runs" / name
        if (out / "short_inputs.json").exists() and not (out / "timing.json").exists():  # finished runs
            log(f"{name}: timing updates")
            write_text(out / "timing.json", json.dumps(time_updates(args, paths, name, out)))
    report(args, specs)


if __name__ == "__main__":
    main()
