"""Sentence prediction on documents that may be longer than the model: fairseq's
``sentence_prediction`` with the truncations that users of RoBERTa apply to long documents
(head, tail, head+tail: Sun et al. 2019, "How to Fine-Tune BERT for Text Classification?",
found the first 128 and last 382 tokens best on IMDB at 512), and no silent loss of a document
when truncation is off.

fairseq's own ``--shorten-method truncate`` keeps the first max_positions tokens, dropping the
final ``</s>``; without it, fairseq-train skips training documents longer than the model with
only a count in its log. Here every truncation keeps ``<s>`` (--init-token) and ``</s>`` where
fairseq puts them, and ``--truncation none`` stops on the first document that does not fit.
"""

import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from fairseq import metrics
from fairseq.data import BaseWrapperDataset
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask

TRUNCATIONS = ChoiceEnum(["none", "head", "tail", "head_tail"])


@dataclass
class LongSentencePredictionConfig(SentencePredictionConfig):
    truncation: TRUNCATIONS = field(
        default="none",
        metadata={
            "help": "how a document longer than max_positions is cut: head keeps its first tokens, "
            "tail its last, head_tail the first --truncation-head-tokens and the rest from the end; "
            "none stops with an error naming the document and both lengths"
        },
    )
    truncation_head_tokens: int = field(
        default=128, metadata={"help": "head_tail: tokens kept from the start after <s> (at most max_positions - 2)"}
    )
    log_parameter_groups: bool = field(
        default=False,
        metadata={
            "help": "log at every update, for each parameter group (projections E/F, the band's far-field "
            "offsets, attention, FFN, embeddings, layer norms, the classification head), its share of the "
            "gradient norm (gshare_GROUP; times fairseq's gnorm: the group's norm) and how far it has moved "
            "from where this run started (moved_GROUP: |p - p0| / |p0|, or |p - p0| where p0 = 0; p0 as loaded "
            "or resumed)"
        },
    )


class TruncatedDataset(BaseWrapperDataset):
    """Items of at most ``length`` tokens: the first ``keep_first`` tokens (``<s>``) and the
    last (``</s>``) stay, and the tokens between are cut as ``mode`` says."""

    def __init__(self, dataset, length: int, mode: str, head: int, keep_first: int):
        super().__init__(dataset)
        body = length - keep_first - 1
        assert body > 0, f"max_positions {length} leaves no room for text between the special tokens"
        # h given, t = budget - h: an h outside the budget would silently turn into head truncation
        assert mode != "head_tail" or 0 <= head <= body, (
            f"--truncation-head-tokens {head}: head_tail keeps 0 to {body} tokens from the start at "
            f"max_positions {length}"
        )
        self.length, self.keep_first = length, keep_first
        self.head = {"head": body, "tail": 0, "head_tail": head}[mode]
        self.tail = body - self.head

    def __getitem__(self, index):
        item = self.dataset[index]
        if item.numel() <= self.length:
            return item
        end = item.numel() - 1 - self.tail  # the tail's first token; the last token is </s>
        return torch.cat([item[: self.keep_first + self.head], item[end:]])

    @property
    def sizes(self):
        return np.minimum(self.dataset.sizes, self.length)


# The name taken over below is a module global of fairseq's task: two loads at once in one process
# (threads) would each see and restore the other's, and one would load its documents uncut.
_SHORTEN_NAME = threading.Lock()


# parameter groups by name, the first match wins (fairseq's and the plugin's module names)
PARAMETER_GROUPS = (
    ("head", ("classification_heads.",)),
    ("projections", ("compress_k.", "compress_v.")),
    ("offsets", ("local_far_bias",)),
    ("attention", ("self_attn.",)),
    ("ffn", ("fc1.", "fc2.")),
    ("norms", ("layer_norm.", "layernorm_embedding.")),
    ("embeddings", ("embed_tokens.", "embed_positions.")),
)


def parameter_group(name: str) -> str:
    return next((group for group, parts in PARAMETER_GROUPS if any(part in name for part in parts)), "other")


class ParameterGroupLog:
    """Each group's share of the gradient norm and its relative distance from the start. Shares,
    not norms: under fp16 the model's gradients are still multiplied by the loss scale here."""

    def __init__(self):
        self.start: dict[str, torch.Tensor] = {}

    def __call__(self, model):
        # what this update trains: a finetuning's masked-LM head, say, gets no gradient
        trained = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
        squares = {}  # group -> [gradient, moved, start] squared norms
        for name, p in trained:
            sums = squares.setdefault(parameter_group(name), [p.new_zeros((), dtype=torch.float32) for _ in range(3)])
            start = self.start.setdefault(name, p.detach().clone())  # before its first update
            sums[0] += p.grad.detach().float().square().sum()
            sums[1] += (p.detach() - start).float().square().sum()
            sums[2] += start.float().square().sum()
        values = {group: torch.stack(sums).tolist() for group, sums in squares.items()}
        total = sum(v[0] for v in values.values()) ** 0.5
        for group, (gradient, moved, start) in sorted(values.items()):
            metrics.log_scalar(f"gshare_{group}", gradient**0.5 / max(total, 1e-30), round=4)
            metrics.log_scalar(f"moved_{group}", (moved / (start if start > 0 else 1.0)) ** 0.5, round=5)


@register_task("long_sentence_prediction", dataclass=LongSentencePredictionConfig)
class LongSentencePredictionTask(SentencePredictionTask):
    """``sentence_prediction`` whose inputs are cut by ``--truncation`` (or checked to fit)."""

    def __init__(self, cfg, data_dictionary, label_dictionary):
        super().__init__(cfg, data_dictionary, label_dictionary)
        self.parameter_group_log = ParameterGroupLog() if cfg.log_parameter_groups else None

    def optimizer_step(self, optimizer, model, update_num):
        # here the update's gradients are complete (summed over update_freq, clipped)
        if self.parameter_group_log is not None:
            self.parameter_group_log(model)
        super().optimizer_step(optimizer, model, update_num)

    def build_model(self, cfg, from_checkpoint=False):
        # sentence_prediction sizes the model's positions to the task's max_positions; a model that
        # reads in chunks (--chunk-length) keeps its own, and the task reads longer documents
        if not getattr(cfg, "chunk_length", 0):
            return super().build_model(cfg, from_checkpoint)
        from fairseq import models

        model = models.build_model(cfg, self, from_checkpoint)
        model.register_classification_head(self.cfg.classification_head_name, num_classes=self.cfg.num_classes)
        return model

    def load_dataset(self, split, combine=False, **kwargs):
        assert self.cfg.shorten_method == "none", (
            f"long_sentence_prediction cuts documents by --truncation; got --shorten-method "
            f"{self.cfg.shorten_method} as well"
        )
        # The parent builds <s> + input (+ input1) and then calls maybe_shorten_dataset, the one
        # place a length limit applies; taking that name over for the call keeps the rest of its
        # pipeline (padding, labels, regression targets) as fairseq has it, unforked.
        parent = sys.modules[SentencePredictionTask.__module__]
        with _SHORTEN_NAME:
            shorten = parent.maybe_shorten_dataset
            parent.maybe_shorten_dataset = lambda dataset, *_: self.fit(dataset, split)
            try:
                return super().load_dataset(split, combine, **kwargs)
            finally:
                parent.maybe_shorten_dataset = shorten

    def fit(self, dataset, split):
        n = self.max_positions()
        if self.cfg.truncation != "none":
            keep_first = int(self.cfg.init_token is not None)
            return TruncatedDataset(dataset, n, self.cfg.truncation, self.cfg.truncation_head_tokens, keep_first)
        longest = int(np.argmax(dataset.sizes)) if len(dataset) else 0
        if len(dataset) and dataset.sizes[longest] > n:
            count = int((dataset.sizes > n).sum())
            raise ValueError(
                f"{split}: document {longest} is {dataset.sizes[longest]} tokens long (with its special "
                f"tokens), longer than max_positions {n}, and {count} document(s) in all are longer; "
                f"choose --truncation head, tail or head_tail, or extend the model "
                f"(scripts/extend_max_positions.py)"
            )
        return dataset
