"""LP-FT (scripts/probe_head.py, linformer_tools/probe.py): the head a linear probe fits computes
the probe, round-trips through a checkpoint into finetune.sh, and a group frozen while finetuning
(--freeze-compress) gets no update while the rest does."""

import json
import subprocess

import pytest
import torch
from conftest import ENV, SCRIPTS, build_sst2_bin
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


def test_a_feature_that_does_not_vary_is_neither_weighed_nor_amplified():
    """A dimension whose values differ across documents only by rounding noise (all-MiniLM-L6-v2 has
    three) gets no weight from the probe, and the head's dense layer amplifies it no more than 100
    times a typical feature: finetuning that moves it by 1e-3 moves the logits by less than 0.01."""
    g = torch.Generator().manual_seed(2)
    features, labels = linear_task(g, {"train": 300, "valid": 100}, dim=16)
    dead = {split: torch.cat([f, 1e-7 * torch.randn(len(f), 1, generator=g)], 1) for split, f in features.items()}
    probe = fit_linear_probe(dead, labels)
    assert probe.weight[-1].abs().max() < 1e-3 * probe.weight[:-1].abs().max(), probe.weight[-1]
    weights = head_weights(probe, "tanh")
    gains = weights["dense.weight"].diagonal()
    assert gains[-1] <= 100.01 * gains.median(), (gains[-1], gains.median())
    head = RobertaClassificationHead(17, 17, 2, "tanh", 0.0).eval()
    head.load_state_dict(weights)
    moved = dead["valid"].clone()
    moved[:, -1] += 1e-3
    with torch.no_grad():
        shift = head(moved.unsqueeze(1)) - head(dead["valid"].unsqueeze(1))
    assert shift.abs().max() < 0.01, shift.abs().max()


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


@pytest.mark.parametrize("pooler", ["first", "mean"])
def test_lp_ft_plans_training_from_the_probe(pooler, tmp_path):
    """finetune.sh --lp-ft --dry-run: the probe reads documents as the run will (the truncation of
    the config or the command line), training restores the probed checkpoint with the model reading
    the probe's states; once it is fitted, a launch starts from it without fitting again."""
    checkpoint, save = tmp_path / "model.pt", tmp_path / "save"
    torch.save({"cfg": {"model": {"_name": "linformer_roberta", "max_positions": 512}}}, checkpoint)
    cmd = [str(c) for c in [SCRIPTS / "finetune.sh", "--dry-run", "--cpu", "--lp-ft", pooler, "--save-dir", save]]
    plan = lambda *extra: subprocess.run([*cmd, *extra], env=ENV, capture_output=True, text=True)  # noqa: E731
    out = plan("imdb", checkpoint, "truncation=tail").stdout
    probe = next(line for line in out.splitlines() if line.startswith("lp-ft: first a linear probe"))
    assert f"--out {save}/probed.pt.partial --pooler-tokens {pooler} --truncation tail" in probe, out
    assert f"checkpoint.restore_file=\\'{save}/probed.pt\\'" in out and f"pooler_tokens=\\'{pooler}\\'" in out, out
    assert "--truncation head_tail --truncation-head-tokens 128" in plan("imdb", checkpoint).stdout
    assert "--chunk-length" not in out
    # chunks of 256 of documents of up to 2,048 tokens: the probe reads them so too
    chunked = plan("imdb", checkpoint, "model.chunk_length=256", "task.max_positions=2048").stdout
    assert "--chunk-length 256 --max-positions 2048" in chunked and "++model.chunk_length=256" in chunked, chunked
    save.mkdir()
    (save / "probed.pt").touch()
    out = plan("imdb", checkpoint).stdout
    assert f"lp-ft: starting from {save}/probed.pt" in out and "first a linear probe" not in out, out

    torch.save({"cfg": {"model": {"_name": "roberta", "max_positions": 512}}}, checkpoint)
    failed = plan("imdb", checkpoint)
    assert (failed.returncode == 0) == (pooler == "first"), failed.stderr
    if pooler == "mean":
        assert "its model (roberta) reads <s> only" in failed.stderr, failed.stderr
    failed = plan("imdb", checkpoint, "--lp-ft", "median")
    assert failed.returncode != 0 and "--lp-ft takes first or mean, got 'median'" in failed.stderr


def test_long_documents_config_takes_its_schedule_from_the_data(tmp_path, wikitext_bin):
    """configs/finetuning/long_documents.yaml leaves max_update 0: the launcher ends the schedule
    after its 2 epochs of the data-bin's 320 training inputs in updates of 8, warmup 6%; it freezes
    the projections and reads the mean whatever the checkpoint was trained with; a model whose head
    reads <s> only is refused unless the command line says first."""
    sst2, checkpoint = build_sst2_bin(tmp_path / "bin", wikitext_bin), tmp_path / "model.pt"
    model = {"_name": "linformer_roberta", "max_positions": 2048, "freeze_compress": 0, "pooler_tokens": "first"}
    torch.save({"cfg": {"model": model}}, checkpoint)
    cmd = [str(c) for c in (SCRIPTS / "finetune.sh", "--dry-run", "--cpu", "--data", sst2, "long_documents")]
    cmd.append(str(checkpoint))
    plan = lambda *extra: subprocess.run([*cmd, *extra], env=ENV, capture_output=True, text=True)  # noqa: E731
    out = plan().stdout
    assert "max_update: 2 epochs x 40 updates (320 training inputs / 8) = 80, warmup 5" in out, out
    assert "optimization.max_update=80 lr_scheduler.warmup_updates=5" in out and "global batch 8" in out, out
    assert "freeze_compress" not in out and "pooler_tokens" not in out  # the config's choices, not the checkpoint's
    lp_ft = subprocess.run([*cmd[:3], "--lp-ft", "mean", *cmd[3:]], env=ENV, capture_output=True, text=True).stdout
    assert "--truncation head_tail --truncation-head-tokens 128" in lp_ft and "pooler_tokens=\\'mean\\'" in lp_ft, lp_ft
    missing = subprocess.run([*cmd[:3], "--data", str(tmp_path / "none"), *cmd[5:]], env=ENV,
                             capture_output=True, text=True)  # fmt: skip
    assert "max_update: 2 epochs of" in missing.stdout and "counted when it exists" in missing.stdout, missing.stdout
    torch.save({"cfg": {"model": {"_name": "roberta", "max_positions": 2048}}}, checkpoint)
    refused = plan()
    assert refused.returncode != 0 and "its model (roberta) reads <s> only" in refused.stderr, refused.stderr
    assert "(pooler_tokens: mean; model.pooler_tokens=first overrides it)" in refused.stderr, refused.stderr
    assert plan("model.pooler_tokens=first").returncode == 0


def test_a_finetuning_choice_is_set_whether_or_not_the_config_sets_it(tmp_path):
    """model.freeze_compress=X reaches the run with imdb.yaml, which leaves the choice unset (where
    hydra refuses a plain override), and with long_documents.yaml, which sets it; a key that is not
    a choice goes to hydra as written, a misspelt one failing there."""
    checkpoint = tmp_path / "model.pt"
    torch.save({"cfg": {"model": {"_name": "linformer_roberta", "max_positions": 2048}}}, checkpoint)
    cmd = [str(c) for c in [SCRIPTS / "finetune.sh", "--dry-run", "--cpu", "--save-dir", tmp_path / "save"]]
    plan = lambda *extra: subprocess.run([*cmd, *extra], env=ENV, capture_output=True, text=True)  # noqa: E731
    for config, value in [("imdb", 1), ("long_documents", 0)]:
        out = plan(config, checkpoint, f"model.freeze_compress={value}", "model.pooler_dropout=0.2")
        assert out.returncode == 0, out.stderr
        assert f"++model.freeze_compress={value}" in out.stdout and "++model.pooler_dropout=0.2" in out.stdout
    misspelt = plan("imdb", checkpoint, "model.freez_compress=1")
    assert misspelt.returncode != 0 and "freez_compress" in misspelt.stderr, misspelt.stderr


@pytest.mark.slow
def test_lp_ft_long_documents_round_trip_keeps_the_frozen_projections(data, tmp_path):  # noqa: F811
    """finetune.sh --lp-ft mean long_documents fits the probe (of the mean of the final states) and
    writes it as a head that predicts as the probe; training starts from that head (not a fresh one)
    and keeps the mean; the config freezes the projections, which leave finetuning bit for bit while
    the attention and the head move; a relaunch resumes without fitting the probe again."""
    tiny = ["model.encoder_layers=2", "model.encoder_embed_dim=32", "model.encoder_ffn_embed_dim=64"]
    tiny += ["model.encoder_attention_heads=2", "common.log_interval=1", "dataset.num_workers=0"]
    cpu = ["--cpu", "--batch-size", "8", "--global-batch", "8"]
    run([SCRIPTS / "pretrain.sh", *cpu, "--save-dir", tmp_path / "pretrain", "quickstart", data / "bin/shard0", *tiny]
        + ["task.tokens_per_sample=64", "model.compressed_dim=16", "optimization.max_update=4"])  # fmt: skip
    save = tmp_path / "imdb"
    finetune = [SCRIPTS / "finetune.sh", *cpu, "--lp-ft", "mean", "--data", data / "IMDB-bin", "--save-dir", save]
    finetune += ["long_documents", tmp_path / "pretrain/checkpoint_last.pt", "lr_scheduler.warmup_updates=1"]
    finetune += ["task.truncation_head_tokens=16", "++task.log_parameter_groups=true"]
    finetune += ["common.log_interval=1"]
    out = run([*finetune, "optimization.max_update=2"], cwd=tmp_path).stdout
    report = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert report["agreement"] == 100.0 and report["head_valid_accuracy"] == report["valid_accuracy"], out
    assert report["truncation"] == "head_tail" and report["pooler_tokens"] == "mean", report
    probed = save / "probed.pt"
    assert not probed.with_name("probed.pt.partial").exists()
    log = (save / "hydra_train.log").read_text()
    assert "deleting classification head" not in log
    assert f"Loaded checkpoint {probed}" in log
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

    fitted = probed.stat().st_mtime_ns
    out = run([*finetune, "optimization.max_update=3"], cwd=tmp_path).stdout
    assert "lp-ft:" not in out and f"resume: from {save}/checkpoint_last.pt" in out, out
    assert probed.stat().st_mtime_ns == fitted
    assert [int(s["num_updates"]) for s in records(save / "hydra_train.log", "train_inner")] == [1, 2, 3]
