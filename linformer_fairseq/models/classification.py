"""What a classification head reads: fairseq's RoBERTa reads the final state of <s>; a sentence
encoder such as all-MiniLM-L6-v2 was trained to give its meaning as the mean of its final states.
A Linformer distilled from one keeps that mean close to the teacher's (every token is distilled)
while <s>, one position among thousands, drifts: on long documents a linear probe of its <s>
scores well below a probe of its mean (docs/long_documents.md)."""

import torch.nn.functional as F
from fairseq.models.roberta.hub_interface import RobertaHubInterface
from torch import Tensor

POOLER_TOKENS = ("first", "mean")
POOLER_TOKENS_HELP = (
    "the final states the classification head reads: first, <s>'s (fairseq's RoBERTa); mean, the mean over the "
    "document's tokens (what sentence encoders such as all-MiniLM-L6-v2 were trained to give)"
)


def mean_over_tokens(x: Tensor, real: Tensor) -> Tensor:
    """x: ``B x T x C`` final states; real: ``B x T``, False at pads. Returns ``B x 1 x C``, the
    mean of each document's states in the place of <s>, where fairseq's head reads."""
    real = real.unsqueeze(-1).to(x)
    return (x * real).sum(1, keepdim=True) / real.sum(1, keepdim=True)


class PoolerTokens:
    """RobertaModel with ``--pooler-tokens``: its classification heads read what it says, in
    training (the forward) and through the hub (``from_pretrained``'s ``predict``)."""

    def pool(self, x: Tensor, src_tokens: Tensor) -> Tensor:
        """x: ``B x T x C`` final states. Returns what the head reads at position 0."""
        if getattr(self.args, "pooler_tokens", "first") == "mean":
            return mean_over_tokens(x, src_tokens.ne(self.encoder.dictionary.pad()))
        return x

    def forward(self, src_tokens, features_only=False, return_all_hiddens=False, classification_head_name=None,
                **kwargs):  # fmt: skip
        if classification_head_name is None:
            return super().forward(src_tokens, features_only, return_all_hiddens, **kwargs)
        x, extra = self.encoder(src_tokens, True, return_all_hiddens, **kwargs)
        return self.classification_heads[classification_head_name](self.pool(x, src_tokens)), extra

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
        tokens = tokens.unsqueeze(0) if tokens.dim() == 1 else tokens
        features = self.extract_features(tokens.to(device=self.device))
        pool = getattr(self.model, "pool", lambda x, _: x)  # a plain RoBERTa loaded through this class
        logits = self.model.classification_heads[head](pool(features, tokens.to(device=self.device)))
        return logits if return_logits else F.log_softmax(logits, dim=-1)
