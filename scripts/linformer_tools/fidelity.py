"""A student encoder against its teacher, as scripts/linearize.py distils and reports it and the
long-document study measures it: fairseq's special ids, a checkpoint loaded as an eval-mode
model, a forward pass that keeps every layer's hidden states and attention, and the fidelity
(per-layer relative errors, final-state cosine, zero-shot STS) of one model to another.

It imports fairseq (through checkpoints): a script that wants fairseq's import-time logging
quiet configures logging before importing this module."""

import math

import torch
import torch.nn.functional as F

from . import checkpoints
from .common import fail

BOS, PAD, EOS = 0, 1, 2  # fairseq's ids: an import puts [CLS] [PAD] [SEP] there


def trimmed(x):
    """Rows without the padding columns that every row has (documents: a batch as long as its longest)."""
    return x[:, : int(x.ne(PAD).sum(1).max())].long()


def load(path, device="cpu"):
    """(fairseq model on ``device``, its namespace, the checkpoint) from a checkpoint; eval mode
    (distillation runs without dropout)."""
    state = checkpoints.read_checkpoint(path)
    ns = checkpoints.model_namespace(state)
    model = checkpoints.build_model(ns, checkpoints.vocab_size(state))
    missing = checkpoints.load_weights(model, state["model"])
    if missing:
        fail(f"{path}: weights missing for {', '.join(missing[:5])}")
    return model.to(device).eval(), ns, state


def device_of(model):
    return next(model.parameters()).device


def layers(model):
    return model.encoder.sentence_encoder.layers


def run(model, tokens, grad=False):
    """(hidden states after each layer, each layer's attention input and output): T x B x C."""
    attention = []

    def hook(module, args, kwargs, output):
        attention.append((kwargs["query"], output[0]))

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers(model)]
    tokens = tokens.to(device_of(model))
    try:
        with torch.set_grad_enabled(grad):
            _, extra = model(tokens, features_only=True, return_all_hiddens=True)
    finally:
        for handle in handles:
            handle.remove()
    return extra["inner_states"][1:], attention


def fidelity(student, teacher, blocks, sts=None, batch=4):
    """Per layer relative errors of attention output and hidden states, and the mean token cosine
    of the final hidden states, on ``blocks``; with ``sts`` pairs, the student's zero-shot STS."""
    L = len(layers(teacher))
    sums = {"attention": [[0.0, 0.0] for _ in range(L)], "hidden": [[0.0, 0.0] for _ in range(L)]}
    cosine, tokens = 0.0, 0
    for start in range(0, blocks.size(0), batch):
        x = trimmed(blocks[start : start + batch]).to(device_of(student))
        real = x.ne(PAD).t()
        ours, our_attention = run(student, x)
        theirs, their_attention = run(teacher, x)
        for i in range(L):
            for key, a, b in (
                ("attention", our_attention[i][1], their_attention[i][1]),
                ("hidden", ours[i], theirs[i]),
            ):
                sums[key][i][0] += float((a - b)[real].pow(2).sum())
                sums[key][i][1] += float(b[real].pow(2).sum())
        cosine += float(F.cosine_similarity(ours[-1][real], theirs[-1][real], dim=-1).sum())
        tokens += int(real.sum())
    errors = {key: [math.sqrt(d / max(t, 1e-30)) for d, t in rows] for key, rows in sums.items()}
    return {**errors, "cosine": cosine / tokens, **({"sts": sts_spearman(student, sts)} if sts else {})}


def sts_pairs(path, tokenizer_json, n):
    """(first sentences, second sentences, gold scores) of a GLUE STS-B tsv, as fairseq ids of
    <s> sentence </s> cut to n tokens."""
    import csv

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_padding()
    tokenizer.enable_truncation(n)
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows or not {"sentence1", "sentence2", "score"} <= rows[0].keys():
        fail(f"{path}: not a GLUE STS-B file (columns sentence1, sentence2, score)")

    def encode(key):
        return [torch.tensor(e.ids) for e in tokenizer.encode_batch([row[key] for row in rows])]

    return encode("sentence1"), encode("sentence2"), torch.tensor([float(row["score"]) for row in rows])


def embeddings(model, sentences, batch=64):
    """sentence-transformers' embedding: the mean of the final hidden states over the real tokens."""
    out = []
    with torch.no_grad():
        for start in range(0, len(sentences), batch):
            tokens = torch.nn.utils.rnn.pad_sequence(
                sentences[start : start + batch], batch_first=True, padding_value=PAD
            ).to(device_of(model))
            real = tokens.ne(PAD).unsqueeze(-1)
            features = model(tokens, features_only=True)[0]
            out.append((features * real).sum(1) / real.sum(1))
    return torch.cat(out).cpu()


def sts_spearman(model, pairs):
    """Spearman correlation of the embeddings' cosine with the gold similarity (zero-shot STS)."""
    from scipy.stats import spearmanr

    first, second, gold = pairs
    cosine = F.cosine_similarity(embeddings(model, first), embeddings(model, second), dim=-1)
    return float(spearmanr(cosine.numpy(), gold.numpy()).statistic)
