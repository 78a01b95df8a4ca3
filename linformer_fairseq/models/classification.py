"""What a classification head reads: fairseq's RoBERTa reads the final state of <s>; a sentence
encoder such as all-MiniLM-L6-v2 was trained to give its meaning as the mean of its final states.
A Linformer distilled from one keeps that mean close to the teacher's (every token is distilled)
while <s>, one position among thousands, drifts: on long documents a linear probe of its <s>
scores well below a probe of its mean (docs/long_documents.md)."""

import sys

import torch.nn.functional as F
from fairseq.models.roberta.hub_interface import RobertaHubInterface
from torch import Tensor

POOLER_TOKENS = ("first", "mean")
POOLER_TOKENS_HELP = (
    "the final states the classification head reads: first, <s>'s (fairseq's RoBERTa); mean, the mean over the "
    "document's tokens (what sentence encoders such as all-MiniLM-L6-v2 were trained to give)"
)
CHUNK_LENGTH_HELP = (
    "documents longer than N tokens are read as consecutive chunks of N tokens, each through the encoder on its "
    "own, positions restarting; the classification head reads the mean of all chunks' final states over the "
    "document's tokens (needs --pooler-tokens mean); 0: off"
)


def mean_over_tokens(x: Tensor, real: Tensor) -> Tensor:
    """x: ``B x T x C`` final states; real: ``B x T``, False at pads. Returns ``B x 1 x C``, the
    mean of each document's states in the place of <s>, where fairseq's head reads."""
    real = real.unsqueeze(-1).to(x)
    return (x * real).sum(1, keepdim=True) / real.sum(1, keepdim=True)


def check_chunk_length(args):
    """Refuses a ``--chunk-length`` the model cannot read, when the model is built."""
    n, pooler = getattr(args, "chunk_length", 0) or 0, getattr(args, "pooler_tokens", "first")
    if n <= 0:
        return
    # with <s>'s state the head would read the first chunk only: the other chunks would be encoded for nothing
    if pooler != "mean":
        raise ValueError(f"--chunk-length {n} needs --pooler-tokens mean (got --pooler-tokens {pooler})")
    if n > args.max_positions:
        raise ValueError(f"--chunk-length {n} exceeds the encoder's --max-positions {args.max_positions}")


class PoolerTokens:
    """RobertaModel with ``--pooler-tokens``: its classification heads read what it says, in
    training (the forward) and through the hub (``from_pretrained``'s ``predict``); with
    ``--chunk-length`` they read documents longer than the encoder, chunk by chunk."""

    def __init__(self, args, encoder):
        super().__init__(args, encoder)
        check_chunk_length(args)

    @property
    def chunk_length(self) -> int:
        return getattr(self.args, "chunk_length", 0) or 0  # checkpoints from before the option lack it

    def max_positions(self):
        # fairseq drops (or refuses) training documents longer than this; chunked, any length is read,
        # and the task's max_positions alone says how much of a document
        return sys.maxsize if self.chunk_length > 0 else super().max_positions()

    def pool(self, x: Tensor, src_tokens: Tensor) -> Tensor:
        """x: ``B x T x C`` final states. Returns what the head reads at position 0."""
        if getattr(self.args, "pooler_tokens", "first") == "mean":
            return mean_over_tokens(x, src_tokens.ne(self.encoder.dictionary.pad()))
        return x

    def forward(self, src_tokens, features_only=False, return_all_hiddens=False, classification_head_name=None,
                **kwargs):  # fmt: skip
        """With a head: its logits ``B x classes``, and the encoder's extra (see ``head_input``)."""
        if classification_head_name is None:
            return super().forward(src_tokens, features_only, return_all_hiddens, **kwargs)
        x, extra = self.head_input(src_tokens, return_all_hiddens, **kwargs)
        return self.classification_heads[classification_head_name](x), extra

    def head_input(self, src_tokens: Tensor, return_all_hiddens=False, **kwargs):
        """src_tokens: ``B x T``, right-padded. Returns what the classification heads read at position 0
        (``B x 1 x C`` pooled; ``B x T x C`` with --pooler-tokens first) and the encoder's extra (chunked:
        over the chunks read, see ``read_chunks``)."""
        if 0 < self.chunk_length < src_tokens.size(1):
            return self.read_chunks(src_tokens, return_all_hiddens, **kwargs)
        x, extra = self.encoder(src_tokens, True, return_all_hiddens, **kwargs)
        return self.pool(x, src_tokens), extra

    def read_chunks(self, src_tokens: Tensor, return_all_hiddens=False, **kwargs):
        """src_tokens: ``B x T``, right-padded. Cut into ``B*m`` chunks of ``L = chunk_length`` tokens,
        each encoded on its own. Returns the mean of each document's final states over its tokens in
        all its chunks, ``B x 1 x C``, and the encoder's extra over the chunks that hold tokens
        (``B' x L``: inner states ``L x B' x C``)."""
        pad, length = self.encoder.dictionary.pad(), self.chunk_length
        chunks = F.pad(src_tokens, (0, -src_tokens.size(1) % length), value=pad).reshape(-1, length)
        real = chunks.ne(pad)
        # a chunk of pads alone has every key masked: NaN where an attention's softmax runs over nothing (a NaN
        # times a 0 weight stays NaN), an error in the Linformer (which takes it for left padding)
        read = real.any(1)
        x, extra = self.encoder(chunks[read], True, return_all_hiddens, **kwargs)
        states = x.new_zeros(chunks.shape + x.shape[-1:]).index_put((read,), x)
        batch = src_tokens.size(0)
        return mean_over_tokens(states.view(batch, -1, x.size(-1)), real.view(batch, -1)), extra

    @classmethod
    def from_pretrained(cls, model_name_or_path, checkpoint_file="model.pt", data_name_or_path=".", bpe="gpt2",
                        **kwargs):  # fmt: skip
        """RobertaModel.from_pretrained, with a hub whose ``predict`` pools as the model does."""
        from fairseq import hub_utils

        x = hub_utils.from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, bpe=bpe,
                                      archive_map=cls.hub_models(), load_checkpoint_heads=True, **kwargs)  # fmt: skip
        return PooledHubInterface(x["args"], x["task"], x["models"][0])


class PooledHubInterface(RobertaHubInterface):
    """fairseq's RoBERTa hub, whose ``predict`` gives its head what ``--pooler-tokens`` says
    (fairseq's hands the head the states and lets it read <s>)."""

    def predict(self, head: str, tokens: Tensor, return_logits: bool = False) -> Tensor:
        """tokens: ``T`` or ``B x T`` (right-padded). The logits (or log-probabilities) ``B x classes``
        of the model's forward with the head: pooled, and chunked, as in training."""
        tokens = (tokens.unsqueeze(0) if tokens.dim() == 1 else tokens).to(device=self.device)
        if tokens.size(-1) > self.model.max_positions():  # what fairseq's extract_features refuses
            raise ValueError(f"tokens exceeds maximum length: {tokens.size(-1)} > {self.model.max_positions()}")
        logits, _ = self.model(tokens, classification_head_name=head)
        return logits if return_logits else F.log_softmax(logits, dim=-1)
