"""LP-FT (scripts/probe_head.py, linformer_tools/probe.py): the head a linear probe fits computes
the probe, round-trips through a checkpoint into finetune.sh, and a group frozen while finetuning
(--freeze-compress) gets no update while the rest does."""

import json
import sys

import pytest
import torch
from conftest import SCRIPTS
from fairseq.models.roberta.model import RobertaClassificationHead
from test_long_documents import data, run  # noqa: F401  (data: the module's data-bins, a fixture)

from linformer_tools.logs import records
from linformer_tools.probe import fit_linear_probe, head_weights

HEAD = "sentence_classification_head"


def linear_task(g, sizes, dim=16):
    features = {split: torch.randn(rows, dim, generator=g) * 3 + 1 for split, rows in sizes.items()}
    direction = torch.randn(dim, generator=g)
    labels = {split: (f @ direction + 0.5 * torch.randn(len(f), generator=g) > direction.sum()).long()
              for split, f in features.items()}  # fmt: skip
    return features, labels


def test_the_probe_reads_a_linear_label_and_not_a_shuffled_one():
    """Labels a linear function of the features (with noise) are read back on rows the fit never
    saw; shuffled training labels leave it at chance; the penalty is the one best on validation
    (a strong one, when validation labels are the reverse of the rule)."""
    g = torch.Generator().manual_seed(0)
    features, labels = linear_task(g, {"train": 300, "valid": 100, "test": 400})
    probe = fit_linear_probe(features, labels)
    assert probe.valid > 0.9 and probe.logits(features["test"]).argmax(1).eq(labels["test"]).double().mean() > 0.9
    shuffled = dict(labels, train=labels["train"][torch.randperm(300, generator=g)])
    guesses = fit_linear_probe(features, shuffled).logits(features["test"]).argmax(1)
    assert 0.35 < guesses.eq(labels["test"]).double().mean() < 0.65
    reversed_valid = dict(labels, valid=1 - labels["valid"])  # the weaker the fit, the better it scores
    assert fit_linear_probe(features, reversed_valid, penalties=(1e-3, 1e3)).penalty == 1e3


@pytest.mark.parametrize("activation", ["tanh", "linear"])
def test_the_head_computes_the_probe(activation):
    """fairseq's head (dense, activation, out_proj) loaded with head_weights gives the probe's
    logits within tanh's curvature at the chosen slope, and its predictions."""
    g = torch.Generator().manual_seed(1)
    features, labels = linear_task(g, {"train": 200, "valid": 100, "test": 300}, dim=24)
    probe = fit_linear_probe(features, labels)
    head = RobertaClassificationHead(24, 24, 2, activation, 0.0).eval()
    head.load_state_dict(head_weights(probe, activation))
    with torch.no_grad():
        got = head(features["test"].unsqueeze(1)).double()  # the head reads position 0
    want = probe.logits(features["test"])
    tolerance = 0.02 if activation == "tanh" else 1e-4
    assert (got - want).abs().max() <= tolerance * want.abs().max(), (got - want).abs().max()
    assert got.argmax(1).eq(want.argmax(1)).double().mean() > 0.99
    with pytest.raises(AssertionError, match="tanh or linear, not gelu"):
        head_weights(probe, "gelu")


@pytest.mark.slow
def test_a_probe_head_round_trips_into_finetune_sh_and_a_frozen_group_stays(data, tmp_path):  # noqa: F811
    """probe_head.py writes a checkpoint whose head predicts as the probe (of the mean of the
    final states); finetune.sh starts from that head (not a fresh one) and keeps the mean; with
    model.freeze_compress=1 the projections leave finetuning bit for bit while the attention and
    the head move."""
    tiny = ["model.encoder_layers=2", "model.encoder_embed_dim=32", "model.encoder_ffn_embed_dim=64"]
    tiny += ["model.encoder_attention_heads=2", "common.log_interval=1", "dataset.num_workers=0"]
    cpu = ["--cpu", "--batch-size", "8", "--global-batch", "8"]
    run([SCRIPTS / "pretrain.sh", *cpu, "--save-dir", tmp_path / "pretrain", "quickstart", data / "bin/shard0", *tiny]
        + ["task.tokens_per_sample=64", "model.compressed_dim=16", "optimization.max_update=4"])  # fmt: skip
    probed = tmp_path / "probed.pt"
    out = run([sys.executable, SCRIPTS / "probe_head.py", tmp_path / "pretrain/checkpoint_last.pt", "--data",
               data / "IMDB-bin", "--truncation", "head_tail", "--truncation-head-tokens", 16, "--out", probed,
               "--device", "cpu", "--pooler-tokens", "mean"]).stdout  # fmt: skip
    report = json.loads(out.strip().splitlines()[-1])
    assert report["agreement"] == 100.0 and report["head_valid_accuracy"] == report["valid_accuracy"], out

    save = tmp_path / "imdb"
    run([SCRIPTS / "finetune.sh", *cpu, "--data", data / "IMDB-bin", "--save-dir", save, "imdb", probed]
        + ["optimization.max_update=2", "lr_scheduler.warmup_updates=1", "task.truncation_head_tokens=16"]
        + ["model.freeze_compress=1", "++task.log_parameter_groups=true", "common.log_interval=1"],
        cwd=tmp_path)  # fmt: skip
    log = (save / "hydra_train.log").read_text()
    assert "deleting classification head" not in log
    start = torch.load(probed, map_location="cpu", weights_only=True)["model"]
    finetuned = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert finetuned["cfg"]["model"]["pooler_tokens"] == "mean"
    end = finetuned["model"]
    prefix = f"classification_heads.{HEAD}."
    for name in ("dense.weight", "out_proj.weight"):  # two updates at lr 1e-5 from the probe's head
        moved = (end[prefix + name] - start[prefix + name]).abs().max()
        assert 0 < moved < 1e-3 < start[prefix + name].abs().max(), (name, moved)
    frozen = [name for name in start if ".compress_" in name]
    assert frozen and all(torch.equal(start[name], end[name]) for name in frozen)
    assert not torch.equal(start["encoder.sentence_encoder.layers.0.self_attn.q_proj.weight"],
                           end["encoder.sentence_encoder.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    steps = list(records(save / "hydra_train.log", "train_inner"))
    assert steps and all("gshare_head" in s and "gshare_projections" not in s for s in steps), steps
