"""The launchers (scripts/pretrain.sh, finetune.sh, slurm/*.sbatch, collect_results.py): their
dry-run arithmetic and bad input, and real CPU runs through them: a pretraining run killed with
SIGKILL and relaunched, its tensorboard logs, bf16 steps, finetuning from its checkpoint and
the results table."""

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import CONFIG, ENV, REPO, TINY, build_sst2_bin
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import linformer_fairseq  # noqa: F401  (its checkpoints load with weights_only=True)
from linformer_tools.logs import by_update, records

pytestmark = pytest.mark.slow(minutes=4)  # end-to-end training runs

SCRIPTS = REPO / "scripts"
PRETRAIN, FINETUNE = SCRIPTS / "pretrain.sh", SCRIPTS / "finetune.sh"
PRETRAIN_SBATCH, FINETUNE_SBATCH = SCRIPTS / "slurm" / "pretrain.sbatch", SCRIPTS / "slurm" / "finetune.sbatch"
COLLECT = [sys.executable, str(SCRIPTS / "collect_results.py")]
SMOKE = ["--cpu", "--global-batch", "8", "--batch-size", "8"]  # one process, 8 sequences per update
MAX_UPDATE, SAVE_EVERY = 40, 10
PLAN = re.compile(r"batch: (\d+) sequences per GPU x update_freq (\d+) x world size (\d+) = global batch (\d+)")


def run(cmd, cwd=None, ok=True):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert (proc.returncode == 0) == ok, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("script", [PRETRAIN, FINETUNE, PRETRAIN_SBATCH, FINETUNE_SBATCH])
def test_help_documents_the_dry_run(script):
    out = run([script, "--help"]).stdout
    assert out.startswith("Usage:") and "--dry-run" in out


@pytest.mark.parametrize("nodes, update_freq", [(8, 2), (4, 4), (1, 16)])
def test_sbatch_dry_run_keeps_the_global_batch(nodes, update_freq):
    """64, 32 and 8 GPUs: update_freq grows as the GPU count falls, the global batch stays 2048."""
    out = run(
        [PRETRAIN_SBATCH, "--dry-run", "--nodes", nodes, "linformer_n512_k128_headwise", "data-bin/shard0"]
    ).stdout
    world = nodes * 8
    batch, freq, size, global_batch = map(int, PLAN.search(out).groups())
    assert (batch, freq, size, global_batch) == (16, update_freq, world, 2048)
    assert batch * freq * size == 2048
    srun, command = re.findall(r"^command: (.*)$", out, re.M)
    assert srun.startswith("srun ") and f"--nodes {nodes} --gpus 8" in srun
    assert f"optimization.update_freq=\\[{update_freq}\\]" in command
    assert f"distributed_training.distributed_world_size={world}" in command
    assert "distributed_training.distributed_port=" in command  # fairseq's Slurm-aware init needs it
    ranks = re.findall(r"^  node (\d+): ranks (\d+)-(\d+)$", out, re.M)
    assert [tuple(map(int, r)) for r in ranks] == [(n, 8 * n, 8 * n + 7) for n in range(nodes)]
    assert "checkpoints/linformer_n512_k128_headwise (hydra_train.log, tensorboard/" in out


@pytest.mark.parametrize(
    "cmd, message",
    [
        ([PRETRAIN, "--dry-run", "--gpus", "8", "nope", "data"], "no config"),
        (
            [PRETRAIN, "--dry-run", "--gpus", "3", CONFIG, "data"],
            "does not split into steps of 16 sequences per GPU x 3 GPUs",
        ),
        ([PRETRAIN, "--dry-run", "--gpus", "8", CONFIG, "data", "dataset.batch_size=4"], "--batch-size"),
        ([PRETRAIN, "--gpus", "0", CONFIG, "data"], "--gpus needs a whole number >= 1, got '0'"),
        ([PRETRAIN, "--cpu", CONFIG, "/no/such/data"], "data folder /no/such/data does not exist"),
        ([FINETUNE, "--dry-run", "nope", "model.pt"], "no task 'nope'"),
        ([FINETUNE, "--dry-run", "sst_2", "/no/model.pt"], "checkpoint /no/model.pt does not exist"),
        (
            [
                "env",
                "SLURM_ARRAY_TASK_ID=1",
                FINETUNE_SBATCH,
                "--dry-run",
                "--tasks",
                "rte",
                "--seeds",
                "1",
                "model.pt",
            ],
            "array index 1 is past 1 tasks x 1 seeds: submit with --array=0-0",
        ),
        (COLLECT + ["/no/such/folder"], "/no/such/folder is not a folder"),
        ([PRETRAIN, "--cpu", CONFIG, "/no/such dir/data:/no/other"], "data folder /no/such dir/data does not exist"),
        # data-prep writes DESTDIR/<TASK>-bin, and both READMEs use --destdir data-bin
        ([FINETUNE, "--cpu", "sst_2", "model.pt"], "error: data-bin/SST-2-bin is not a sentence_prediction data-bin"),
        ([PRETRAIN, "--cpu", "--gpus", "2", CONFIG, "."], "--cpu runs one process outside Slurm"),
    ],
    ids=[
        "config",
        "indivisible",
        "batch-override",
        "zero-gpus",
        "data",
        "task",
        "checkpoint",
        "array",
        "results",
        "data-with-spaces",
        "finetune-data-root",
        "cpu-ranks-outside-slurm",
    ],
)
def test_bad_input_fails_with_a_clear_message(cmd, message, tmp_path):
    proc = run(cmd, cwd=tmp_path, ok=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_sbatch_dry_run_cpu_ranks():
    """--cpu under Slurm: one gloo rank per task, placed by fairseq's Slurm init as on GPUs."""
    out = run(
        [
            PRETRAIN_SBATCH,
            "--dry-run",
            "--nodes",
            "2",
            "--gpus-per-node",
            "2",
            "--cpu",
            "--global-batch",
            "8",
            "--batch-size",
            "2",
            CONFIG,
            "data-bin/shard0",
        ]
    ).stdout
    assert "srun: 2 node(s) x 2 task(s), one CPU process (gloo rank) each" in out
    assert "plan: CPU (gloo), 2 node(s) x 2 process(es) = world size 4" in out
    assert re.findall(r"^  node (\d+): ranks (\d+)-(\d+)$", out, re.M) == [("0", "0", "1"), ("1", "2", "3")]
    assert tuple(map(int, PLAN.search(out).groups())) == (2, 1, 4, 8)
    command = re.findall(r"^command: (.*)$", out, re.M)[1]
    for override in (
        "common.cpu=true",
        "distributed_training.distributed_world_size=4",
        "distributed_training.distributed_backend=gloo",
        "distributed_training.ddp_backend=legacy_ddp",
        "distributed_training.distributed_port=",
        "checkpoint.load_checkpoint_on_all_dp_ranks=true",
    ):
        assert override in command, override
    assert "distributed_init_method" not in command and "distributed_rank" not in command  # fairseq's Slurm init


THREADS = re.compile(r"^threads: OMP_NUM_THREADS=(\d+) per rank \((.*)\)$", re.M)
CORES = len(os.sched_getaffinity(0))  # what nproc counts
# the batch job of `sbatch --ntasks 1 --gpus 8 --cpus-per-task 80`: one task, whose script starts the ranks
ONE_TASK = {
    "SLURM_JOB_ID": "7",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "1",
    "SLURM_CPUS_ON_NODE": "80",
    "SLURM_CPUS_PER_TASK": "80",
}
# rank 0's task under scripts/slurm/pretrain.sbatch's srun: 8 nodes x 8 tasks (one a GPU) of 10 CPUs
PER_RANK = {
    "SLURM_JOB_ID": "7",
    "SLURM_NNODES": "8",
    "SLURM_NTASKS": "64",
    "SLURM_NTASKS_PER_NODE": "8",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_CPUS_ON_NODE": "80",
    "SLURM_CPUS_PER_TASK": "10",
}
NO_CPUS_PER_TASK = {k: v for k, v in PER_RANK.items() if k not in ("SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK")}
NODE_48 = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_CPUS_ON_NODE": "48"}  # sbatch --gpus 2, no --ntasks
# `sbatch --nodes 1 --ntasks-per-node 2 --gpus-per-node 0 --cpus-per-task 1 pretrain.sbatch --cpu`: a gloo rank
GLOO_TASKS = {
    "SLURM_JOB_ID": "7",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_CPUS_PER_TASK": "1",
}


def gpus(n):
    return [PRETRAIN, "--dry-run", "--gpus", str(n), CONFIG, "data"]


# set_threads alone, for GPUS ranks on the node (what the launchers set before they call it): a
# dry run costs seconds of hydra, this milliseconds
SET_THREADS = 'source "$0"; GPUS=$1; set_threads; echo "threads: $THREADS_NOTE"'


def thread_plan(cmd, env, tmp_path, cores=None, prefix=()):
    """OMP_NUM_THREADS and its reason from CMD's --dry-run plan (or, CMD a number of ranks, from
    launch_common.sh's set_threads), with no SLURM_* variable or OMP_NUM_THREADS but ENV's; CORES:
    nproc says so (the affinity of a node larger than this one)."""
    checkpoint = {"cfg": {"model": {"_name": "roberta", "max_positions": 512}}}  # what a finetuning plan reads
    torch.save(checkpoint, tmp_path / "model.pt")
    base = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS" and not k.startswith("SLURM_")}
    if cores is not None:
        fake = tmp_path / "bin" / "nproc"
        fake.parent.mkdir()
        fake.write_text(f"#!/bin/sh\necho {cores}\n")
        fake.chmod(0o755)
        base["PATH"] = f"{fake.parent}{os.pathsep}{base['PATH']}"
    if isinstance(cmd, int):
        cmd = ["bash", "-c", SET_THREADS, REPO / "scripts" / "launch_common.sh", cmd]
    proc = subprocess.run(
        [*prefix, *map(str, cmd)], cwd=tmp_path, env=base | env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (threads, why), *_ = THREADS.findall(proc.stdout)
    return int(threads), why


@pytest.mark.parametrize(
    "cmd, env, cores, expected, why",
    [
        # no Slurm: the cores this process may use / the ranks it starts, at least one
        (1, {}, None, CORES, f"no Slurm: the {CORES} core(s) this process may use;"),
        (8, {}, 80, 10, "no Slurm: the 80 core(s) this process may use / 8 rank(s)"),
        ([FINETUNE, "--dry-run", "--cpu", "sst_2", "model.pt"], {}, None, CORES, "no Slurm"),
        # one Slurm task that starts all the ranks of its node: the task's CPUs / those ranks
        (gpus(8), ONE_TASK, 80, 10, "one Slurm task, starting the node's 8 rank(s) itself: its --cpus-per-task 80 / 8"),
        (8, ONE_TASK | {"SLURM_CPUS_PER_TASK": "4"}, 80, 1, "its --cpus-per-task 4 / 8 rank(s)"),
        (8, ONE_TASK, 16, 2, "its --cpus-per-task 80 capped at the 16 core(s) this process may use / 8"),
        (2, NODE_48, 96, 24, "starting the node's 2 rank(s) itself: the node's 48 CPUs (SLURM_CPUS_ON_NODE) / 2"),
        (1, ONE_TASK | {"SLURM_CPUS_PER_TASK": "8"}, 96, 8, "1 rank(s) itself: its --cpus-per-task 8"),
        # srun starts the script once per rank: that task's CPUs
        (8, PER_RANK, 80, 10, "one Slurm task per rank (8 on the node): its --cpus-per-task 10"),
        (8, NO_CPUS_PER_TASK, 80, 10, "one Slurm task per rank (8 on the node): its 10 of the node's 80 CPUs"),
        ([PRETRAIN_SBATCH, "--dry-run", CONFIG, "data"], PER_RANK, 80, 10, "one Slurm task per rank (8 on the node)"),
        (2, GLOO_TASKS, None, 1, "one Slurm task per rank (2 on the node): its --cpus-per-task 1"),
        # a value the user exported is kept, whatever the ranks
        (64, ONE_TASK | {"OMP_NUM_THREADS": "5"}, None, 5, "yours, kept"),
        (1, {"OMP_NUM_THREADS": "3"}, None, 3, "yours, kept"),
    ],
    ids=[
        "no-slurm-1-gpu",
        "no-slurm-8-gpus",
        "no-slurm-cpu-finetune",
        "one-task-80-cpus-8-ranks",
        "one-task-at-least-1",
        "one-task-affinity-cap",
        "one-task-cpus-on-node",
        "one-task-finetune-array",
        "srun-task-per-rank",
        "srun-task-share-of-node",
        "sbatch-batch-step",
        "sbatch-cpu-gloo-ranks",
        "kept-under-slurm",
        "kept-cpu",
    ],
)
def test_plan_gives_each_rank_its_threads(cmd, env, cores, expected, why, tmp_path):
    """OMP_NUM_THREADS per rank in each launch shape: one Slurm task per rank, one task starting
    its node's ranks, no Slurm; never more than the cores this process may use, never below 1.
    Three shapes through the launchers' own --dry-run plans, the rest through set_threads."""
    threads, reason = thread_plan(cmd, env, tmp_path, cores)
    assert (threads, why in reason) == (expected, True), f"OMP_NUM_THREADS={threads} ({reason})"


@pytest.mark.skipif(not shutil.which("taskset"), reason="needs taskset (util-linux) to restrict the affinity")
@pytest.mark.parametrize("ranks, env", [(1, ONE_TASK), (8, PER_RANK)], ids=["one-task", "srun-task-per-rank"])
def test_plan_caps_the_threads_at_the_affinity(ranks, env, tmp_path):
    """A task bound to fewer cores than Slurm's counts say (here one, by taskset) runs on those
    only, as with a step given fewer CPUs per task than the job's --cpus-per-task."""
    core = min(os.sched_getaffinity(0))
    threads, reason = thread_plan(ranks, env, tmp_path, prefix=["taskset", "-c", str(core)])
    assert threads == 1 and "capped at the 1 core(s) this process may use" in reason, f"{threads} ({reason})"


def truncate(path, keep=0.5):
    """What a kill during fairseq's plain copy onto PATH leaves: the first part of the file."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_truncated_checkpoint_last_resumes_from_the_newest_complete_checkpoint(tmp_path, wikitext_bin):
    """checkpoint_last.pt (and checkpoint_best.pt) cut short by a kill during fairseq's copy:
    the relaunch resumes from checkpoint_1_8.pt, the newest checkpoint that loads. The data
    folder's path has spaces."""
    data = tmp_path / "data with spaces" / "wiki text"
    data.parent.mkdir()
    data.symlink_to(wikitext_bin)
    save = tmp_path / "save"
    cmd = [PRETRAIN, *SMOKE, "--save-dir", save, CONFIG, data, "checkpoint.save_interval_updates=4", *TINY]
    run(cmd + ["optimization.max_update=8"])
    log = save / "hydra_train.log"
    assert [int(r["num_updates"]) for r in records(log, "train_inner")] == list(range(1, 9))
    for copy in ("checkpoint_last.pt", "checkpoint_best.pt"):  # both are copies of checkpoint_1_8.pt
        truncate(save / copy)
    first_run = log.stat().st_size

    out = run(cmd + ["optimization.max_update=12"]).stdout
    assert (
        f"resume: {save}/checkpoint_last.pt does not load" in out
        and "resuming from the newest complete checkpoint, checkpoint_1_8.pt (8 updates)" in out
    ), out
    assert f"resume: from {save}/checkpoint_1_8.pt" in out
    text = log.read_text()[first_run:]
    assert f"Loaded checkpoint {save}/checkpoint_1_8.pt (epoch 1 @ 8 updates)" in text
    assert [int(r["num_updates"]) for r in records(log, "train_inner", start=first_run)] == [9, 10, 11, 12]
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == 12

    # nothing complete left: start from scratch rather than fail in fairseq (a dry run moves nothing)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "checkpoint_last.pt").write_bytes((save / "checkpoint_last.pt").read_bytes()[:1000])
    out = run([PRETRAIN, "--dry-run", *SMOKE, "--save-dir", empty, CONFIG, data]).stdout
    assert "holds no complete checkpoint: starting from scratch (would move it to checkpoint_last.pt.incomplete)" in out
    assert "resume: from" not in out and (empty / "checkpoint_last.pt").exists()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, wikitext_bin):
    """A CPU pretraining run through scripts/pretrain.sh, SIGKILLed a few updates after its
    checkpoint at update 10 and relaunched with the same command."""
    save = tmp_path_factory.mktemp("pretrain") / CONFIG
    cmd = [
        str(c)
        for c in [
            PRETRAIN,
            *SMOKE,
            "--save-dir",
            save,
            CONFIG,
            wikitext_bin,
            f"optimization.max_update={MAX_UPDATE}",
            f"checkpoint.save_interval_updates={SAVE_EVERY}",
            *TINY,
        ]
    ]
    log, output = save / "hydra_train.log", save.with_name("first-run.out")
    first = subprocess.Popen(
        cmd, env=ENV, stdout=output.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )  # its own process group, killed as one
    deadline = time.monotonic() + 300
    try:
        while first.poll() is None and time.monotonic() < deadline:
            done = records(log, "train_inner")
            if (save / "checkpoint_last.pt").exists() and done and int(done[-1]["num_updates"]) >= SAVE_EVERY + 3:
                os.killpg(first.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL, (
        f"the run ended ({first.returncode}) before it was killed:\n{output.read_text()[-3000:]}"
    )
    killed_at = log.stat().st_size
    run(cmd)
    return save, log, killed_at


def test_killed_run_resumes_without_lost_or_repeated_updates(resumed):
    save, log, killed_at = resumed
    before, after = records(log, "train_inner", end=killed_at), records(log, "train_inner", start=killed_at)
    done = [int(r["num_updates"]) for r in before]
    assert done == list(range(1, done[-1] + 1)) and SAVE_EVERY < done[-1] < MAX_UPDATE
    text = log.read_bytes()
    saved = re.findall(rb"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates", text[:killed_at])
    restored = re.search(rb"Loaded checkpoint \S+checkpoint_last.pt \(epoch \d+ @ (\d+) updates\)", text[killed_at:])
    checkpoint = int(saved[-1])  # the last save before the kill
    assert checkpoint % SAVE_EVERY == 0 and restored and int(restored.group(1)) == checkpoint
    redone = [int(r["num_updates"]) for r in after]
    assert redone == list(range(checkpoint + 1, MAX_UPDATE + 1))  # nothing skipped, nothing twice
    assert sorted(done[:checkpoint] + redone) == list(range(1, MAX_UPDATE + 1))
    # the updates lost with the kill are redone on the same batches from the same state
    lost = range(checkpoint + 1, done[-1] + 1)
    assert [by_update(before)[u] for u in lost] == [by_update(after)[u] for u in lost]
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == MAX_UPDATE


def test_tensorboard_has_the_training_loss(resumed):
    save, log, _ = resumed
    events = EventAccumulator(str(save / "tensorboard" / "train_inner"), size_guidance={"scalars": 0}).Reload()
    logged = by_update(records(log, "train_inner"))
    scalars = {e.step: e.value for e in events.Scalars("loss")}  # the relaunch rewrites redone steps
    assert sorted(scalars) == list(range(1, MAX_UPDATE + 1))
    assert all(abs(scalars[u] - logged[u]) < 1e-3 for u in scalars), "tensorboard and the log disagree"
    valid = EventAccumulator(str(save / "tensorboard" / "valid")).Reload()
    assert [e.step for e in valid.Scalars("loss")][-1] == MAX_UPDATE


@pytest.mark.parametrize("optimizer", ["adam", "adam_fused"])
def test_bf16_steps_on_cpu(optimizer, tmp_path, wikitext_bin):
    """common.bf16=true through the launcher, with fairseq's adam and with the plugin's adam_fused."""
    save = tmp_path / "bf16"
    run(
        [
            PRETRAIN,
            *SMOKE,
            "--save-dir",
            save,
            CONFIG,
            wikitext_bin,
            "common.bf16=true",
            f"optimizer._name={optimizer}",
            "optimization.max_update=24",
            "optimization.lr=[0.002]",
            "checkpoint.save_interval_updates=0",
            *TINY,
        ]
    )
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["cfg"]["common"]["bf16"]
    # fairseq's mixed-precision wrapper: bf16 model, fp32 master weights in the optimizer
    assert state["optimizer_history"][-1]["optimizer_name"] == "FP16Optimizer"
    assert state["cfg"]["optimizer"]["_name"] == optimizer
    loss = [float(r["loss"]) for r in records(save / "hydra_train.log", "train_inner")]
    assert len(loss) == 24 and all(math.isfinite(x) for x in loss)
    first, last = sum(loss[:4]) / 4, sum(loss[-4:]) / 4
    assert last < first - 0.5, f"bf16 training did not learn: loss {first:.3f} -> {last:.3f}"


@pytest.fixture(scope="module")
def sst2_bin(tmp_path_factory, wikitext_bin):
    return build_sst2_bin(tmp_path_factory.mktemp("SST-2-bin"), wikitext_bin)


def test_finetune_from_the_pretrained_checkpoint(resumed, sst2_bin, tmp_path):
    """finetune.sh takes the model from the checkpoint, writes the layout collect_results.py
    reads, and a relaunch resumes the finetuning run instead of restarting it."""
    pretrained = resumed[0] / "checkpoint_last.pt"
    (tmp_path / "data-bin").mkdir()  # the default --data-root: data-prep's --destdir in the READMEs
    (tmp_path / "data-bin" / "SST-2-bin").symlink_to(sst2_bin)
    args = [pretrained, "optimization.max_epoch=2", "optimization.lr=[0.001]"]
    run([FINETUNE, "--cpu", "--global-batch", "16", "--batch-size", "16", "--seed", "3", "sst-2", *args], cwd=tmp_path)
    save = tmp_path / "checkpoints" / "finetune" / CONFIG / "sst_2" / "seed3"
    cfg = OmegaConf.load(save / ".hydra" / "config.yaml")
    pretraining = torch.load(pretrained, map_location="cpu", weights_only=True)["cfg"]["model"]
    for key in ("_name", "encoder_layers", "encoder_embed_dim", "compressed_dim", "compress_sharing", "max_positions"):
        assert cfg.model[key] == pretraining[key], key
    assert cfg.task.max_positions == 32 and cfg.common.seed == 3
    log = (save / "hydra_train.log").read_text()
    assert f"Loaded checkpoint {pretrained} (epoch" in log
    accuracy = [float(r["accuracy"]) for r in records(save / "hydra_train.log", "valid")]
    assert len(accuracy) == 2

    table = run(COLLECT + [tmp_path / "checkpoints" / "finetune"]).stdout.splitlines()
    assert table[0] == "| model | SST-2 (accuracy) | Average |"
    assert table[2] == f"| {CONFIG} | {max(accuracy):.1f} ± 0.0 (1) | {max(accuracy):.2f} |"

    # dataset.max_tokens caps a step below 16 inputs of the model's 32 tokens: the plan says so
    plan = [FINETUNE, "--dry-run", "--cpu", "--global-batch", "32", "--batch-size", "16", "sst-2", *args]
    out = run(plan + ["dataset.max_tokens=100"], cwd=tmp_path).stdout
    assert "dataset.max_tokens 100: a step holds 3 input(s) of 32 tokens (shorter ones, up to 16)" in out
    assert "an update of inputs that long holds 6, not the global batch of 32" in out
    assert "a step holds" not in run(plan + ["dataset.max_tokens=512"], cwd=tmp_path).stdout
    refused = subprocess.run(plan + ["dataset.max_tokens=20"], cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert refused.returncode == 2 and "less than one input of 32 tokens" in refused.stderr, refused.stderr

    # the Slurm array's element 0 is this run again: it resumes from its checkpoint_last.pt
    out = run([FINETUNE_SBATCH, "--dry-run", "--tasks", "sst_2,rte", "--seeds", "3,4", *args], cwd=tmp_path).stdout
    elements = re.findall(r"^element (\d): .*--seed (\d) (\w+) ", out, re.M)
    assert elements == [("0", "3", "sst_2"), ("1", "4", "sst_2"), ("2", "3", "rte"), ("3", "4", "rte")]
    assert f"resume: from {save}/checkpoint_last.pt" in out
    assert "checkpoint.restore_file=checkpoint_last.pt checkpoint.reset_optimizer=false" in out

    # killed while fairseq copied checkpoint_best.pt onto checkpoint_last.pt: resume from the best
    truncate(save / "checkpoint_last.pt")
    out = run([FINETUNE_SBATCH, "--dry-run", "--tasks", "sst_2", "--seeds", "3", *args], cwd=tmp_path).stdout
    assert "resuming from the newest complete checkpoint, checkpoint_best.pt" in out
    assert f"resume: from {save}/checkpoint_best.pt" in out
    assert re.search(
        r"checkpoint\.restore_file=\\'\S+/checkpoint_best\.pt\\' checkpoint\.reset_optimizer=false", out
    ), out


def write_run(root, model, task, seed, metric, scores, maximize=True):
    run_dir = root / model / task / f"seed{seed}"
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(
        {"checkpoint": {"best_checkpoint_metric": metric, "maximize_best_checkpoint_metric": maximize}},
        run_dir / ".hydra" / "config.yaml",
    )
    lines = [
        f'[2026-01-01 00:00:0{i},000][valid][INFO] - {{"epoch": {i + 1}, "valid_loss": "0.5", '
        f'"valid_{metric}": "{score}", "valid_num_updates": "{100 * (i + 1)}"}}'
        for i, score in enumerate(scores)
    ]
    (run_dir / "hydra_train.log").write_text(
        "\n".join(["[2026-01-01 00:00:00,000][fairseq_cli.train][INFO] - start"] + lines) + "\n"
    )


def test_collect_results_mean_and_spread_of_best_dev_scores(tmp_path):
    write_run(tmp_path, "linformer", "sst_2", 1, "accuracy", [88.0, 91.0, 90.0])  # best 91
    write_run(tmp_path, "linformer", "sst_2", 2, "accuracy", [93.0, 92.5])  # best 93
    write_run(tmp_path, "linformer", "cola", 1, "mcc", [55.0, 61.5])
    write_run(tmp_path, "roberta", "sst_2", 1, "accuracy", [94.0])
    table = run(COLLECT + [tmp_path]).stdout.splitlines()
    assert table == [
        "| model | SST-2 (accuracy) | CoLA (mcc) | Average |",
        "| --- | --- | --- | --- |",
        "| linformer | 92.0 ± 1.4 (2) | 61.5 ± 0.0 (1) | 76.75 |",  # stdev of 91, 93 = 1.41
        "| roberta | 94.0 ± 0.0 (1) | - | - |",
    ]
