"""End to end through fairseq's own entry points on the bundled real text: fairseq-train with
--user-dir and --arch linformer_roberta_base (shrunk by flags) learns, resumes from
checkpoint_last.pt, loads through the hub interface; fairseq-hydra-train runs the same model
from a yaml config."""

import re
import sys

import pytest
import torch
import yaml
from conftest import REPO, run

import linformer_fairseq  # noqa: F401
from linformer_tools.logs import records_in

pytestmark = pytest.mark.slow  # end-to-end training runs

SMALL = dict(
    encoder_layers=2,
    encoder_embed_dim=64,
    encoder_ffn_embed_dim=128,
    encoder_attention_heads=4,
    max_positions=64,
    compressed_dim=16,
    compress_sharing="kv",
    compress_length_norm="sqrt",
)


def flag(name):
    return "--" + name.replace("_", "-")


def train_cmd(data, save_dir, max_update):
    model_flags = [str(x) for key, value in SMALL.items() for x in (flag(key), value)]
    return [
        sys.executable,
        "-m",
        "fairseq_cli.train",
        data,
        "--user-dir",
        REPO / "linformer_fairseq",
        "--arch",
        "linformer_roberta_base",
        "--task",
        "masked_lm",
        "--criterion",
        "masked_lm",
        *model_flags,
        "--tokens-per-sample",
        "64",
        "--batch-size",
        "16",
        "--optimizer",
        "adam",
        "--lr",
        "1e-3",
        "--lr-scheduler",
        "polynomial_decay",
        "--warmup-updates",
        "5",
        "--total-num-update",
        "60",
        "--max-update",
        str(max_update),
        "--validate-interval-updates",
        "15",
        "--save-interval-updates",
        "15",
        "--no-epoch-checkpoints",
        "--save-dir",
        save_dir,
        "--log-format",
        "simple",
        "--log-interval",
        "5",
        "--cpu",
        "--num-workers",
        "0",
        "--seed",
        "3",
    ]


def valid_losses(log):
    return [(int(r["num_updates"]), r["loss"]) for r in records_in(log, "valid")]


def test_fairseq_train_learns_resumes_and_loads_through_the_hub(wikitext_bin, tmp_path):
    save = tmp_path / "ckpt"
    first = run(train_cmd(wikitext_bin, save, 30)).stdout
    losses = valid_losses(first)
    assert [u for u, _ in losses][-1] == 30, losses
    assert losses[-1][1] < losses[0][1] - 0.3, f"validation loss did not fall: {losses}"

    # checkpoint_last.pt is picked up (--restore-file's default) under torch's safe loader
    second = run(train_cmd(wikitext_bin, save, 60)).stdout
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 30 updates\)", second), second[-3000:]
    resumed = valid_losses(second)
    assert [u for u, _ in resumed] == [45, 60], resumed
    assert resumed[-1][1] < losses[-1][1], f"loss after resuming did not keep falling: {losses} then {resumed}"
    steps = [int(r["num_updates"]) for r in records_in(second, "train_inner")]
    assert steps == list(range(35, 61, 5)), f"resumed run repeated or skipped updates: {steps}"

    check_hub_against_checkpoint(save / "checkpoint_last.pt", wikitext_bin)


class WordBPE:
    """The data is word-level (no BPE): the hub's fill_mask needs an encoder, the identity."""

    def encode(self, text):
        return text

    def decode(self, text):
        return text


def check_hub_against_checkpoint(checkpoint, data):
    """The hub interface gives the checkpoint's model: its features and masked-token
    predictions equal those of the model fairseq's own loader builds from the same file, and
    differ from a freshly initialised model's."""
    from fairseq import checkpoint_utils

    from linformer_fairseq.models.linformer_roberta import LinformerRobertaModel

    hub = LinformerRobertaModel.from_pretrained(str(checkpoint.parent), checkpoint.name, str(data), bpe=None).eval()
    assert hub.model.encoder.sentence_encoder.linformer.sharing == "kv"
    # the length handling it was trained with (not the default) comes back with the weights
    powers = {m.length_power for m in hub.model.modules() if hasattr(m, "length_power")}
    assert powers == {0.5}, powers
    (model,), cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data)}
    )
    model.eval()
    torch.manual_seed(0)
    fresh = task.build_model(cfg.model).eval()

    dictionary = hub.task.source_dictionary
    sentence = "the game was released in Japan"
    tokens = dictionary.encode_line(sentence, add_if_not_exist=False).long()
    tokens = torch.cat([tokens.new_tensor([dictionary.bos()]), tokens])
    assert dictionary.unk() not in tokens.tolist(), "pick words of the sample's dictionary"
    with torch.no_grad():
        features = hub.extract_features(tokens)
        expected = model(tokens[None], features_only=True)[0]
        untrained = fresh(tokens[None], features_only=True)[0]
    assert features.shape == (1, len(tokens), 64)
    torch.testing.assert_close(features, expected, atol=1e-6, rtol=1e-5)
    assert (features - untrained).abs().mean() > 0.1 * untrained.abs().mean(), "hub features are an untrained model's"

    # masked-token prediction through the hub (fill_mask) = the checkpoint model's LM head
    hub.bpe = WordBPE()
    masked = sentence.replace("Japan", "<mask>")
    predictions = hub.fill_mask(masked, topk=5)
    ids = dictionary.encode_line("<s> " + masked + " </s>", append_eos=False, add_if_not_exist=False).long()
    position = ids.tolist().index(hub.task.mask_idx)
    with torch.no_grad():
        probs = model(ids[None])[0][0, position].softmax(-1)
        fresh_probs = fresh(ids[None])[0][0, position].softmax(-1)
    top = probs.topk(len(predictions))
    assert [word for _, _, word in predictions] == [dictionary[i] for i in top.indices.tolist()], predictions
    torch.testing.assert_close(torch.tensor([p for _, p, _ in predictions]), top.values, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(fresh_probs, probs, atol=1e-3), "hub predictions are an untrained model's"


def test_fairseq_hydra_train_with_yaml(wikitext_bin, tmp_path):
    config = {
        "common": {
            "user_dir": str(REPO / "linformer_fairseq"),
            "cpu": True,
            "seed": 3,
            "log_format": "simple",
            "log_interval": 5,
        },
        "task": {"_name": "masked_lm", "data": str(wikitext_bin), "tokens_per_sample": 64},
        "criterion": "masked_lm",
        "dataset": {"batch_size": 16, "num_workers": 0, "validate_interval_updates": 20},
        "optimizer": {"_name": "adam"},
        "lr_scheduler": {"_name": "polynomial_decay", "warmup_updates": 5, "total_num_update": 40},
        "optimization": {"max_update": 40, "lr": [0.001]},
        "checkpoint": {"save_dir": str(tmp_path / "ckpt"), "no_epoch_checkpoints": True},
        "model": {"_name": "linformer_roberta", **SMALL, "compress_sharing": "layerwise", "compress_type": "mean"},
    }
    (tmp_path / "pretrain.yaml").write_text(yaml.safe_dump(config))
    log = run(
        [
            "fairseq-hydra-train",
            "--config-dir",
            tmp_path,
            "--config-name",
            "pretrain",
            f"hydra.run.dir={tmp_path / 'hydra'}",
        ],
        cwd=tmp_path,
    ).stdout
    losses = valid_losses(log)
    assert [u for u, _ in losses] == [20, 40], log[-3000:]
    assert losses[-1][1] < losses[0][1], losses
    state = torch.load(tmp_path / "ckpt" / "checkpoint_last.pt")
    assert state["cfg"]["model"]["compress_sharing"] == "layerwise"
    assert state["cfg"]["model"]["compress_type"] == "mean"
