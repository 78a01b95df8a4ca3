"""The long_sentence_prediction task's truncations (head, tail, head_tail, none) on real IMDB
reviews: the bundled sample (data/sample/imdb, 48 reviews), binarized word by word with a
dictionary of their own words, so every token is a word of the review and none is <unk>.
The task builds each input as fairseq's sentence_prediction does: <s> (--init-token), the
review's words, </s>; a cut input keeps both and is never longer than max_positions."""

import math
import subprocess
import sys

import pytest
import torch
from conftest import ENV, REPO

from dataprep.imdb import read_reviews
from linformer_tools.common import SAMPLE
from linformer_tools.logs import records_in

M = 256  # the unit tests' max_positions: 15 of the 32 train reviews are longer, 17 fit
HEAD = 64  # head_tail's first tokens (n/4, as Sun et al.'s 128 of 512); the last M - 2 - HEAD follow
SPLITS = {"train": "train", "valid": "test"}  # the sample's test reviews serve as valid


@pytest.fixture(scope="module")
def imdb(tmp_path_factory):
    """(data-bin in sentence_prediction's layout, {split: [review text]}): train and valid."""
    from fairseq.data import Dictionary, indexed_dataset

    root = tmp_path_factory.mktemp("imdb_words")
    reviews = read_reviews(SAMPLE / "imdb/aclImdb_sample.tar.gz")
    words, labels = Dictionary(), Dictionary()
    for label in ("neg", "pos"):  # data-prep's classes: neg = 0, pos = 1
        labels.add_symbol(label)
    for split in SPLITS.values():
        for _, text in reviews[split]:
            for word in text.split():
                words.add_symbol(word)
    texts = {}
    for name, split in SPLITS.items():
        texts[name] = [text for _, text in reviews[split]]
        for folder, dictionary, lines in (
            ("input0", words, texts[name]),
            ("label", labels, [label for label, _ in reviews[split]]),
        ):
            (root / folder).mkdir(exist_ok=True)
            dictionary.save(str(root / folder / "dict.txt"))
            out = indexed_dataset.make_builder(str(root / folder / f"{name}.bin"), impl="mmap")
            for line in lines:
                out.add_item(dictionary.encode_line(line, add_if_not_exist=False).long())
            out.finalize(str(root / folder / f"{name}.idx"))
    return root, texts


def task(data, max_positions, truncation, head=HEAD):
    from linformer_fairseq.tasks.long_sentence_prediction import (
        LongSentencePredictionConfig,
        LongSentencePredictionTask,
    )

    cfg = LongSentencePredictionConfig(
        data=str(data),
        num_classes=2,
        init_token=0,
        separator_token=2,
        max_positions=max_positions,
        truncation=truncation,
        truncation_head_tokens=head,
        regression_target=False,
        classification_head_name="sentence_classification_head",
        seed=1,
    )
    return LongSentencePredictionTask.setup_task(cfg)


def inputs(data, max_positions, truncation, split="train", head=HEAD):
    """The task's inputs of `split` in file order, and the sizes it batches by."""
    t = task(data, max_positions, truncation, head)
    dataset = t.load_dataset(split)  # shuffled in its batch order only: item i is row i
    items = [dataset[i]["net_input.src_tokens"] for i in range(len(dataset))]
    return items, dataset.sizes[0], t.source_dictionary


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mode", ["head", "tail", "head_tail"])
def test_each_truncation_keeps_exactly_the_words_it_names(imdb, mode, split):
    data, texts = imdb
    got, sizes, d = inputs(data, M, mode, split)
    reviews = [text.split() for text in texts[split]]
    assert sum(len(r) + 2 > M for r in reviews) >= 8 and sum(len(r) + 2 <= M for r in reviews) >= 8, (
        "the sample should hold both reviews longer than the model and reviews that fit"
    )
    head = {"head": M - 2, "tail": 0, "head_tail": HEAD}[mode]
    tail = M - 2 - head
    for tokens, words in zip(got, reviews):
        assert tokens[0] == d.bos() == 0 and tokens[-1] == d.eos(), "<s> first (--init-token 0), </s> last"
        assert d.unk() not in tokens.tolist()
        if len(words) + 2 <= M:  # fits: every word, untouched
            assert d.string(tokens[1:-1]) == " ".join(words)
            continue
        assert len(tokens) == M, f"{mode}: a review of {len(words) + 2} tokens became {len(tokens)}, not {M}"
        assert d.string(tokens[1 : 1 + head]) == " ".join(words[:head]), f"{mode}: not the first {head} words"
        assert d.string(tokens[1 + head : -1]) == " ".join(words[len(words) - tail :]), (
            f"{mode}: not the last {tail} words"
        )
    # what fairseq batches and filters by: the cut lengths, none above max_positions
    assert list(sizes) == [len(tokens) for tokens in got] and max(sizes) == M


def test_a_padded_batch_holds_the_cut_inputs(imdb):
    data, _ = imdb
    t = task(data, M, "head_tail")
    dataset = t.load_dataset("train")
    batch = dataset.collater([dataset[i] for i in range(len(dataset))])
    tokens, lengths = batch["net_input"]["src_tokens"], batch["net_input"]["src_lengths"]
    assert tokens.shape == (len(dataset), M) and lengths.max() == M  # the model never sees more than M
    assert (tokens[torch.arange(len(dataset)), lengths - 1] == t.source_dictionary.eos()).all()
    assert batch["target"].view(-1).tolist() == [0] * 16 + [1] * 16  # the sample's rows: 16 neg, then 16 pos


def test_reviews_within_the_budget_are_untouched(imdb):
    data, texts = imdb
    reviews = [text.split() for text in texts["train"]]
    longest = max(len(r) for r in reviews) + 2
    whole, _, _ = inputs(data, longest, "none")
    for mode in ("head", "tail", "head_tail"):
        got, _, _ = inputs(data, longest, mode)
        assert all(torch.equal(a, b) for a, b in zip(got, whole)), f"{mode} changed a review that fits"
    # the edge: a review of exactly max_positions tokens stays whole; one token less of room cuts it
    i = next(i for i, r in enumerate(reviews) if HEAD + 4 <= len(r) + 2 < longest)  # room for HEAD, and a tail
    n = len(reviews[i]) + 2
    assert torch.equal(inputs(data, n, "head_tail")[0][i], whole[i])
    cut = inputs(data, n - 1, "head_tail")[0][i]
    assert len(cut) == n - 1 and torch.equal(cut[: 1 + HEAD], whole[i][: 1 + HEAD])


def test_loads_at_once_in_threads_each_cut_to_their_own_length(imdb):
    """The task takes a name of fairseq's module over while it loads (the study predicts in threads)."""
    from concurrent.futures import ThreadPoolExecutor

    from fairseq.tasks import sentence_prediction

    data, _ = imdb
    original = sentence_prediction.maybe_shorten_dataset
    lengths = [64, M] * 8
    with ThreadPoolExecutor(8) as pool:
        longest = list(pool.map(lambda n: int(max(inputs(data, n, "head")[1])), lengths))
    assert longest == lengths, "a load cut its reviews to another load's length, or not at all"
    assert sentence_prediction.maybe_shorten_dataset is original


@pytest.mark.parametrize("split", SPLITS)
def test_truncation_off_stops_on_a_review_longer_than_the_model(imdb, split):
    data, texts = imdb
    lengths = [len(text.split()) + 2 for text in texts[split]]  # <s> review </s>
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    with pytest.raises(
        ValueError, match=rf"{split}: document {longest} is {lengths[longest]} tokens long .* max_positions {M}"
    ):
        task(data, M, "none").load_dataset(split)


def test_head_tail_head_tokens_must_fit_the_budget(imdb):
    data, _ = imdb
    for head in (-1, M - 1):
        with pytest.raises(AssertionError, match=rf"--truncation-head-tokens {head}: .* 0 to {M - 2} tokens"):
            task(data, M, "head_tail", head).load_dataset("train")


def fairseq_train(data, save_dir, truncation, *extra):
    """fairseq-train, as a user runs it: the plugin's task on the reviews, a tiny Linformer at
    n = 64 (30 of the 32 train reviews are longer, most much longer)."""
    cmd = [
        sys.executable,
        "-m",
        "fairseq_cli.train",
        data,
        "--user-dir",
        REPO / "linformer_fairseq",
        "--task",
        "long_sentence_prediction",
        "--truncation",
        truncation,
        "--truncation-head-tokens",
        "16",
        "--max-positions",
        "64",
        "--init-token",
        "0",
        "--separator-token",
        "2",
        "--num-classes",
        "2",
        "--criterion",
        "sentence_prediction",
        "--arch",
        "linformer_roberta_base",
        "--encoder-layers",
        "2",
        "--encoder-embed-dim",
        "32",
        "--encoder-ffn-embed-dim",
        "64",
        "--encoder-attention-heads",
        "2",
        "--compressed-dim",
        "16",
        "--optimizer",
        "adam",
        "--lr",
        "1e-4",
        "--lr-scheduler",
        "polynomial_decay",
        "--warmup-updates",
        "1",
        "--total-num-update",
        "4",
        "--max-update",
        "4",
        "--batch-size",
        "8",
        "--max-tokens",
        "512",
        "--no-save",
        "--save-dir",
        save_dir,
        "--log-format",
        "simple",
        "--log-interval",
        "1",
        "--cpu",
        "--num-workers",
        "0",
        "--seed",
        "1",
        *extra,
    ]
    return subprocess.run([str(c) for c in cmd], env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_fairseq_train_finetunes_on_cut_reviews_and_refuses_uncut_ones(imdb, tmp_path):
    data, texts = imdb
    proc = fairseq_train(data, tmp_path / "head_tail", "head_tail", "--log-parameter-groups", "--local-window", "8")
    assert proc.returncode == 0, f"fairseq-train exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    log = proc.stdout
    assert "task: LongSentencePredictionTask" in log and "'truncation': head_tail," in log, log[-3000:]
    assert "Loaded train with #samples: 32" in log and "skipped" not in log, "every review is trained on, cut"
    steps = records_in(log, "train_inner")
    assert [int(r["num_updates"]) for r in steps] == [1, 2, 3, 4], log[-3000:]
    (valid,) = records_in(log, "valid")
    losses = [r["loss"] for r in steps] + [valid["loss"]]
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses), losses
    # --log-parameter-groups: the groups' shares make up the gradient norm; nothing has moved
    # before the first update, everything trained has after it
    groups = {"head", "projections", "offsets", "attention", "ffn", "norms", "embeddings"}
    for step in steps:
        assert {key[len("gshare_") :] for key in step if key.startswith("gshare_")} == groups, step
        assert math.isclose(sum(step[f"gshare_{g}"] ** 2 for g in groups), 1.0, abs_tol=1e-3), step
    assert all(steps[0][f"moved_{g}"] == 0 for g in groups), steps[0]
    assert all(steps[-1][f"moved_{g}"] > 0 for g in groups), steps[-1]

    # truncation off: fairseq-train stops before the first update, naming the review and both lengths
    lengths = [len(text.split()) + 2 for text in texts["valid"]]  # fairseq-train loads valid first
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    proc = fairseq_train(data, tmp_path / "none", "none")
    expected = f"valid: document {longest} is {lengths[longest]} tokens long (with its special tokens), longer than "
    assert proc.returncode != 0 and f"{expected}max_positions 64" in proc.stderr, proc.stderr[-3000:]


def test_parameter_groups_name_every_parameter_a_finetuning_trains():
    """--log-parameter-groups: each parameter of a Linformer with a band and a classification head
    falls in its group; only the masked-LM head, which finetuning does not train, is 'other'."""
    from test_linformer_model import build_model

    from linformer_fairseq.tasks.long_sentence_prediction import parameter_group

    model = build_model(local_window=8)
    model.register_classification_head("sentence_classification_head", num_classes=2)
    groups = {}
    for name, _ in model.named_parameters():
        groups.setdefault(parameter_group(name), []).append(name)
    assert set(groups) == {"head", "projections", "offsets", "attention", "ffn", "norms", "embeddings", "other"}
    assert all(name.startswith("encoder.lm_head.") for name in groups["other"]), groups["other"]
    assert all(".self_attn." in name and "compress" not in name for name in groups["attention"])
