"""--chunk-length: a document longer than N tokens is read as consecutive chunks of N tokens, each
through the encoder on its own, and the classification head reads the mean of all its chunks'
final states (the practitioner's baseline for documents longer than the encoder)."""

import re
import sys
from types import SimpleNamespace

import pytest
import torch
from fairseq import options, tasks, utils

from linformer_fairseq.models.classification import PooledHubInterface
from linformer_tools.common import REPO

VOCAB, N, L, HEAD = 30, 16, 8, "cls"  # N: the encoder's positions; L: the chunks' length
SIZES = ["--encoder-layers", "2", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32"]
SIZES += ["--encoder-attention-heads", "2", "--max-positions", str(N), "--dropout", "0", "--attention-dropout", "0"]
ARCHS = {"roberta_imported": [], "linformer_roberta_base": ["--compressed-dim", "4"]}
CHUNKED = ["--chunk-length", str(L), "--pooler-tokens", "mean"]


def build(tmp_path, arch, *flags, dtype=torch.float64):
    """The model fairseq-train builds from these flags, with a head of 3 classes."""
    (tmp_path / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(VOCAB - 4)))
    argv = [str(tmp_path), "--user-dir", str(REPO / "linformer_fairseq"), "--arch", arch, "--task", "masked_lm"]
    args = options.parse_args_and_arch(options.get_training_parser(), argv + SIZES + ARCHS[arch] + list(flags))
    torch.manual_seed(0)
    model = tasks.setup_task(args).build_model(args)
    model.register_classification_head(HEAD, num_classes=3)
    return model.to(dtype).eval()


def document(length, seed=0):
    """``1 x length``: <s>, words, </s>."""
    t = torch.randint(4, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))
    t[0, 0], t[0, -1] = 0, 2
    return t


def batch(*docs):
    """The documents right-padded to the longest, as fairseq's RightPadDataset pads them."""
    out = torch.full((len(docs), max(d.size(1) for d in docs)), 1)  # 1: the dictionary's pad
    for row, d in enumerate(docs):
        out[row, : d.size(1)] = d[0]
    return out


def logits(model, src):
    return model(src, classification_head_name=HEAD)[0]


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


def test_a_document_of_two_and_a_half_chunks_reads_each_chunk_alone(tmp_path, arch):
    model, doc = build(tmp_path, arch, *CHUNKED), document(5 * L // 2)  # longer than the encoder's N positions
    with torch.no_grad():
        states = torch.cat([model.encoder(chunk, features_only=True)[0] for chunk in doc.split(L, 1)], 1)
        by_hand = model.classification_heads[HEAD](states.mean(1, keepdim=True))
        torch.testing.assert_close(logits(model, doc), by_hand, atol=1e-9, rtol=0)


def test_a_document_reads_the_same_alone_and_in_a_batch_with_a_longer_one(tmp_path, arch):
    model = build(tmp_path, arch, *CHUNKED)
    short, long = document(L + 3, seed=1), document(3 * L + 5, seed=2)  # 2 and 4 chunks
    with torch.no_grad():
        together = logits(model, batch(short, long))
        torch.testing.assert_close(together[0], logits(model, short)[0], atol=1e-9, rtol=0)
        torch.testing.assert_close(together[1], logits(model, long)[0], atol=1e-9, rtol=0)


def test_a_document_of_at_most_one_chunk_reads_as_mean_pooling_without_chunks(tmp_path, arch):
    chunked, plain = build(tmp_path, arch, *CHUNKED), build(tmp_path, arch, "--pooler-tokens", "mean")
    plain.load_state_dict(chunked.state_dict())
    src = batch(document(L), document(L - 3, seed=1))
    with torch.no_grad():
        assert torch.equal(logits(chunked, src), logits(plain, src))


def test_chunks_of_pads_alone_never_reach_the_encoder_and_give_no_nan(tmp_path, arch):
    """A chunk of pads alone has every key masked: a NaN (a softmax over nothing) or, in the Linformer,
    an error (it reads a row that starts with a pad as left padding)."""
    model = build(tmp_path, arch, *CHUNKED, dtype=torch.float32).train()  # dropout 0: the same model, with grads
    read = []
    model.encoder.register_forward_pre_hook(lambda _, inputs: read.append(inputs[0]))
    out = logits(model, batch(document(5), document(4 * L, seed=1)))  # the short one's chunks 2 to 4: pads alone
    out.sum().backward()
    assert read[0].shape == (5, L) and read[0].ne(1).any(1).all(), read[0]
    assert out.isfinite().all(), out
    bad = [name for name, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    assert not bad, f"non-finite gradients: {bad}"


def test_the_hub_predicts_what_the_forward_gives(tmp_path, arch):
    model = build(tmp_path, arch, *CHUNKED)
    hub = PooledHubInterface(SimpleNamespace(bpe=None), None, model).to(torch.float64)
    src = batch(document(L + 3, seed=1), document(3 * L + 5, seed=2))
    with torch.no_grad():
        assert torch.equal(hub.predict(HEAD, src, return_logits=True), logits(model, src))
        assert torch.equal(hub.predict(HEAD, src[1]), logits(model, src[1:]).log_softmax(-1))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--chunk-length", "8"], "--chunk-length 8 needs --pooler-tokens mean (got --pooler-tokens first)"),
        (["--chunk-length", "8", "--pooler-tokens", "first"], "--chunk-length 8 needs --pooler-tokens mean"),
        (
            ["--chunk-length", "17", "--pooler-tokens", "mean"],
            f"--chunk-length 17 exceeds the encoder's --max-positions {N}",
        ),
    ],
)
def test_chunks_the_model_cannot_read_are_refused_at_build(tmp_path, arch, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build(tmp_path, arch, *flags)


def test_with_chunks_the_task_alone_limits_the_length(tmp_path, arch):
    chunked, plain = build(tmp_path, arch, *CHUNKED), build(tmp_path, arch, "--pooler-tokens", "mean")
    assert plain.max_positions() == N and chunked.max_positions() == sys.maxsize
    assert utils.resolve_max_positions(2048, chunked.max_positions(), 4400) == 2048  # as fairseq's trainer asks
    assert utils.resolve_max_positions(2048, plain.max_positions(), 4400) == N
