"""scripts/quickstart.sh, the project's main job: sample text -> pretrained and finetuned Linformer."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow(minutes=7)  # end-to-end training runs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "quickstart.sh"


def quickstart(out, *extra):
    r = subprocess.run(
        [str(SCRIPT), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert r.returncode == 0, f"quickstart failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


# half the default budget (400 updates, 4 epochs): the loss still falls over 2 validations and
# SST-2 clears the majority class, in the time CI has
BUDGET = ("--pretrain-updates", "200", "--finetune-epochs", "3")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart")
    return out, quickstart(out, *BUDGET)


def results(stdout):
    loss = re.search(r"pretraining validation loss: ([\d.]+) -> ([\d.]+) .*?(\d+) validations", stdout)
    acc = re.search(r"SST-2 dev accuracy: ([\d.]+)% .*\(majority class: ([\d.]+)%\)", stdout)
    assert loss and acc, stdout[-2000:]
    return [float(v) for v in loss.groups()], [float(v) for v in acc.groups()]


def test_pretraining_validation_loss_falls(run):
    (first, last, validations), _ = results(run[1])
    assert validations >= 2 and last < first


def test_sst2_accuracy_above_chance(run):
    _, (accuracy, majority) = results(run[1])
    assert accuracy >= majority + 5


def test_outputs_are_where_it_says(run):
    out, stdout = run
    for path in (
        "pretrain/checkpoint_best.pt",
        "sst2/checkpoint_best.pt",
        "pretrain/hydra_train.log",
        "sst2/hydra_train.log",
        "pretrain.log",
        "sst2.log",
        "data-bin/shard0/train.bin",
        "data-bin/shard1/train.bin",
        "glue/SST-2-bin/label/dict.txt",
        "spm/spm.model",
    ):
        assert (out / path).is_file(), path
    for said in (
        f"checkpoints: {out}/pretrain/ and {out}/sst2/",
        f"tensorboard --logdir {out}",
        f"logs: {out}/pretrain/hydra_train.log",
    ):
        assert said in stdout
    for stage in ("pretrain", "sst2"):
        assert list((out / stage / "tensorboard").rglob("events.out.tfevents.*")), stage
    assert not list(out.rglob("*.partial"))


def test_second_run_reuses_every_step(run):
    out, stdout = run
    again = quickstart(out, *BUDGET)
    for step in ("corpus", "sentencepiece training", "encoding", "binarizing", "SST-2", "pretrain", "sst2"):
        assert f"skip {step}" in again, step
    assert results(again) == results(stdout)


def test_roberta_baseline_beside_the_linformer(run):
    """--roberta trains fairseq's RoBERTa of the same size on the same data, next to the
    Linformer's outputs, reusing the data steps (a smaller budget here: the test is of
    the baseline's path, not of its quality)."""
    import torch

    import linformer_fairseq  # noqa: F401  (allow-lists the Namespace in RoBERTa's checkpoint)

    out, stdout = run
    baseline = quickstart(out, "--roberta", "--pretrain-updates", "120", "--finetune-epochs", "1")
    for step in ("corpus", "sentencepiece training", "binarizing", "SST-2"):
        assert f"skip {step}" in baseline, step
    (first, last, _), (accuracy, majority) = results(baseline)
    assert last < first and accuracy > majority
    assert f"logs: {out}/pretrain-roberta/hydra_train.log and {out}/sst2-roberta/hydra_train.log" in baseline
    models = {}
    for name in ("pretrain", "pretrain-roberta"):
        cfg = torch.load(out / name / "checkpoint_best.pt")["cfg"]["model"]
        cfg = cfg if isinstance(cfg, dict) else {**vars(cfg), "_name": cfg.arch}  # RoBERTa's is a Namespace
        models[name] = (cfg["_name"], cfg["encoder_layers"], cfg["encoder_embed_dim"])
    assert models == {"pretrain": ("linformer_roberta", 2, 128), "pretrain-roberta": ("roberta", 2, 128)}
    assert results(stdout) == results(quickstart(out, *BUDGET)), "the baseline changed the Linformer's results"


def test_help_and_bad_argument():
    r = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--pretrain-updates" in r.stdout
    r = subprocess.run([str(SCRIPT), "--pretrain-updates", "many"], capture_output=True, text=True)
    assert r.returncode == 2 and "'many' is not a positive integer" in r.stderr
