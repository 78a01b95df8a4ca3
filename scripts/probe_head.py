#!/usr/bin/env python3
r"""Start finetuning from a linear probe (LP-FT): fit a logistic regression on the frozen model's
features of a classification data-bin, and write a copy of the checkpoint whose classification
head computes it. scripts/finetune.sh then starts from that head instead of a random one.

The features are what the classification head reads (--pooler-tokens): the final state of <s>
(first) or the mean of the final states (mean), of each training document as finetuning reads it
(the long_sentence_prediction task, with --truncation). The L2
penalty is picked on the validation split. The head (dense, tanh, out_proj) is set so that it
computes the probe's logits (linformer_tools/probe.py says how); the script checks that the
written checkpoint, loaded as fairseq loads it, predicts the validation split as the probe does.

    python scripts/probe_head.py CHECKPOINT --data DATA-BIN --truncation head_tail --pooler-tokens mean \
        --out PROBED.pt
    scripts/finetune.sh long_documents PROBED.pt --data DATA-BIN

scripts/finetune.sh --lp-ft mean runs it first (the probed checkpoint in its --save-dir).

Kumar et al. 2022 and docs/long_documents.md (where it matters: a Linformer on long documents).
"""

import logging

# before fairseq's import, whose modules configure the root logger at DEBUG and log at import
logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from linformer_fairseq.models.classification import POOLER_TOKENS  # noqa: E402
from linformer_tools import checkpoints  # noqa: E402
from linformer_tools.common import fail  # noqa: E402
from linformer_tools.probe import ACTIVATIONS, PENALTIES, fit_linear_probe, head_weights  # noqa: E402

HEAD = "sentence_classification_head"  # fairseq's sentence_prediction default


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="a pretrained RoBERTa or Linformer checkpoint")
    p.add_argument("--data", type=Path, required=True, help="a sentence_prediction data-bin (input0/, label/)")
    p.add_argument("--out", type=Path, required=True, help="the checkpoint to write, with the probe's head")
    p.add_argument("--truncation", choices=["none", "head", "tail", "head_tail"], default="none",
                   help="documents longer than the model, as finetuning cuts them (the task's --truncation; "
                        "default: none, which stops at the first that does not fit)")  # fmt: skip
    p.add_argument("--truncation-head-tokens", type=int, default=128,
                   help="head_tail: tokens kept from the start after <s> (default: 128)")  # fmt: skip
    p.add_argument("--pooler-tokens", choices=POOLER_TOKENS,
                   help="what the head reads, written into the checkpoint for finetuning to keep: first (<s>) "
                        "or mean (of the document's final states); default: the checkpoint's, else first")  # fmt: skip
    p.add_argument("--chunk-length", type=int, default=0,
                   help="read documents in chunks of N tokens, the head on the mean of all their states "
                        "(the model's --chunk-length, kept; needs --pooler-tokens mean; default: 0, off)")  # fmt: skip
    p.add_argument("--max-positions", type=int,
                   help="documents are read up to this many tokens, longer ones cut by --truncation (finetuning's "
                        "task.max_positions; default: the model's)")  # fmt: skip
    p.add_argument("--penalties", type=float, nargs="+", default=list(PENALTIES),
                   help=f"L2 penalties to try, the best on validation kept (default: {list(PENALTIES)})")  # fmt: skip
    p.add_argument("--tokens-a-batch", type=int, default=4096, help="tokens a forward batch (default: 4096)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs (default: cuda if available)")  # fmt: skip
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if not (args.data / "input0" / "dict.txt").is_file() or not (args.data / "label" / "dict.txt").is_file():
        p.error(f"--data {args.data}: not a sentence_prediction data-bin (no input0/dict.txt and label/dict.txt)")
    if args.out.resolve() == args.checkpoint.resolve():
        p.error("--out is CHECKPOINT: write the probed model beside it")
    if args.tokens_a_batch < 1 or min(args.penalties) <= 0:
        p.error("--tokens-a-batch and --penalties must be positive")
    if args.chunk_length < 0 or (args.max_positions is not None and args.max_positions < 1):
        p.error("--chunk-length must be >= 0 and --max-positions >= 1")
    return args


def task_for(args, max_positions):
    """The finetuning's task on --data, reading documents as finetuning does."""
    from linformer_fairseq.tasks.long_sentence_prediction import (
        LongSentencePredictionConfig,
        LongSentencePredictionTask,
    )

    labels = [line.split()[0] for line in (args.data / "label" / "dict.txt").read_text().splitlines() if line]
    cfg = LongSentencePredictionConfig(
        data=str(args.data), num_classes=len(labels), init_token=0, separator_token=2, seed=1, regression_target=False,
        classification_head_name=HEAD,
        max_positions=max_positions, truncation=args.truncation, truncation_head_tokens=args.truncation_head_tokens,
    )  # fmt: skip
    return LongSentencePredictionTask.setup_task(cfg)


def features_and_labels(model, task, split, tokens_a_batch, head=None):
    """What the head reads of each document of SPLIT (``N x C``: as --pooler-tokens says) and its
    label, in the split's order; with HEAD, that head's predictions instead."""
    from fairseq import utils

    try:
        task.load_dataset(split)
    except ValueError as e:  # --truncation none and a document longer than the model
        fail(f"{e}")
    dataset = task.datasets[split]
    order = sorted(range(len(dataset)), key=lambda i: dataset.size(i))  # batches padded to a close length
    device = next(model.parameters()).device
    rows, labels = [None] * len(dataset), [None] * len(dataset)
    start, started = 0, time.time()
    with torch.no_grad():
        while start < len(order):
            batch = order[start : start + max(1, tokens_a_batch // max(1, dataset.size(order[start])))]
            start += len(batch)
            sample = utils.apply_to_sample(lambda t: t.to(device), dataset.collater([dataset[i] for i in batch]))
            tokens = sample["net_input"]["src_tokens"]
            out = (
                model(tokens, classification_head_name=head)[0].argmax(-1)
                if head
                else model.head_input(tokens)[0][:, 0]
            )
            for i, row, label in zip(sample["id"].tolist(), out.cpu(), sample["target"].view(-1).tolist()):
                rows[i], labels[i] = row, label
            if time.time() - started > 30:
                print(f"  {split}: {start}/{len(order)} documents", flush=True)
                started = time.time()
    return torch.stack(rows), torch.tensor(labels)


def main():
    args = parse_args()
    state = checkpoints.read_checkpoint(args.checkpoint)
    checkpoints.model_kind(state, args.checkpoint)
    ns = checkpoints.model_namespace(state)
    ns.pooler_tokens = args.pooler_tokens or getattr(ns, "pooler_tokens", None) or "first"
    ns.chunk_length = args.chunk_length or getattr(ns, "chunk_length", 0) or 0
    activation = getattr(ns, "pooler_activation_fn", "tanh")
    if activation not in ACTIVATIONS:  # before the long feature pass
        fail(f"{args.checkpoint}: its head's activation is {activation} (--pooler-activation-fn); a probe becomes "
             f"a head with {' or '.join(ACTIVATIONS)}")  # fmt: skip
    try:
        model = checkpoints.build_model(ns, checkpoints.vocab_size(state))
    except ValueError as e:  # a --chunk-length the model cannot read
        fail(f"{args.checkpoint}: {e}")
    checkpoints.load_weights(model, state["model"])
    model.to(args.device).eval()
    task = task_for(args, args.max_positions or ns.max_positions)
    if len(task.source_dictionary) != checkpoints.vocab_size(state):
        fail(f"--data {args.data}: its dictionary has {len(task.source_dictionary)} symbols with <mask>, the model "
             f"{checkpoints.vocab_size(state)}: the data-bin was not made with the model's dictionary")  # fmt: skip

    features, labels = {}, {}
    for split in ("train", "valid"):
        features[split], labels[split] = features_and_labels(model, task, split, args.tokens_a_batch)
    probe = fit_linear_probe(features, labels, args.penalties)
    train = probe.logits(features["train"]).argmax(1).eq(labels["train"]).double().mean().item()
    print(f"probe of the {ns.pooler_tokens} final states: L2 penalty {probe.penalty:g}, accuracy train "
          f"{100 * train:.1f}, valid {100 * probe.valid:.1f}")  # fmt: skip

    model.register_classification_head(HEAD, num_classes=probe.bias.numel())
    head = model.classification_heads[HEAD]
    weights = head_weights(probe, activation)
    head.load_state_dict({name: w.to(args.device) for name, w in weights.items()})
    note = dict(kind="linear probe head", source=str(args.checkpoint), data=str(args.data),
                truncation=args.truncation, pooler_tokens=ns.pooler_tokens, chunk_length=ns.chunk_length,
                max_positions=args.max_positions or ns.max_positions, penalty=probe.penalty,
                valid_accuracy=100 * probe.valid)  # fmt: skip
    checkpoints.write_checkpoint(state, ns, model.cpu(), args.out, note)

    # the round trip: the written checkpoint, loaded as fairseq loads it, predicts as the probe
    written = checkpoints.read_checkpoint(args.out)
    reloaded = checkpoints.build_model(checkpoints.model_namespace(written), checkpoints.vocab_size(written))
    checkpoints.load_weights(reloaded, written["model"])
    guesses, _ = features_and_labels(reloaded.to(args.device).eval(), task, "valid", args.tokens_a_batch, HEAD)
    agree = guesses.eq(probe.logits(features["valid"]).argmax(1)).double().mean().item()
    head_valid = guesses.eq(labels["valid"]).double().mean().item()
    print(f"wrote {args.out}: its head's valid accuracy {100 * head_valid:.1f}, agreeing with the probe on "
          f"{100 * agree:.1f}% of the validation documents")  # fmt: skip
    report = dict(note, train_accuracy=100 * train, head_valid_accuracy=100 * head_valid, agreement=100 * agree)
    print(json.dumps(report))
    if agree < 0.98:
        fail(f"the written head agrees with the probe on only {100 * agree:.1f}% of the validation documents")


if __name__ == "__main__":
    main()
