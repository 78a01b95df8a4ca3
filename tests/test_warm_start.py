"""Warm starts and the hub interface: scripts/convert_roberta_to_linformer.py (RoBERTa ->
Linformer), scripts/extend_max_positions.py (n -> n'), and LinformerRobertaModel.from_pretrained.

Everything runs on tiny models trained here by fairseq-train on a tiny repetitive corpus:
sentences "the ANIMAL eats FOOD ." where each animal always eats the same food, so filling
the food needs the context (every food is equally frequent), tokenised with a word-level
sentencepiece model (the hub's bpe='sentencepiece' path)."""

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENV, SCRIPTS, error_line
from conftest import call_main as call

import convert_roberta_to_linformer as convert
import extend_max_positions as extend
from linformer_fairseq import LinformerRobertaModel
from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS
from linformer_tools import checkpoints
from linformer_tools.fairseq_train import shared_flags

# fairseq's block dataset ('complete' mode) hands numpy 2 a tensor through np.array(copy=False)
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")

FOODS = {"cat": "fish", "dog": "bone", "cow": "grass", "bird": "seeds", "bee": "honey", "fox": "eggs"}
LEGS = {"cat": 4, "dog": 4, "cow": 4, "fox": 4, "bird": 2, "bee": 6}  # label: four legs or not
N = 32  # max_positions of every tiny model here
TINY = ["--encoder-layers", "2", "--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
        "--encoder-attention-heads", "2", "--max-positions", str(N), "--dropout", "0.0",
        "--attention-dropout", "0.0"]  # fmt: skip


def run(cmd, timeout=900):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def fairseq_train(data, save_dir, *flags):
    """A tiny model trained on CPU with the scripts' recipe (shared_flags), seed 1, no validation.
    No weight decay (fairseq's default), as the fixtures were tuned: with 0.01 the converted
    RoBERTa starts at its RoBERTa's loss, and the continuation test has nothing left to lower."""
    command = [sys.executable, "-m", "fairseq_cli.train", data, *TINY, *shared_flags(cpu=True, weight_decay=0)]
    command += ["--seed", "1", "--log-interval", "10", "--no-epoch-checkpoints", "--disable-validation"]
    run([*command, "--save-dir", save_dir, *flags])
    return Path(save_dir) / "checkpoint_last.pt"


def sentence(animal):
    return f"the {animal} eats {FOODS[animal]} ."


def load(checkpoint, data):
    """A checkpoint as fairseq loads it (hub, fairseq-generate, finetuning): its own config."""
    from fairseq import checkpoint_utils

    overrides = {"data": str(data), "load_checkpoint_heads": True}
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)], arg_overrides=overrides)
    return models[0].eval(), task


def hub(checkpoint, data, corpus):
    checkpoint = Path(checkpoint)
    model = LinformerRobertaModel.from_pretrained(
        str(checkpoint.parent),
        checkpoint.name,
        str(data),
        bpe="sentencepiece",
        sentencepiece_model=str(corpus / "spm.model"),
    )
    return model.eval()


def valid_tokens(corpus, task, length):
    """The first ``length`` tokens of the valid text as one block (<s> + length - 1 tokens)."""
    text = " ".join((corpus / "valid.spm").read_text().split("\n"))
    ids = task.source_dictionary.encode_line(text, append_eos=False, add_if_not_exist=False).long()
    return torch.cat([torch.tensor([0]), ids[: length - 1]]).unsqueeze(0)


def padded_sentences(task):
    """Three right-padded sentences of different lengths (<s> ... </s>)."""
    from fairseq.data import data_utils

    d = task.source_dictionary
    texts = ["▁the ▁cat ▁eats ▁fish ▁.", "▁the ▁bee ▁eats ▁honey ▁. ▁the ▁fox", "▁the ▁dog"]
    rows = [torch.cat([torch.tensor([0]), d.encode_line(t, add_if_not_exist=False).long()]) for t in texts]
    batch = data_utils.collate_tokens(rows, pad_idx=d.pad())
    assert batch.eq(d.pad()).any()
    return batch


def features(model, tokens):
    with torch.no_grad():
        return model(tokens, features_only=True)[0]


# ---------------------------------------------------------------- fixtures: corpus and tiny models


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """ROOT/spm.model, ROOT/bin (masked-LM data-bin), ROOT/cls-bin (sentence_prediction: does
    the animal have four legs) and the spm-encoded text."""
    import sentencepiece

    root = tmp_path_factory.mktemp("facts")
    rng = random.Random(0)
    lines = {
        split: [sentence(rng.choice(list(FOODS))) for _ in range(count)]
        for split, count in (("train", 1200), ("valid", 60))
    }
    (root / "all.txt").write_text("\n".join(lines["train"]) + "\n")
    words = {w for line in lines["train"] for w in line.split()}
    sentencepiece.SentencePieceTrainer.train(
        input=str(root / "all.txt"), model_prefix=str(root / "spm"), model_type="word",
        vocab_size=len(words) + 3, hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    sp = sentencepiece.SentencePieceProcessor(model_file=str(root / "spm.model"))
    encode = lambda texts: "".join(" ".join(sp.encode(t, out_type=str)) + "\n" for t in texts)  # noqa: E731
    for split, texts in lines.items():
        (root / f"{split}.spm").write_text(encode(texts))
    preprocess = [sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", "--workers", "1"]
    run([*preprocess, "--trainpref", root / "train.spm", "--validpref", root / "valid.spm", "--destdir", root / "bin"])
    rows = [(sentence(animal), str(int(LEGS[animal] == 4))) for animal in FOODS for _ in range(20)]
    rng.shuffle(rows)
    (root / "cls.input0").write_text(encode(t for t, _ in rows))
    (root / "cls.label").write_text("".join(label + "\n" for _, label in rows))
    run(
        [
            *preprocess,
            "--trainpref",
            root / "cls.input0",
            "--srcdict",
            root / "bin" / "dict.txt",
            "--destdir",
            root / "cls-bin" / "input0",
        ]
    )
    run([*preprocess, "--trainpref", root / "cls.label", "--destdir", root / "cls-bin" / "label"])
    return root


# blocks of whole sentences, as the hub's inputs are; lr and updates: enough to learn the facts
MLM = ["--task", "masked_lm", "--criterion", "masked_lm", "--tokens-per-sample", str(N),
       "--sample-break-mode", "complete", "--batch-size", "16", "--lr", "5e-3", "--warmup-updates", "20"]  # fmt: skip
LINFORMER = ["--arch", "linformer_roberta_base", "--compressed-dim", "8", "--compress-type", "mean"]


@pytest.fixture(scope="module")
def roberta(corpus, tmp_path_factory):
    """fairseq's own RoBERTa that knows the facts: it leaves the masked-LM plateau near update 500
    (where exactly moves with package versions; at 400 it had not, and a conversion cost nothing
    for the continuation to win back), so it trains to 800."""
    save = tmp_path_factory.mktemp("roberta")
    return fairseq_train(
        corpus / "bin", save, "--arch", "roberta_base", *MLM, "--max-update", "800", "--total-num-update", "800"
    )


@pytest.fixture(scope="module")
def linformer(corpus, tmp_path_factory):
    """A Linformer (k = n/4, mean pooling, as the quickstart's) that knows the facts."""
    save = tmp_path_factory.mktemp("linformer")
    return fairseq_train(corpus / "bin", save, *LINFORMER, *MLM, "--max-update", "500", "--total-num-update", "500")


@pytest.fixture(scope="module")
def classifier(linformer, corpus, tmp_path_factory):
    """That Linformer finetuned (sentence_prediction) to tell four-legged animals, head 'legs'."""
    save = tmp_path_factory.mktemp("classifier")
    return fairseq_train(
        corpus / "cls-bin", save, *LINFORMER, "--finetune-from-model", linformer, "--task", "sentence_prediction",
        "--criterion", "sentence_prediction", "--num-classes", "2", "--init-token", "0", "--separator-token", "2",
        "--classification-head-name", "legs", "--batch-size", "16", "--lr", "1e-3", "--warmup-updates", "6",
        "--max-update", "60", "--total-num-update", "60",
    )  # fmt: skip


# ---------------------------------------------------------------- conversion


def test_conversion_copies_every_roberta_weight_and_head(roberta, corpus, tmp_path):
    state = torch.load(roberta, weights_only=True)
    C = state["model"]["encoder.sentence_encoder.embed_tokens.weight"].size(1)
    torch.manual_seed(0)  # a classification head, as a finetuned RoBERTa has
    for name, shape in (
        ("dense.weight", (C, C)),
        ("dense.bias", (C,)),
        ("out_proj.weight", (2, C)),
        ("out_proj.bias", (2,)),
    ):
        state["model"][f"classification_heads.legs.{name}"] = torch.randn(shape)
    torch.save(state, tmp_path / "roberta.pt")

    assert call(convert, tmp_path / "roberta.pt", tmp_path / "linformer.pt", "--compressed-dim", "8") == 0
    out = torch.load(tmp_path / "linformer.pt", weights_only=True)
    copied = [key for key in state["model"] if not key.endswith(".version")]  # fairseq's bookkeeping
    for key in copied:
        assert torch.equal(out["model"][key], state["model"][key]), key
    new = set(out["model"]) - set(state["model"])
    assert new == {f"encoder.sentence_encoder.layers.{i}.self_attn.compress_{kv}.{what}"
                   for i in range(2) for kv in "kv" for what in ("weight", "length_norm_power")}  # fmt: skip
    powers = {v.item() for k, v in out["model"].items() if k.endswith("length_norm_power")}
    assert powers == {LENGTH_NORM_POWERS["exact"]}, powers  # the converter's default for short inputs
    # the avg init: rows average windows of n/k = 4 positions, keys and values alike (--key-scale 1)
    E, F = (out["model"][f"encoder.sentence_encoder.layers.0.self_attn.compress_{kv}.weight"] for kv in "kv")
    window = torch.arange(N) // 4
    torch.testing.assert_close(F, (window == torch.arange(8).unsqueeze(1)).float() / 4)
    torch.testing.assert_close(E, F)
    assert out["warm_start"]["key_scales"] == [1.0, 1.0]
    assert (out["cfg"]["model"].arch, out["cfg"]["model"].compressed_dim) == ("linformer_roberta_base", 8)

    model, _ = load(tmp_path / "linformer.pt", corpus / "bin")  # fairseq loads it, head included
    assert type(model) is LinformerRobertaModel and "legs" in model.classification_heads
    assert torch.equal(
        model.classification_heads.legs.out_proj.weight, state["model"]["classification_heads.legs.out_proj.weight"]
    )


@pytest.mark.parametrize("compress_type", ["linear", "mean"])
def test_identity_projections_compute_the_roberta(roberta, corpus, tmp_path, compress_type):
    """k = n: the avg init (linear) and mean pooling are the identity, so the Linformer is the RoBERTa."""
    assert call(convert, roberta, tmp_path / "k=n.pt", "--compressed-dim", N, "--compress-type", compress_type) == 0
    assert call(convert, roberta, tmp_path / "k=8.pt", "--compressed-dim", "8", "--compress-type", compress_type) == 0
    reference, task = load(roberta, corpus / "bin")
    same, _ = load(tmp_path / "k=n.pt", corpus / "bin")
    smaller, _ = load(tmp_path / "k=8.pt", corpus / "bin")
    inputs = [valid_tokens(corpus, task, N)]
    if compress_type == "mean":  # pooling skips padding; a linear E would add bias-only rows for it
        inputs.append(padded_sentences(task))
    for tokens in inputs:
        expected = features(reference, tokens)
        torch.testing.assert_close(features(same, tokens), expected, atol=1e-5, rtol=0)
        with torch.no_grad():  # the masked-LM head too
            torch.testing.assert_close(same(tokens)[0], reference(tokens)[0], atol=1e-5, rtol=0)
        # the comparison can fail: k < n changes the outputs
        assert (features(smaller, tokens) - expected).abs().max() > 1e-2


@pytest.mark.slow
def test_continued_pretraining_lowers_the_loss_after_conversion(roberta, corpus, tmp_path):
    report = tmp_path / "report.json"
    code = call(convert, roberta, tmp_path / "linformer.pt", "--compressed-dim", "8", "--data", corpus / "bin",
                "--eval-seeds", "5", "--continue-updates", "40", "--lr", "2e-3", "--report-json", report)  # fmt: skip
    assert code == 0
    before, right_after, after = (row["loss_bits"] for row in json.loads(report.read_text())["losses"].values())
    assert after < right_after, (before, right_after, after)
    continued = tmp_path / "linformer-continued" / "checkpoint_last.pt"
    assert checkpoints.model_namespace(torch.load(continued, weights_only=True)).compressed_dim == 8


def test_continuation_flags_rebuild_the_model_from_argparse_and_hydra_configs(linformer):
    """fairseq-train --restore-file builds the model from its flags; they are checked by
    parsing them back (a mismatch exits), here for fairseq-train's config (a Namespace with the
    arch) and for fairseq-hydra-train's (model._name, the rest from the config dataclass)."""
    import dataclasses

    from linformer_fairseq.models.linformer_roberta import LinformerRobertaConfig

    ns = checkpoints.model_namespace(torch.load(linformer, weights_only=True))
    flags = checkpoints.fairseq_train_model_flags(ns)
    assert flags[:2] == ["--arch", "linformer_roberta_base"]
    for flag, value in (("--compressed-dim", "8"), ("--compress-type", "mean"), ("--encoder-embed-dim", "64")):
        assert flags[flags.index(flag) + 1] == value
    fields = {f.name for f in dataclasses.fields(LinformerRobertaConfig)}
    hydra = {key: value for key, value in vars(ns).items() if key in fields}  # no arch, no derived fields
    hydra["_name"] = "linformer_roberta"
    flags = checkpoints.fairseq_train_model_flags(argparse.Namespace(**hydra))
    assert flags[:2] == ["--arch", "linformer_roberta"] and "--encoder-normalize-before" not in flags


# ---------------------------------------------------------------- extension


@pytest.fixture(scope="module")
def sources(roberta, linformer, tmp_path_factory):
    """Checkpoints at n = 32 of every kind the extension handles."""
    root = tmp_path_factory.mktemp("sources")
    made = {"roberta": roberta, "linformer-mean-pooling": linformer}
    for norm in ("none", "linear", "resample"):  # linear E: p = 0, p = 1, E stretched over each input
        path = made[f"linformer-linear-{norm}"] = root / f"linear-{norm}.pt"
        assert call(convert, roberta, path, "--compressed-dim", "8", "--compress-length-norm", norm) == 0
        powers = {v.item() for k, v in torch.load(path, weights_only=True)["model"].items() if "length_norm" in k}
        assert powers == {LENGTH_NORM_POWERS[norm]}, (norm, powers)  # what was asked, not the load's "none"
    made["linformer-layerwise-conv"] = root / "layerwise-conv.pt"  # one kernel under every layer's name
    args = ("--compressed-dim", "8", "--compress-sharing", "layerwise", "--compress-type", "conv")
    assert call(convert, roberta, made["linformer-layerwise-conv"], *args) == 0
    return made


@pytest.mark.parametrize(
    "source",
    [
        "roberta",
        "linformer-mean-pooling",
        "linformer-linear-none",
        "linformer-linear-linear",
        "linformer-linear-resample",
        "linformer-layerwise-conv",
    ],
)
def test_extended_model_runs_at_the_new_length_and_computes_the_same_below_n(sources, source, corpus, tmp_path):
    """Periodic extension is exact on inputs of at most n tokens: position p < n keeps its row,
    pooling windows keep their n/k positions, and a linear E's first n columns, scaled by
    (n/n')^p, cancel the new length factor (n'/T)^p; a resampled E is stretched, so its integral
    over each token's share of n' is the old one over n. Only float rounding differs: 1e-5."""
    new_n = 2 * N
    assert call(extend, sources[source], tmp_path / "long.pt", "--max-positions", new_n) == 0
    original, task = load(sources[source], corpus / "bin")
    extended, _ = load(tmp_path / "long.pt", corpus / "bin")
    assert extended.max_positions() == new_n
    state = torch.load(tmp_path / "long.pt", weights_only=True)
    assert state["cfg"]["model"].max_positions == new_n and state["cfg"]["task"]["tokens_per_sample"] == new_n

    long = valid_tokens(corpus, task, new_n)
    assert long.size(1) == new_n
    out = features(extended, long)
    assert out.shape == (1, new_n, 64) and torch.isfinite(out).all()
    with pytest.raises((ValueError, IndexError)):  # the original cannot read it
        features(original, long)
    for tokens in (valid_tokens(corpus, task, N), padded_sentences(task)):
        torch.testing.assert_close(features(extended, tokens), features(original, tokens), atol=1e-5, rtol=0)


def test_shortened_roberta_keeps_its_first_positions(sources, corpus, tmp_path):
    """A RoBERTa taken to n' < n (linearize.py's teacher for short inputs) computes what it did
    on every input of at most n' tokens."""
    short = N // 2
    assert call(extend, sources["roberta"], tmp_path / "short.pt", "--max-positions", short) == 0
    original, task = load(sources["roberta"], corpus / "bin")
    shortened, _ = load(tmp_path / "short.pt", corpus / "bin")
    assert shortened.max_positions() == short
    for tokens in (valid_tokens(corpus, task, short), padded_sentences(task)):
        torch.testing.assert_close(features(shortened, tokens), features(original, tokens), atol=1e-5, rtol=0)


def test_extended_positions_are_the_trained_ones_repeated(sources, tmp_path):
    assert call(extend, sources["linformer-mean-pooling"], tmp_path / "long.pt", "--max-positions", 80) == 0
    key = "encoder.sentence_encoder.embed_positions.weight"
    old = torch.load(sources["linformer-mean-pooling"], weights_only=True)["model"][key]
    new = torch.load(tmp_path / "long.pt", weights_only=True)["model"][key]
    assert old.shape == (N + 2, 64) and new.shape == (80 + 2, 64)  # fairseq's offset: padding_idx + 1 rows
    assert torch.equal(new[: N + 2], old)
    assert torch.equal(new[N + 2 : 2 * N + 2], old[2:]) and torch.equal(new[2 * N + 2 :], old[2 : 2 + 80 - 2 * N])


def test_stretched_projections_keep_their_structure():
    """Stretching an averaging E gives the averaging E of the new length (windows n'/n times
    wider, rows still summing to 1); periodic tiling repeats E, scaled by (n/n')^p."""
    from types import SimpleNamespace

    E = convert.initial_projection("avg", (8, N))
    for p in (0.0, 0.5, 1.0):
        old = SimpleNamespace(weight=E, kind="linear", max_positions=N, length_power=p, stride=N // 8)
        new = SimpleNamespace(max_positions=3 * N, stride=3 * N // 8)
        torch.testing.assert_close(
            extend.extend_projection(old, new, "stretch"), convert.initial_projection("avg", (8, 3 * N))
        )
        tiled = extend.extend_projection(old, new, "periodic")
        assert tiled.shape == (8, 3 * N)
        for period in range(3):
            torch.testing.assert_close(tiled[:, period * N : (period + 1) * N], E * 3**-p)
    kernel = torch.tensor([[0.1, 0.2, 0.3, 0.4]])  # conv, width n/k = 4 -> 8: each tap covers two positions
    old = SimpleNamespace(weight=kernel, kind="conv", max_positions=N, stride=4)
    stretched = extend.extend_projection(old, SimpleNamespace(max_positions=2 * N, stride=8), "stretch")
    torch.testing.assert_close(stretched, torch.tensor([[0.05, 0.05, 0.1, 0.1, 0.15, 0.15, 0.2, 0.2]]))


@pytest.mark.parametrize("source", ["linformer-mean-pooling", "linformer-linear-linear", "linformer-layerwise-conv"])
def test_stretched_model_runs_at_the_new_length(sources, source, corpus, tmp_path):
    assert (
        call(extend, sources[source], tmp_path / "long.pt", "--max-positions", 2 * N, "--projections", "stretch") == 0
    )
    original, task = load(sources[source], corpus / "bin")
    extended, _ = load(tmp_path / "long.pt", corpus / "bin")
    assert {m.k for m in extended.modules() if type(m).__name__ == "SequenceProjection"} == {8}  # k kept
    assert torch.isfinite(features(extended, valid_tokens(corpus, task, 2 * N))).all()
    # unlike periodic, stretching changes short inputs (wider windows): the 1e-5 above can fail
    short = padded_sentences(task)
    assert (features(extended, short) - features(original, short)).abs().max() > 1e-3


def test_length_handling_is_switched_alone_or_before_the_extension(sources, corpus, tmp_path, capsys):
    """--compress-length-norm alone writes the same weights with every length_norm_power and the
    config switched: under exact, a sentence of at most k = 8 tokens reads differently, a longer
    one as under resample. With --max-positions the switch comes first, so the extended model
    computes the switched one on inputs of at most n tokens."""
    resample, exact_path, long_path = sources["linformer-linear-resample"], tmp_path / "exact.pt", tmp_path / "long.pt"
    assert call(extend, resample, exact_path, "--compress-length-norm", "exact") == 0
    assert "(was resample), the same weights" in capsys.readouterr().out
    before, after = (torch.load(path, weights_only=True) for path in (resample, exact_path))
    assert (after["cfg"]["model"].compress_length_norm, after["cfg"]["model"].max_positions) == ("exact", N)
    assert before["model"].keys() == after["model"].keys()
    for key, value in before["model"].items():
        want = torch.tensor(LENGTH_NORM_POWERS["exact"]) if key.endswith("length_norm_power") else value
        torch.testing.assert_close(after["model"][key], want, rtol=0, atol=0, msg=key)

    original, task = load(resample, corpus / "bin")
    exact, _ = load(exact_path, corpus / "bin")
    sentences = padded_sentences(task)
    short = sentences.ne(task.source_dictionary.pad()).sum(1) <= 8
    assert short.any() and not short.all(), short
    old, new = features(original, sentences), features(exact, sentences)
    torch.testing.assert_close(new[~short], old[~short], atol=1e-6, rtol=0)
    assert (new[short] - old[short]).abs().max() > 1e-3

    assert call(extend, resample, long_path, "--max-positions", 2 * N, "--compress-length-norm", "exact") == 0
    extended, _ = load(long_path, corpus / "bin")
    assert torch.load(long_path, weights_only=True)["cfg"]["model"].compress_length_norm == "exact"
    for tokens in (valid_tokens(corpus, task, N), sentences):
        torch.testing.assert_close(features(extended, tokens), features(exact, tokens), atol=1e-5, rtol=0)

    for source, message in (("roberta", "applies to Linformer checkpoints, not a roberta"),
                            ("linformer-mean-pooling", "the checkpoint has no linear projections")):  # fmt: skip
        assert call(extend, sources[source], tmp_path / "out.pt", "--compress-length-norm", "exact") == 2
        assert message in error_line(capsys)
    assert call(extend, resample, tmp_path / "out.pt") == 2
    assert "nothing to do: give --max-positions, --compress-length-norm, --local-window, --local-count-once" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out.pt").exists()


def test_a_local_band_is_added_kept_through_extension_and_removed(sources, corpus, tmp_path, capsys):
    """--local-window on extend_max_positions.py: the same weights with a band (far-field offsets
    at 0), which changes what a full block computes; --local-window 0 takes it away and gives the
    original back exactly; extending the banded model to n' keeps the band and computes the same
    on inputs of at most n tokens. --local-count-once recounts the rows (same weights, other
    outputs), --no-local-count-once gives the band's outputs back. The converter builds the band from a RoBERTa."""
    resample = sources["linformer-linear-resample"]
    banded, back, long_path = tmp_path / "band.pt", tmp_path / "back.pt", tmp_path / "long.pt"
    assert call(extend, resample, banded, "--local-window", 8) == 0
    assert "local window 8" in capsys.readouterr().out
    before, after = (torch.load(path, weights_only=True) for path in (resample, banded))
    assert after["cfg"]["model"].local_window == 8
    offsets = {key for key in after["model"] if key.endswith("local_far_bias")}
    assert len(offsets) == 2 and not any(after["model"][key].any() for key in offsets)
    assert after["model"].keys() - offsets == before["model"].keys()
    for key in offsets:  # as a trained band has them
        after["model"][key].uniform_(-1, 1)
    torch.save(after, banded)

    original, task = load(resample, corpus / "bin")
    band, _ = load(banded, corpus / "bin")
    block, sentences = valid_tokens(corpus, task, N), padded_sentences(task)
    assert (features(band, block) - features(original, block)).abs().max() > 1e-3
    once, twice = tmp_path / "once.pt", tmp_path / "twice.pt"
    assert call(extend, banded, once, "--local-count-once") == 0
    assert "local count once on" in capsys.readouterr().out
    recounted = torch.load(once, weights_only=True)["model"]
    assert recounted.keys() == after["model"].keys()
    assert all(torch.equal(recounted[key], after["model"][key]) for key in recounted), "the weights must stay"
    counted_once, _ = load(once, corpus / "bin")
    assert counted_once.encoder.sentence_encoder.layers[0].self_attn.local_count_once
    assert (features(counted_once, block) - features(band, block)).abs().max() > 1e-3
    assert call(extend, once, twice, "--no-local-count-once") == 0
    assert "local count once off" in capsys.readouterr().out
    assert call(extend, once, tmp_path / "once-long.pt", "--max-positions", 2 * N) == 0  # neither: the checkpoint's
    assert torch.load(tmp_path / "once-long.pt", weights_only=True)["cfg"]["model"].local_count_once
    torch.testing.assert_close(features(load(twice, corpus / "bin")[0], block), features(band, block), atol=0, rtol=0)
    assert call(extend, banded, back, "--local-window", 0) == 0
    unbanded, _ = load(back, corpus / "bin")
    for tokens in (block, sentences):
        torch.testing.assert_close(features(unbanded, tokens), features(original, tokens), atol=0, rtol=0)

    assert call(extend, banded, long_path, "--max-positions", 2 * N) == 0
    assert torch.load(long_path, weights_only=True)["cfg"]["model"].local_window == 8
    extended, _ = load(long_path, corpus / "bin")
    for tokens in (block, sentences):
        torch.testing.assert_close(features(extended, tokens), features(band, tokens), atol=1e-5, rtol=0)

    converted = tmp_path / "converted.pt"
    assert call(convert, sources["roberta"], converted, "--compressed-dim", 8, "--local-window", 8) == 0
    assert torch.load(converted, weights_only=True)["cfg"]["model"].local_window == 8
    flags = ["--compressed-dim", 8, "--local-window", 8, "--local-count-once"]
    assert call(convert, sources["roberta"], tmp_path / "converted-once.pt", *flags) == 0
    assert torch.load(tmp_path / "converted-once.pt", weights_only=True)["cfg"]["model"].local_count_once
    assert call(extend, resample, tmp_path / "out.pt", "--local-count-once") == 2
    assert "the model has none, add --local-window" in error_line(capsys)
    assert call(extend, sources["roberta"], tmp_path / "out.pt", "--local-window", 8) == 2
    assert "--local-window applies to Linformer checkpoints, not a roberta" in error_line(capsys)
    assert call(extend, resample, tmp_path / "out.pt", "--local-window", 5) == 2
    assert "--local-window must be an even number >= 0, got 5" in capsys.readouterr().err


# ---------------------------------------------------------------- hub interface


def test_fill_mask_returns_the_planted_token(linformer, corpus):
    model = hub(linformer, corpus / "bin", corpus)
    for animal, food in FOODS.items():
        (filled, probability, token), *_ = model.fill_mask(f"the {animal} eats <mask> .", topk=3)
        assert (filled, token.strip()) == (sentence(animal), food)
        assert probability > 0.5
    tokens = model.encode(sentence("cow"))
    assert model.decode(tokens) == sentence("cow")
    assert model.extract_features(tokens).shape == (1, len(tokens), 64)


def test_fill_mask_after_extension(linformer, corpus, tmp_path):
    assert call(extend, linformer, tmp_path / "long.pt", "--max-positions", 3 * N) == 0
    model = hub(tmp_path / "long.pt", corpus / "bin", corpus)
    assert model.model.max_positions() == 3 * N
    assert [model.fill_mask(f"the {a} eats <mask> .", topk=1)[0][2].strip() for a in FOODS] == list(FOODS.values())


def test_predict_gives_one_probability_row_per_input_alone_or_padded(classifier, corpus):
    from fairseq.data import data_utils

    model = hub(classifier, corpus / "cls-bin", corpus)
    texts = [sentence(animal) for animal in FOODS] + [sentence("cat") + " " + sentence("bee")]
    tokens = [model.encode(t) for t in texts]
    batch = data_utils.collate_tokens(tokens, pad_idx=model.task.source_dictionary.pad())
    assert batch.eq(model.task.source_dictionary.pad()).any()
    with torch.no_grad():
        probabilities = model.predict("legs", batch).exp()
        alone = torch.cat([model.predict("legs", t).exp() for t in tokens])
    assert probabilities.shape == (len(texts), 2)
    torch.testing.assert_close(probabilities.sum(1), torch.ones(len(texts)))
    torch.testing.assert_close(probabilities, alone, atol=1e-5, rtol=0)
    labels = model.task.label_dictionary
    predicted = [labels.string([int(i) + labels.nspecial]) for i in probabilities.argmax(1)[: len(FOODS)]]
    assert predicted == [str(int(LEGS[animal] == 4)) for animal in FOODS]


# ---------------------------------------------------------------- errors


def test_missing_or_unreadable_checkpoints_fail_clearly(tmp_path, capsys):
    for script, extra in ((convert, []), (extend, ["--max-positions", "64"])):
        assert call(script, tmp_path / "missing.pt", tmp_path / "out.pt", *extra) == 2
        assert "missing.pt: no such checkpoint file" in error_line(capsys)
        (tmp_path / "notes.pt").write_text("not a checkpoint\n")
        assert call(script, tmp_path / "notes.pt", tmp_path / "out.pt", *extra) == 2
        assert "not a readable fairseq checkpoint" in error_line(capsys)
    assert not (tmp_path / "out.pt").exists()


def test_checkpoints_of_other_models_are_refused(roberta, linformer, tmp_path, capsys):
    state = torch.load(roberta, weights_only=True)
    state["cfg"]["model"]._name = state["cfg"]["model"].arch = "transformer_lm"
    torch.save(state, tmp_path / "lm.pt")
    for script, extra in ((convert, []), (extend, ["--max-positions", "64"])):
        assert call(script, tmp_path / "lm.pt", tmp_path / "out.pt", *extra) == 2
        assert "not a RoBERTa or Linformer checkpoint (model 'transformer_lm')" in error_line(capsys)
    assert call(convert, linformer, tmp_path / "out.pt") == 2
    assert "already a Linformer checkpoint" in error_line(capsys)


def test_bad_lengths_fail_clearly(roberta, linformer, tmp_path, capsys):
    assert call(convert, roberta, tmp_path / "out.pt", "--compressed-dim", N + 1) == 2
    assert f"k={N + 1} must be in 1..max_positions ({N})" in error_line(capsys)
    for new_n in (N, N - 8):
        assert call(extend, linformer, tmp_path / "out.pt", "--max-positions", new_n) == 2
        assert f"--max-positions {new_n} must be larger than the checkpoint's n={N}" in error_line(capsys)
    code = call(
        extend,
        linformer,
        tmp_path / "out.pt",
        "--max-positions",
        2 * N,
        "--projections",
        "stretch",
        "--compressed-dim",
        4 * N,
    )
    assert code == 2 and f"projected length k={4 * N} is larger than n'={2 * N}" in error_line(capsys)
    assert not (tmp_path / "out.pt").exists()


def test_data_the_loss_cannot_be_read_from_fails_before_anything_is_written(roberta, corpus, tmp_path, capsys):
    """--data must be a data-bin with the --split, binarized with the model's dictionary."""
    for data, split, message in (
        (tmp_path, "valid", f"{tmp_path}: no dict.txt"),
        (corpus / "bin", "test", "no 'test' split"),
        (corpus / "cls-bin" / "label", "train", "symbols with <mask>, the model"),  # the labels' dictionary
    ):
        assert call(convert, roberta, tmp_path / "out.pt", "--data", data, "--split", split) == 2
        assert message in error_line(capsys)
    assert not (tmp_path / "out.pt").exists()


def test_scripts_have_help_and_exit_2_from_the_command_line(tmp_path):
    for name in ("convert_roberta_to_linformer", "extend_max_positions"):
        assert "--data" in run([sys.executable, SCRIPTS / f"{name}.py", "--help"]).stdout
    missing = tmp_path / "missing.pt"
    command = [
        sys.executable,
        SCRIPTS / "extend_max_positions.py",
        missing,
        tmp_path / "out.pt",
        "--max-positions",
        "64",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {missing}: no such checkpoint file"
