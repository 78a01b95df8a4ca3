"""Distributed data parallel for real: two processes (gloo on loopback) with 4 sequences each
must train exactly like one process accumulating the same 8 sequences (update_freq 2), which
holds only if the two ranks' gradients are summed before every update."""

import socket
import subprocess
import sys

import pytest
import torch
from conftest import CONFIG, ENV, REPO, TINY

import linformer_fairseq  # noqa: F401  (its checkpoints load with weights_only=True)
from linformer_tools.logs import by_update, records

pytestmark = pytest.mark.slow  # end-to-end training runs

UPDATES = 8
# a sum of two gradients is the same whether gloo or the accumulation adds them; allow for a
# different summation order, far below what one update moves a weight (checked below)
TOLERANCE = 1e-6


def train(save, world, update_freq, *extra):
    return [
        sys.executable,
        "-m",
        "fairseq_cli.hydra_train",
        "--config-dir",
        REPO / "configs" / "pretraining",
        "--config-name",
        CONFIG,
        f"common.user_dir={REPO / 'linformer_fairseq'}",
        "common.cpu=true",
        "common.fp16=false",
        f"checkpoint.save_dir={save}",
        f"hydra.run.dir={save}",
        "dataset.batch_size=4",
        f"optimization.update_freq=[{update_freq}]",
        f"distributed_training.distributed_world_size={world}",
        f"optimization.max_update={UPDATES}",
        f"checkpoint.save_interval_updates={UPDATES // 2}",
        "model.dropout=0",
        "model.attention_dropout=0",  # ranks and steps draw dropout differently
        *TINY,
        *extra,
    ]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def test_two_ranks_train_like_one_rank_with_update_freq_2(tmp_path, wikitext_bin):
    port = free_port()
    ranks = [
        train(
            tmp_path / "two" if rank == 0 else tmp_path / f"rank{rank}",
            2,
            1,
            f"task.data={wikitext_bin}",
            "distributed_training.distributed_backend=gloo",
            "distributed_training.ddp_backend=legacy_ddp",
            "distributed_training.distributed_no_spawn=true",
            f"distributed_training.distributed_init_method=tcp://127.0.0.1:{port}",
            f"distributed_training.distributed_rank={rank}",
        )
        for rank in (0, 1)
    ]
    single = train(tmp_path / "one", 1, 2, f"task.data={wikitext_bin}")
    procs = [
        subprocess.Popen(
            [str(c) for c in cmd], env=ENV, stdout=subprocess.DEVNULL, stderr=(tmp_path / f"run{i}.err").open("w")
        )
        for i, cmd in enumerate(ranks + [single])
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:  # a rank left waiting for its peer must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0], [(tmp_path / f"run{i}.err").read_text()[-2000:] for i in range(3)]

    log_two, log_one = tmp_path / "two" / "hydra_train.log", tmp_path / "one" / "hydra_train.log"
    assert "training on 2 devices" in log_two.read_text() and "training on 1 devices" in log_one.read_text()
    two, one = by_update(records(log_two, "train_inner")), by_update(records(log_one, "train_inner"))
    assert list(two) == list(range(1, UPDATES + 1))
    assert two == one, "the logged loss (both ranks' batches) differs from one process's"

    final_two, final_one = (
        weights(tmp_path / "two" / "checkpoint_last.pt"),
        weights(tmp_path / "one" / "checkpoint_last.pt"),
    )
    halfway = weights(tmp_path / "one" / f"checkpoint_1_{UPDATES // 2}.pt")
    gap = max((final_two[k] - final_one[k]).abs().max().item() for k in final_one)
    moved = max((final_one[k] - halfway[k]).abs().max().item() for k in final_one)
    assert gap <= TOLERANCE, f"2 ranks vs 1 rank x update_freq 2: weights differ by {gap:.2e} > {TOLERANCE}"
    assert moved > 100 * TOLERANCE, f"the last {UPDATES // 2} updates moved the weights only {moved:.2e}"
