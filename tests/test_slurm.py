"""scripts/slurm/*.sbatch submitted for real, to a one-node Slurm cluster on this machine
(tests/slurm/cluster.sh, started and stopped by this module): two CPU ranks (gloo) placed by
fairseq's own Slurm init train like one process, a requeued job resumes without losing or
repeating an update, a finetuning array runs from the checkpoint and collect_results.py
tabulates it, and bad input fails the job at once with the launcher's message.

Needs Slurm and munge (Debian: apt-get install slurm-wlm munge) and root. Without them these
tests FAIL with that hint; deselect them explicitly with `--ignore tests/test_slurm.py` (or
-k "not test_slurm")."""

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CONFIG, ENV, REPO, SCRIPTS, TINY, build_sst2_bin
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import linformer_fairseq  # noqa: F401  (its checkpoints load with weights_only=True)
from linformer_tools.logs import by_update, records

pytestmark = pytest.mark.slow(minutes=4)

CLUSTER = REPO / "tests" / "slurm" / "cluster.sh"
PRETRAIN_SBATCH, FINETUNE_SBATCH = SCRIPTS / "slurm" / "pretrain.sbatch", SCRIPTS / "slurm" / "finetune.sbatch"
BINARIES = ["munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue"]
# two CPU tasks on the test node (its sbatch defaults ask for 8 nodes x 8 GPUs x 10 CPUs)
TWO_CPU_RANKS = ["--nodes", "1", "--ntasks-per-node", "2", "--gpus-per-node", "0", "--cpus-per-task", "1"]
# 4 sequences per rank x 2 ranks = a global batch of 8; no dropout, so that the two ranks can
# be compared with one process that accumulates the same 8 sequences
CPU_BATCH = ["--cpu", "--global-batch", "8", "--batch-size", "4"]
NO_DROPOUT = ["model.dropout=0", "model.attention_dropout=0"]
MAX_UPDATE, SAVE_EVERY = 24, 8
DONE = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


def sh(cmd, env, cwd=None, ok=True, timeout=120):
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert ok is None or (proc.returncode == 0) == ok, (
        f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The environment of a running test cluster (SLURM_CONF), stopped after the module."""
    missing = [b for b in BINARIES if not (shutil.which(b) or Path("/usr/sbin", b).exists())]
    if missing:
        pytest.fail(
            f"Slurm/munge binaries missing ({' '.join(missing)}): install them with "
            "`apt-get install slurm-wlm munge`, or deselect these tests with --ignore tests/test_slurm.py",
            pytrace=False,
        )
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run([str(CLUSTER), "up", str(state)], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, f"tests/slurm/cluster.sh up failed:\n{up.stdout}\n{up.stderr}"
    env = dict(ENV, SLURM_CONF=str(state / "slurm.conf"), PATH=f"{ENV.get('PATH', '')}:/usr/sbin")
    try:
        yield env
    finally:
        down = subprocess.run([str(CLUSTER), "down", str(state)], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, down.stderr


def submit(env, sbatch_args, script, args, cwd):
    out = sh(["sbatch", "--parsable", *sbatch_args, script, *args], env, cwd=cwd).stdout
    return out.strip().split(";")[0]


def job_states(env, job):
    """{job or array element id: (state, exit code, restarts)} from scontrol; also the
    pending reasons, under "reasons"."""
    out = sh(["scontrol", "--oneliner", "show", "job", job], env).stdout
    states, reasons = {}, set()
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        element = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}" if "ArrayTaskId" in fields else fields["JobId"]
        states[element] = (fields["JobState"], fields["ExitCode"], int(fields["Restarts"]))
        if fields["JobState"] == "PENDING":
            reasons.add(fields.get("Reason"))
    return states, reasons


def all_done(states):
    return all(state in DONE for state, _, _ in states.values())


def wait(env, job, until=all_done, timeout=300):
    """Poll the job until `until(states)`; fail if it pends for a minute (it would never run)."""
    deadline, pending_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        states, reasons = job_states(env, job)
        if until(states):
            return states
        pending = any(state == "PENDING" for state, _, _ in states.values())
        pending_since = (pending_since or time.monotonic()) if pending else None
        if pending_since and time.monotonic() - pending_since > 60:
            break
        time.sleep(0.2)
    sh(["scancel", job], env, ok=None)
    pytest.fail(f"job {job}: {job_states(env, job)} after {timeout} s (or pending for 60 s)")


def pretrain_args(save, data, max_update, *extra):
    return [
        *CPU_BATCH,
        "--save-dir",
        save,
        CONFIG,
        data,
        f"optimization.max_update={max_update}",
        f"checkpoint.save_interval_updates={SAVE_EVERY}",
        *TINY,
        *NO_DROPOUT,
        *extra,
    ]


def updates(stats):
    return [int(s["num_updates"]) for s in stats]


@pytest.fixture(scope="module")
def slurm_pretrained(slurm, tmp_path_factory, wikitext_bin):
    """sbatch scripts/slurm/pretrain.sbatch --cpu with 2 tasks, submitted from a scratch folder."""
    work = tmp_path_factory.mktemp("pretrain-job")
    save = work / "two-ranks"
    job = submit(
        slurm,
        TWO_CPU_RANKS + ["--output", work / "%x-%j.out"],
        PRETRAIN_SBATCH,
        pretrain_args(save, wikitext_bin, MAX_UPDATE),
        cwd=work,
    )
    states = wait(slurm, job)
    output = (work / f"linformer-pretrain-{job}.out").read_text()
    assert states[job][:2] == ("COMPLETED", "0:0"), output[-5000:]
    return save, output


def test_two_cpu_ranks_train_like_one_process(slurm_pretrained, tmp_path, wikitext_bin):
    save, output = slurm_pretrained
    assert "srun: 1 node(s) x 2 task(s), one CPU process (gloo rank) each" in output
    assert "plan: CPU (gloo), 1 node(s) x 2 process(es) = world size 2" in output
    assert "batch: 4 sequences per GPU x update_freq 1 x world size 2 = global batch 8" in output
    # fairseq's Slurm init placed them (SLURM_PROCID): no init method on the command line
    assert "Rank 0, device_id: 0" in output and "Rank 1, device_id: 0" in output, output[-5000:]
    assert "distributed init (rank 1): tcp://" in output and "training on 2 devices" in output
    assert "Traceback" not in output
    log = save / "hydra_train.log"
    two = by_update(records(log, "train_inner"))
    assert list(two) == list(range(1, MAX_UPDATE + 1))
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == MAX_UPDATE
    assert state["cfg"]["distributed_training"]["distributed_world_size"] == 2
    assert {p.name for p in save.glob("checkpoint_1_*.pt")} == {f"checkpoint_1_{u}.pt" for u in (8, 16, 24)}
    events = EventAccumulator(str(save / "tensorboard" / "train_inner"), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, MAX_UPDATE + 1))

    # in step: every update summed both ranks' gradients, exactly as one process accumulating
    # the same 8 sequences in 2 steps of 4 (update_freq 2) does
    one = tmp_path / "one-rank"
    sh([SCRIPTS / "pretrain.sh", *pretrain_args(one, wikitext_bin, MAX_UPDATE)], ENV, timeout=600)
    single = by_update(records(one / "hydra_train.log", "train_inner"))
    assert two == single, "the two ranks' logged loss differs from one process's"


def test_requeued_job_resumes_without_lost_or_repeated_updates(slurm, tmp_path, wikitext_bin):
    """USR1, the signal the job's --signal names before its time limit, makes the job requeue
    itself; the requeued job resumes from the last checkpoint and stops at max_update."""
    max_update = 120  # room to signal the job after its first checkpoint, well before its end
    save, log = tmp_path / "save", tmp_path / "save" / "hydra_train.log"
    job = submit(
        slurm,
        TWO_CPU_RANKS + ["--output", tmp_path / "job.out"],
        PRETRAIN_SBATCH,
        pretrain_args(save, wikitext_bin, max_update),
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done = updates(records(log, "train_inner"))
        if done and done[-1] >= SAVE_EVERY + 3:
            break
        assert job_states(slurm, job)[0][job][0] in ("PENDING", "RUNNING"), (tmp_path / "job.out").read_text()[-3000:]
        time.sleep(0.05)
    else:
        pytest.fail("the job did not get past its first checkpoint")
    sh(["scancel", "--signal=USR1", "--batch", job], slurm)
    # the requeue ends every process of the first run, then the job pends until the begin time
    # Slurm gives a requeued job (cred_expire, 5 s on the test cluster) and starts again
    wait(slurm, job, until=lambda s: s[job][0] == "PENDING" and s[job][2] == 1, timeout=120)
    killed_at = log.stat().st_size
    states = wait(slurm, job)
    output = (tmp_path / "job.out").read_text()
    assert states[job] == ("COMPLETED", "0:0", 1), output[-5000:]
    assert f"time limit or preemption: requeueing job {job}" in output
    assert f"job {job}, restart 1" in output

    before, after = records(log, "train_inner", end=killed_at), records(log, "train_inner", start=killed_at)
    done = updates(before)
    assert done == list(range(1, done[-1] + 1)) and SAVE_EVERY < done[-1] < max_update
    text = log.read_text()
    saved = re.findall(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates", text[:killed_at])
    restored = re.search(r"Loaded checkpoint (\S+) \(epoch \d+ @ (\d+) updates\)", text[killed_at:])
    assert restored, output[-5000:]
    checkpoint = int(restored.group(2))
    # checkpoint_last.pt, or the newest complete one if the requeue cut fairseq's copy short
    assert checkpoint == int(saved[-1]) and checkpoint % SAVE_EVERY == 0
    assert restored.group(1).endswith("checkpoint_last.pt") or "does not load" in output
    redone = updates(after)
    assert redone == list(range(checkpoint + 1, max_update + 1))  # nothing skipped, nothing twice
    assert done[:checkpoint] + redone == list(range(1, max_update + 1))
    lost = range(checkpoint + 1, done[-1] + 1)  # redone from the same state on the same batches
    assert [by_update(before)[u] for u in lost] == [by_update(after)[u] for u in lost]
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == max_update


def test_finetune_array_and_results_table(slurm, slurm_pretrained, tmp_path, wikitext_bin):
    """sbatch --array=0-1 scripts/slurm/finetune.sbatch: SST-2 with seeds 1 and 2 from the
    checkpoint, with the data where data-prep puts it (data-bin/SST-2-bin under the submit folder)."""
    build_sst2_bin(tmp_path / "data-bin" / "SST-2-bin", wikitext_bin)
    pretrained = slurm_pretrained[0] / "checkpoint_last.pt"
    job = submit(
        slurm,
        ["--array=0-1", "--gpus", "0", "--cpus-per-task", "1", "--output", tmp_path / "%x-%A_%a.out"],
        FINETUNE_SBATCH,
        [
            "--cpu",
            "--global-batch",
            "16",
            "--batch-size",
            "16",
            "--tasks",
            "sst_2",
            "--seeds",
            "1,2",
            pretrained,
            "optimization.max_epoch=1",
            "optimization.lr=[0.001]",
        ],
        cwd=tmp_path,
    )
    states = wait(slurm, job)
    outputs = {i: (tmp_path / f"linformer-finetune-{job}_{i}.out").read_text() for i in (0, 1)}
    assert sorted(states) == [f"{job}_0", f"{job}_1"]
    assert all(state[:2] == ("COMPLETED", "0:0") for state in states.values()), outputs
    root = tmp_path / "checkpoints" / "finetune"
    for seed in (1, 2):
        run = root / "two-ranks" / "sst_2" / f"seed{seed}"
        assert f"Loaded checkpoint {pretrained} (epoch" in (run / "hydra_train.log").read_text()
        assert len(records(run / "hydra_train.log", "valid")) == 1
    table = sh([sys.executable, SCRIPTS / "collect_results.py", root], ENV).stdout.splitlines()
    assert table[0] == "| model | SST-2 (accuracy) | Average |"
    assert re.fullmatch(r"\| two-ranks \| \d+\.\d ± \d+\.\d \(2\) \| \d+\.\d\d \|", table[2]), table


@pytest.mark.parametrize(
    "args, message",
    [
        (["nope", "."], "error: no config "),
        ([CONFIG, "/no/such/data"], "error: data folder /no/such/data does not exist"),
    ],
    ids=["config", "data"],
)
def test_bad_input_fails_the_job_at_once_with_the_launchers_message(slurm, tmp_path, args, message):
    start = time.monotonic()
    job = submit(
        slurm,
        TWO_CPU_RANKS + ["--output", tmp_path / "job.out"],
        PRETRAIN_SBATCH,
        [*CPU_BATCH, "--save-dir", tmp_path / "save", *args],
        cwd=tmp_path,
    )
    states = wait(slurm, job, timeout=120)
    output = (tmp_path / "job.out").read_text()
    assert states[job][:2] == ("FAILED", "2:0"), output
    assert message in output and "Traceback" not in output, output
    assert time.monotonic() - start < 60
