"""scripts/export_hf.py: a model leaves fairseq for Hugging Face transformers.

Tiny models are built here as fairseq-train builds them (fairseq's parser and task.build_model,
every weight then perturbed so that none sits at its init) for every sharing level x projection
kind x length norm, per-layer k, frozen projections, the legacy flags, a RoBERTa, and the
original example's checkpoints. Each exported folder is loaded through transformers' Auto
classes with trust_remote_code, as a user without fairseq loads it, and must compute what the
fairseq hub computes on a padded batch of real sentences. The tokenizer must give the hub's
encode on every line of the sample's validation text. One tiny model learns a few real
sentences, for the fill-mask pipeline and transformers' Trainer."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENV, SCRIPTS, call_main, error_line
from test_linformer_model import Float64Ops

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local: never ask the Hub
transformers = pytest.importorskip("transformers")  # the hf extra

from fairseq.data import Dictionary, data_utils  # noqa: E402

import export_hf as export  # noqa: E402
from linformer_fairseq import LinformerRobertaModel  # noqa: E402
from linformer_fairseq.modules.linformer_attention import COMPRESS_SHARING, COMPRESS_TYPES  # noqa: E402
from linformer_tools.common import SAMPLE  # noqa: E402

N = 64  # max_positions of the tiny models
TINY = ["--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "4", "--max-positions", str(N)]  # fmt: skip
HEAD = "sentence_classification_head"
FIXTURES = Path(__file__).parent / "fixtures" / "official-linformer"
# characters the spm model does not know (a run of them is one <unk>: spm fuses them), whitespace
# it normalises, a literal "<unk>" (WikiText has many), which spm cuts into pieces, and nothing
UNKNOWN_CHARACTERS = ["naïve café — 東京 😀 x", "東京東京 ö x ö"]
UNUSUAL = [*UNKNOWN_CHARACTERS, "  two  spaces\tand a tab ", "x\u00a0y\u3000z", "a <unk> b", ""]


def call(*argv):
    return call_main(export, *argv)


# ---------------------------------------------------------------- tiny fairseq models


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    """A 1000-piece sentencepiece model of the sample's WikiText-2 text and the dict.txt that
    data-prep/spm.sh writes with it (the data dir of the tiny models' masked_lm task)."""
    from dataprep import spm

    out = tmp_path_factory.mktemp("spm") / "spm"
    spm.train(SAMPLE / "wikitext-2" / "wiki.train.tokens", out, 1000, 0, "unigram", workers=1)
    return out


@pytest.fixture(scope="module")
def lines():
    """The sample's WikiText-2 validation text, line by line."""
    return (SAMPLE / "wikitext-2" / "wiki.valid.tokens").read_text().split("\n")


def checkpoint(path, data, flags=(), arch="linformer_roberta_base", head=3, seed=0, perturb=0.05):
    """A fairseq checkpoint of ARCH built from FLAGS as fairseq-train builds it (masked_lm task
    on DATA), every weight moved off its init, with a classification head of HEAD outputs."""
    from linformer_tools import models

    torch.manual_seed(seed)
    model, cfg = models.build_model(arch, [*TINY, *flags], data)
    if head:
        model.register_classification_head(HEAD, num_classes=head)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * perturb)
    save(path, cfg, model)
    return path


def save(path, cfg, model):
    from omegaconf import OmegaConf

    cfg = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    history = {"criterion_name": "MaskedLmLoss", "optimizer_name": "FairseqAdam", "lr_scheduler_state": {}}
    state = {"args": None, "cfg": cfg, "model": model.state_dict(), "extra_state": {}, "last_optimizer_state": None,
             "optimizer_history": [{**history, "num_updates": 0}]}  # fmt: skip
    torch.save(state, path)


def hub(path, data, spm_dir):
    """The checkpoint as fairseq's hub loads it, with the sentencepiece bpe (eval mode)."""
    return LinformerRobertaModel.from_pretrained(  # any RoBERTa; its predict reads what --pooler-tokens says
        str(path.parent), path.name, str(data), bpe="sentencepiece", sentencepiece_model=str(spm_dir / "spm.model")
    ).eval()


def padded_batch(fairseq_hub, lines):
    """Three real sentences as the hub encodes them, right-padded: a full block (a long line cut
    at n tokens), a medium and a short one."""
    rows = []
    for low, high in ((N + 1, 10**6), (20, 40), (5, 12)):
        ids = next(t for t in map(fairseq_hub.encode, lines) if low <= len(t) <= high)
        rows.append(ids[:N])
    batch = data_utils.collate_tokens(rows, pad_idx=1)
    assert batch.size(1) == N and batch.eq(1).any()
    return batch, rows


def auto(kind, folder, **kwargs):
    from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

    cls = {"base": AutoModel, "mlm": AutoModelForMaskedLM, "cls": AutoModelForSequenceClassification}[kind]
    return cls.from_pretrained(str(folder), trust_remote_code=True, **kwargs).eval()


def assert_same_as_hub(folder, fairseq_hub, lines, head=True):
    """Last hidden states, masked-LM logits and classification logits of the exported folder
    equal the hub's on a padded batch of real sentences; each sentence's outputs are the same
    alone as in the padded batch."""
    mlm = auto("mlm", folder)
    batch, rows = padded_batch(fairseq_hub, lines)
    mask = batch.ne(1).long()  # what a tokenizer gives
    close = dict(atol=1e-5, rtol=0)
    with torch.no_grad():
        features = fairseq_hub.extract_features(batch)
        hidden = mlm.linformer(batch, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(hidden, features, **close)
        torch.testing.assert_close(mlm(batch, attention_mask=mask).logits, fairseq_hub.model(batch)[0], **close)
        if head:
            expected = fairseq_hub.predict(HEAD, batch, return_logits=True)
            torch.testing.assert_close(auto("cls", folder)(batch, attention_mask=mask).logits, expected, **close)
        for row, ids in enumerate(rows):
            alone = mlm.linformer(ids.unsqueeze(0)).last_hidden_state[0]
            torch.testing.assert_close(hidden[row, : len(ids)], alone, **close)
    return mlm


# ---------------------------------------------------------------- every option exports exactly

GRID = [
    (sharing, kind, norm)
    for sharing in COMPRESS_SHARING
    for kind in COMPRESS_TYPES
    for norm in (("none", "sqrt", "linear", "resample", "exact") if kind == "linear" else ("linear",))
]


@pytest.mark.parametrize("sharing,kind,length_norm", GRID)
def test_every_sharing_kind_and_length_norm_computes_what_the_hub_computes(
    sharing, kind, length_norm, spm_dir, lines, tmp_path
):
    flags = ["--compressed-dim", "16", "--compress-sharing", sharing, "--compress-type", kind]
    ckpt = checkpoint(tmp_path / "model.pt", spm_dir, [*flags, "--compress-length-norm", length_norm])
    assert call(ckpt, "--out", tmp_path / "hf", "--no-tokenizer") == 0
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    assert (config.compress_sharing, config.compress_type, config.compressed_dims) == (sharing, kind, [16, 16])
    assert config.compress_length_norm == length_norm and config.num_labels == 3
    assert_same_as_hub(tmp_path / "hf", hub(ckpt, spm_dir, spm_dir), lines)


OPTIONS = {
    "per-layer k, linear": ["--layer-compressed-dims", "32,8"],
    "per-layer k, conv, per head": ["--layer-compressed-dims", "16,8", "--compress-type", "conv",
                                    "--compress-sharing", "none"],
    "per-layer k, max, kv": ["--layer-compressed-dims", "32,16", "--compress-type", "max", "--compress-sharing", "kv"],
    "frozen xavier, pre-norm, untied head, gelu_accurate": [
        "--compressed-dim", "16", "--freeze-compress", "1", "--compress-init", "xavier", "--compress-length-norm",
        "sqrt", "--encoder-normalize-before", "--untie-weights-roberta", "--activation-fn", "gelu_accurate"],
    "legacy flags (--shared-layer-kv-compressed, --compressed)": ["--shared-layer-kv-compressed", "1",
                                                                  "--compressed", "8"],
    "feed-forward chunks": ["--compressed-dim", "16", "--ffn-chunk-size", "16"],
    "local band, exact": ["--compressed-dim", "16", "--local-window", "8", "--compress-length-norm", "exact"],
    "local band, layerwise conv": ["--compressed-dim", "16", "--local-window", "6", "--compress-type", "conv",
                                   "--compress-sharing", "layerwise"],
    "local band counted once, resample": ["--compressed-dim", "16", "--local-window", "8", "--compress-length-norm",
                                          "resample", "--local-count-once"],
    "head on the mean of the tokens": ["--compressed-dim", "16", "--pooler-tokens", "mean"],
}  # fmt: skip


@pytest.mark.parametrize("name", OPTIONS)
def test_per_layer_k_frozen_projections_and_other_options_export(name, spm_dir, lines, tmp_path):
    ckpt = checkpoint(tmp_path / "model.pt", spm_dir, OPTIONS[name])
    assert call(ckpt, "--out", tmp_path / "hf", "--no-tokenizer") == 0
    mlm = assert_same_as_hub(tmp_path / "hf", hub(ckpt, spm_dir, spm_dir), lines)
    config = mlm.config
    assert config.local_window == (int(OPTIONS[name][3]) if "band" in name else 0)
    assert config.local_count_once == ("--local-count-once" in OPTIONS[name])
    assert config.classifier_pooling == ("mean" if "mean" in name else "first")
    if "per-layer" in name:
        assert config.compressed_dims == [int(k) for k in OPTIONS[name][1].split(",")]
    if "legacy" in name:
        assert (config.compress_sharing, config.compressed_dims) == ("layerwise", [N // 8] * 2)
    if "frozen" in name:
        assert config.freeze_compress and config.normalize_before and config.untie_weights_roberta
        frozen = [p for n, p in mlm.named_parameters() if "compress" in n]
        assert frozen and not any(p.requires_grad for p in frozen)
        assert all(p.requires_grad for n, p in mlm.named_parameters() if "compress" not in n)


@pytest.mark.parametrize("arch", ["linformer_roberta_base", "roberta_imported"])
def test_a_head_on_the_mean_reads_each_sentences_real_tokens(arch, spm_dir, lines, tmp_path):
    """--pooler-tokens mean: each sentence's logits in a padded batch are the head applied to the
    mean of its own final states, computed alone; first (the default) reads <s>."""
    linformer = ["--compressed-dim", "16"] if arch.startswith("linformer") else []
    for pooling, pool in (("mean", lambda x: x.mean(1, keepdim=True)), ("first", lambda x: x[:, :1])):
        ckpt = checkpoint(tmp_path / f"{pooling}.pt", spm_dir, [*linformer, "--pooler-tokens", pooling], arch=arch)
        fairseq_hub = hub(ckpt, spm_dir, spm_dir)
        batch, rows = padded_batch(fairseq_hub, lines)
        head = fairseq_hub.model.classification_heads[HEAD]
        with torch.no_grad():
            logits = fairseq_hub.predict(HEAD, batch, return_logits=True)
            for row, ids in enumerate(rows):
                alone = head(pool(fairseq_hub.extract_features(ids)))[0]
                torch.testing.assert_close(logits[row], alone, atol=1e-5, rtol=0)
        assert fairseq_hub.model.args.pooler_tokens == pooling


def test_roberta_exports_with_full_attention_and_a_regression_head(spm_dir, lines, tmp_path):
    ckpt = checkpoint(tmp_path / "roberta.pt", spm_dir, arch="roberta_base", head=1)
    assert call(ckpt, "--out", tmp_path / "hf", "--no-tokenizer") == 0
    mlm = assert_same_as_hub(tmp_path / "hf", hub(ckpt, spm_dir, spm_dir), lines)
    assert mlm.config.attention == "full"
    regression = auto("cls", tmp_path / "hf")
    assert (regression.config.num_labels, regression.config.problem_type) == (1, "regression")
    tokens = torch.tensor([[0, 10, 20, 30, 2]])
    loss = regression(tokens, labels=torch.tensor([0.5])).loss  # MSE on the one output
    torch.testing.assert_close(loss, (regression(tokens).logits.squeeze() - 0.5) ** 2)


@pytest.mark.parametrize("sharing", ["headwise", "kv", "layerwise"])
def test_checkpoints_of_the_original_example_export(sharing, tmp_path):
    """The original example's checkpoints (tests/fixtures/official-linformer): the exported
    model reproduces the outputs that code computed; its word-level dictionary becomes a
    whitespace tokenizer."""
    out = tmp_path / "hf"
    assert call(FIXTURES / sharing / "model.pt", "--out", out, "--dict", FIXTURES / "dict.txt") == 0
    expected = torch.load(FIXTURES / sharing / "expected_outputs.pt")
    mlm = auto("mlm", out)
    assert (mlm.config.compress_sharing, mlm.config.compress_length_norm) == (sharing, "none")
    with torch.no_grad():
        for length in (64, 40):
            result = mlm(expected[f"tokens_{length}"], output_hidden_states=True)
            torch.testing.assert_close(result.logits, expected[f"logits_{length}"], atol=1e-5, rtol=0)
            torch.testing.assert_close(result.hidden_states[-1], expected[f"features_{length}"], atol=1e-5, rtol=0)
    text = "the of and zzzz <unk> in"
    words = Dictionary.load(str(FIXTURES / "dict.txt")).encode_line(text, append_eos=False, add_if_not_exist=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    assert tokenizer(text)["input_ids"] == [0, *words.tolist(), 2]


# ---------------------------------------------------------------- the tokenizer


def test_tokenizer_gives_the_hubs_ids_on_every_line_of_the_validation_text(spm_dir, lines, tmp_path):
    """Both the spm.sh dictionary (fairseq id = spm id + 1) and the same dictionary in another
    order (as fairseq-preprocess writes one, by frequency): the ids are the dictionary's."""
    ckpt = checkpoint(tmp_path / "model.pt", spm_dir, ["--compressed-dim", "16"], head=0)
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    entries = (spm_dir / "dict.txt").read_text().splitlines()
    random.Random(0).shuffle(entries)
    (shuffled / "dict.txt").write_text("\n".join(entries) + "\n")
    sst2 = [row.rsplit("\t", 1)[0] for row in (SAMPLE / "glue" / "SST-2" / "dev.tsv").read_text().splitlines()[1:]]
    texts = lines + sst2[:200] + UNUSUAL
    assert sum("<unk>" in t for t in texts) > 50  # WikiText's own
    for data in (spm_dir, shuffled):
        out = tmp_path / f"hf-{data.name}"
        assert call(ckpt, "--out", out, "--spm-model", spm_dir / "spm.model", "--dict", data / "dict.txt") == 0
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
        fairseq_hub = hub(ckpt, data, spm_dir)
        got = tokenizer(texts)["input_ids"]
        for text, ids in zip(texts, got):
            expected = fairseq_hub.encode(text).tolist()
            assert ids == expected, f"{data.name}: {text!r}\n{tokenizer.convert_ids_to_tokens(ids)}"
        assert all(3 in ids for ids in tokenizer(UNKNOWN_CHARACTERS)["input_ids"])  # fairseq's <unk>
        pair = tokenizer(sst2[0], sst2[1])["input_ids"]
        assert pair == fairseq_hub.encode(sst2[0], sst2[1]).tolist()  # <s> A </s> </s> B </s>
        assert tokenizer.decode(tokenizer(sst2[1])["input_ids"], skip_special_tokens=True) == sst2[1].strip()
    # no --dict: the spm pieces in spm order, which is what spm.sh's dict.txt holds
    assert call(ckpt, "--out", tmp_path / "hf-spm-only", "--spm-model", spm_dir / "spm.model", "--no-check") == 0
    only = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf-spm-only"), trust_remote_code=True)
    first = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf-spm"), trust_remote_code=True)
    assert only(texts)["input_ids"] == first(texts)["input_ids"]
    batch = first(lines[1:4], padding=True, return_tensors="pt")
    assert batch["input_ids"][:, 0].eq(0).all() and batch["attention_mask"][:, 0].eq(1).all()  # right padding


# ---------------------------------------------------------------- transformers' own tools


@pytest.fixture(scope="module")
def learned(spm_dir, tmp_path_factory):
    """A tiny Linformer (conv projection, k = n/4) that has learned eight real sentences (SST-2
    dev) by heart, exported with its tokenizer: (folder, checkpoint, the sentences)."""
    import torch.nn.functional as F

    root = tmp_path_factory.mktemp("learned")
    flags = ["--encoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128", "--compressed-dim", "16",
             "--compress-type", "conv", "--dropout", "0", "--attention-dropout", "0"]  # fmt: skip
    ckpt = checkpoint(root / "model.pt", spm_dir, flags, head=0, perturb=0.0)
    fairseq_hub = hub(ckpt, spm_dir, spm_dir)
    rows = [row.rsplit("\t", 1)[0].strip() for row in (SAMPLE / "glue" / "SST-2" / "dev.tsv").read_text().splitlines()]
    sentences = [s for s in rows[1:] if 10 <= len(fairseq_hub.encode(s)) <= 24][:8]
    tokens = data_utils.collate_tokens([fairseq_hub.encode(s) for s in sentences], pad_idx=1)
    inner = tokens.ne(1) & tokens.ne(0) & tokens.ne(2)
    model, mask_id = fairseq_hub.model.train(), fairseq_hub.task.mask_idx
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        masked = inner & (torch.rand(tokens.shape, generator=g) < 0.2)
        logits = model(tokens.masked_fill(masked, mask_id), masked_tokens=masked)[0]
        loss = F.cross_entropy(logits, tokens[masked])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    state = torch.load(ckpt, weights_only=True)
    save(ckpt, state["cfg"], model)
    out = root / "hf"
    assert call(ckpt, "--out", out, "--spm-model", spm_dir / "spm.model", "--dict", spm_dir / "dict.txt") == 0
    return out, ckpt, sentences


def test_fill_mask_pipeline_returns_the_planted_token(learned, spm_dir):
    import sentencepiece

    out, ckpt, sentences = learned
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_dir / "spm.model"))
    fill = transformers.pipeline("fill-mask", model=str(out), trust_remote_code=True)
    fairseq_hub = hub(ckpt, spm_dir, spm_dir)
    planted = tried = 0
    for sentence in sentences:
        words = sentence.split()
        one_piece = [i for i in range(1, len(words)) if sp.encode(words[i], out_type=str) == ["▁" + words[i]]]
        if not one_piece:
            continue
        i = max(one_piece, key=lambda i: len(words[i]))  # the longest word that is one piece
        masked = " ".join([*words[:i], "<mask>", *words[i + 1 :]])
        (best, *_) = fill(masked, top_k=3)
        assert best["token_str"].strip() == fairseq_hub.fill_mask(masked, topk=1)[0][2].strip()
        planted += best["token_str"].strip() == words[i]
        tried += 1
    assert tried >= 6 and planted >= tried - 1, f"the model filled {planted} of {tried} planted words"


def test_trainer_finetuning_on_sst2_rows_lowers_the_loss(learned, tmp_path):
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    out, _, _ = learned
    rows = [row.rsplit("\t", 1) for row in (SAMPLE / "glue" / "SST-2" / "train.tsv").read_text().splitlines()[1:65]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    examples = [{**tokenizer(text, truncation=True), "labels": int(label)} for text, label in rows]
    torch.manual_seed(0)
    model = auto("cls", out, num_labels=2, id2label={0: "negative", 1: "positive"})
    collate = DataCollatorWithPadding(tokenizer)

    def loss():
        model.eval()
        with torch.no_grad():
            return model(**collate(examples)).loss.item()

    before = loss()
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=16, max_steps=24, learning_rate=1e-3,
        save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
        logging_steps=8,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=examples, data_collator=collate).train()
    after = loss()
    assert after < before - 0.05, f"loss {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize("sharing,kind,length_norm", [("layerwise", "linear", "resample"), ("none", "max", "linear")])
def test_torch_export_of_the_encoder_matches_eager(sharing, kind, length_norm, spm_dir, lines, tmp_path):
    flags = ["--compressed-dim", "16", "--compress-sharing", sharing, "--compress-type", kind]
    ckpt = checkpoint(tmp_path / "model.pt", spm_dir, [*flags, "--compress-length-norm", length_norm], head=0)
    assert call(ckpt, "--out", tmp_path / "hf", "--no-tokenizer") == 0
    encoder = auto("base", tmp_path / "hf")

    class Encoder(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    batch, _ = padded_batch(hub(ckpt, spm_dir, spm_dir), lines)
    mask = batch.ne(1).long()
    exported = torch.export.export(Encoder(encoder), (batch, mask))
    with torch.no_grad():
        eager = encoder(input_ids=batch, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(exported.module()(batch, mask), eager, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- a saved model, and its labels


def test_save_pretrained_round_trip_keeps_weights_frozen_projections_and_labels(spm_dir, lines, tmp_path):
    ckpt = checkpoint(tmp_path / "model.pt", spm_dir, ["--compress-sharing", "layerwise", "--freeze-compress", "1"])
    labels = tmp_path / "label" / "dict.txt"
    labels.parent.mkdir()
    labels.write_text("positive 30\nnegative 20\nneutral 10\n")  # fairseq class i = the i-th entry
    assert call(ckpt, "--out", tmp_path / "hf", "--label-dict", labels, "--no-tokenizer") == 0
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    attention_files = sorted(p.name for p in (SCRIPTS.parent / "linformer_fairseq" / "modules").glob("linformer_*.py"))
    attention_files.remove("linformer_encoder.py")  # fairseq's encoder, which the export replaces
    assert files == sorted(["config.json", "configuration_linformer.py", "model.safetensors", "modeling_linformer.py",
                            *attention_files])  # fmt: skip
    for name in attention_files:  # the plugin's attention, every file of it, byte for byte
        plugin = SCRIPTS.parent / "linformer_fairseq" / "modules" / name
        assert (tmp_path / "hf" / name).read_bytes() == plugin.read_bytes(), name

    model = auto("cls", tmp_path / "hf")
    assert model.config.id2label == {0: "positive", 1: "negative", 2: "neutral"}
    assert model.config.label2id == {"positive": 0, "negative": 1, "neutral": 2}
    model.save_pretrained(str(tmp_path / "saved"))
    again = auto("cls", tmp_path / "saved")
    batch, _ = padded_batch(hub(ckpt, spm_dir, spm_dir), lines)
    with torch.no_grad():
        torch.testing.assert_close(again(batch).logits, model(batch).logits, atol=0, rtol=0)
        base = auto("base", tmp_path / "hf")
        torch.testing.assert_close(base(batch).last_hidden_state, model.linformer(batch).last_hidden_state)
    for m in (model, again, base):
        projections = [p for n, p in m.named_parameters() if "compress" in n]
        assert len(projections) == 1 and not projections[0].requires_grad  # one E for every layer, frozen
    with torch.no_grad(), Float64Ops() as seen:  # the export runs where float64 does not (MPS)
        model(batch)
    assert seen.ops == [], seen.ops
    with pytest.raises(ValueError, match="right-padded"):
        model(torch.tensor([[1, 1, 0, 5, 2]]))  # left padding


# ---------------------------------------------------------------- bad input


def test_bad_input_exits_2_with_one_line_naming_the_file(spm_dir, tmp_path, capsys):
    missing = tmp_path / "missing.pt"
    assert call(missing, "--out", tmp_path / "hf") == 2
    assert f"{missing}: no such checkpoint file" in error_line(capsys)

    ckpt = checkpoint(tmp_path / "model.pt", spm_dir, ["--compressed-dim", "16"])
    state = torch.load(ckpt, weights_only=True)
    state["cfg"]["model"]["_name"] = "transformer_lm"
    torch.save(state, tmp_path / "lm.pt")
    assert call(tmp_path / "lm.pt", "--out", tmp_path / "hf") == 2
    assert "lm.pt: not a RoBERTa or Linformer checkpoint (model 'transformer_lm')" in error_line(capsys)

    other = FIXTURES / "dict.txt"  # 304 symbols, the model 1002 rows
    assert call(ckpt, "--out", tmp_path / "hf", "--dict", other) == 2
    assert f"{other}: 304 symbols (305 with <mask>), but the checkpoint's token embedding has 1002" in error_line(
        capsys
    )
    no_spm = tmp_path / "nowhere" / "spm.model"
    assert call(ckpt, "--out", tmp_path / "hf", "--spm-model", no_spm) == 2
    assert f"{no_spm}: no such sentencepiece model" in error_line(capsys)
    (tmp_path / "notes.model").write_text("not a model\n")
    assert call(ckpt, "--out", tmp_path / "hf", "--spm-model", tmp_path / "notes.model") == 2
    assert "notes.model: not a sentencepiece model" in error_line(capsys)

    # a dictionary without some of the spm pieces (same size: two pieces renamed)
    entries = (spm_dir / "dict.txt").read_text().splitlines()
    entries[10:12] = ["madeupword0000 1", "madeupword0001 1"]
    (tmp_path / "partial.txt").write_text("\n".join(entries) + "\n")
    code = call(
        ckpt, "--out", tmp_path / "hf", "--spm-model", spm_dir / "spm.model", "--dict", tmp_path / "partial.txt"
    )
    assert code == 2 and f"{tmp_path / 'partial.txt'}: 2 of the sentencepiece model's pieces" in error_line(capsys)

    labels = tmp_path / "labels.txt"
    labels.write_text("0 5\n1 4\n")
    assert call(ckpt, "--out", tmp_path / "hf", "--label-dict", labels) == 2
    assert f"{labels}: 2 labels, but head '{HEAD}' has 3 outputs" in error_line(capsys)
    assert not (tmp_path / "hf").exists()

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert call(ckpt, "--out", tmp_path / "full") == 2
    assert "full: exists; choose another --out, or --overwrite" in error_line(capsys)

    # a head that reads documents in chunks: the exported model would read them whole, or not at all
    chunked = checkpoint(tmp_path / "chunked.pt", spm_dir, ["--compressed-dim", "16", "--pooler-tokens", "mean",
                                                             "--chunk-length", "32"])  # fmt: skip
    assert call(chunked, "--out", tmp_path / "hf") == 2
    assert "reads documents in chunks (--chunk-length 32), which the export cannot" in error_line(capsys)


def test_help_and_exit_2_from_the_command_line(tmp_path):
    script = SCRIPTS / "export_hf.py"
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=ENV)
    assert shown.returncode == 0 and "--spm-model" in shown.stdout and "trust_remote_code" in shown.stdout
    no_spm = tmp_path / "spm.model"
    command = [sys.executable, script, tmp_path / "model.pt", "--out", tmp_path / "hf", "--spm-model", no_spm]
    proc = subprocess.run(command, capture_output=True, text=True, env=ENV)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {no_spm}: no such sentencepiece model"
