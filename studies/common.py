"""What the studies share (studies/study_quality.py, studies/study_long_documents.py,
studies/study_linearize.py): running their steps resumably, loading a run's checkpoint, the
masked-LM loss of the same tokens read with shorter contexts, the cost of a training update, and
GLUE finetuning on fixed subsets. A study imports it as ``common``, from beside it; no user
script in scripts/ imports it."""

import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from linformer_tools import measure
from linformer_tools.common import fail
from linformer_tools.logs import records

# GLUE task: (dev metric, criterion flags, whether its train.tsv has a header)
GLUE_TASKS = {"SST-2": ("accuracy", [], True), "CoLA": ("mcc", ["--report-mcc"], False)}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd, logfile=None, threads=None):
    """Run a command; its output goes to logfile (kept on failure) or to ours. A step is done
    when its logfile exists: the output is written to LOGFILE.partial and renamed at the end."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHON=sys.executable)  # data-prep wrappers run $PYTHON
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [str(c) for c in cmd]
    if logfile is None:
        if subprocess.run(cmd, env=env).returncode:
            fail(f"{' '.join(cmd[:3])} ... failed")
        return
    partial = Path(str(logfile) + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)  # a study's first step may log into a folder not made yet
    with open(partial, "a") as out:  # a resumed run adds to what it logged before the kill
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        tail = "".join(partial.read_text().splitlines(keepends=True)[-15:])
        what = " ".join(Path(c).name for c in cmd[:3] if not c.startswith("-"))  # python -m x, or a script
        fail(f"{what} failed (exit {code}); see {partial}:\n{tail}")
    partial.rename(logfile)  # the final name marks the step done


def command_line(script, named):
    """This process's command line as ``python SCRIPT ...``, the value of each flag in NAMED replaced
    by its name there (a record holds no machine's paths)."""
    argv = sys.argv[1:]
    return shlex.join(["python", script, *(named.get(before, word) for before, word in zip([None, *argv], argv))])


def load(checkpoint, data):
    """(model in eval mode, task) of a checkpoint, with its data read from ``data``."""
    import torch
    from fairseq import checkpoint_utils

    import linformer_fairseq  # noqa: F401  (registers the model and the task)

    torch.manual_seed(0)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data).split(":")[0]}
    )
    return models[0].eval(), task


def token_stream(task, split="valid"):
    """A masked-LM task's split as one token stream (its lines concatenated, as break mode none
    reads it)."""
    import numpy as np
    from fairseq.data import data_utils

    path = os.path.join(task.cfg.data.split(":")[0], split)
    ds = data_utils.load_indexed_dataset(path, task.source_dictionary)
    return np.concatenate([ds[i].numpy() for i in range(len(ds))])


def context_losses(model, task, n, lengths, blocks):
    """Masked-LM loss (bits/token) of the same masked tokens of ``blocks`` validation blocks of
    n tokens, read with the whole block as context and with the block cut into pieces of T
    tokens, for each T in ``lengths`` (every piece is <s> + text, as in pretraining)."""
    import torch

    d = task.source_dictionary
    stream = torch.from_numpy(token_stream(task))
    body = n - 1
    blocks = stream[: len(stream) // body * body].view(-1, body)[:blocks]
    g = torch.Generator().manual_seed(0)
    masked = torch.rand(blocks.shape, generator=g) < 0.15
    inputs = blocks.masked_fill(masked, d.index("<mask>"))
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
        rows = max(1, 16384 // T)  # about the same number of tokens per forward at every T
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, x.size(0), rows):
                logits, _ = model(x[i : i + rows])
                mm = m[i : i + rows]
                lp = torch.log_softmax(logits[:, 1:][mm].float(), -1)
                total -= lp.gather(1, y[i : i + rows][mm].unsqueeze(1)).sum().item()
                count += int(mm.sum())
        results[T] = total / count / math.log(2)
    return results


def update_cost(model, task, batch, n, min_run_time=10):
    """Seconds (median) and peak memory of a masked-LM training update of ``batch`` x n masked
    random tokens, as the benchmark measures them (linformer_tools.measure)."""
    import torch

    targets = torch.randint(4, len(task.source_dictionary) - 1, (batch, n))
    masked = torch.rand(targets.shape) < 0.15
    step = measure.training_step(model, targets.masked_fill(masked, task.mask_idx), targets, masked)
    return {
        "seconds_per_update": statistics.median(measure.seconds_per_step(step, min_run_time=min_run_time)),
        "peak_mb": measure.peak_bytes(step) / 2**20,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def finetuning_cost(model, task, batch, n, min_run_time=10):
    """Seconds (median) and peak memory of a finetuning update of ``batch`` documents of n random
    tokens (a classification head on <s>), and documents a second when predicting them."""
    import torch

    d = task.source_dictionary
    tokens = torch.randint(d.nspecial, len(d) - 1, (batch, n))
    tokens[:, 0], tokens[:, -1] = d.bos(), d.eos()
    step = measure.classification_step(model, tokens, torch.arange(batch) % 2)
    cost = {
        "seconds_per_update": statistics.median(measure.seconds_per_step(step, min_run_time=min_run_time)),
        "peak_mb": measure.peak_bytes(step) / 2**20,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    predict = statistics.median(measure.seconds_per_step(measure.prediction_step(model, tokens), min_run_time))
    return {**cost, "documents_per_second": batch / predict}


def mean_sd(values, digits=1):
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def glue_subset(glue, task, rows, out):
    """OUT/TASK: the task's fixed training subset of ``rows`` (drawn with seed 0) and its whole
    dev set; returns the number of training rows."""
    train = (glue / task / "train.tsv").read_text().splitlines(keepends=True)
    header = train.pop(0) if GLUE_TASKS[task][2] else ""
    if not (out / task / "dev.tsv").exists():
        (out / task).mkdir(parents=True, exist_ok=True)
        (out / task / "train.tsv").write_text(header + "".join(random.Random(0).sample(train, min(rows, len(train)))))
        (out / task / "dev.tsv").write_text((glue / task / "dev.tsv").read_text())
    return min(rows, len(train))


def finetune_flags(task, train_rows, epochs, lr, seed):
    """fairseq-train's finetuning flags for a GLUE task (after --finetune-from-model): batch 32,
    linear decay after 6% warmup, dropout 0.1, no checkpoints, the dev metric after the last
    epoch (no selection on dev)."""
    updates_per_epoch = math.ceil(train_rows / 32)
    total = updates_per_epoch * epochs
    metric, criterion_flags, _ = GLUE_TASKS[task]
    return [
        "--task", "sentence_prediction", "--criterion", "sentence_prediction", *criterion_flags,
        "--num-classes", 2, "--init-token", 0, "--separator-token", 2, "--shorten-method", "truncate",
        "--dropout", 0.1, "--attention-dropout", 0.1, "--batch-size", 32, "--lr", lr,
        "--warmup-updates", max(1, total // 16), "--total-num-update", total, "--max-epoch", epochs,
        "--seed", seed, "--no-save", "--log-interval", max(1, updates_per_epoch // 2),
        "--best-checkpoint-metric", metric, "--maximize-best-checkpoint-metric",
    ]  # fmt: skip


def dev_scores(out, task):
    """The task's dev metric after the last epoch of each seed's log (OUT/TASK-seed*.log)."""
    found = [records(log, "valid") for log in sorted(out.glob(f"{task}-seed*.log"))]
    return [valid[-1][GLUE_TASKS[task][0]] for valid in found if valid]
