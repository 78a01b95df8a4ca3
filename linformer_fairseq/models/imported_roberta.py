"""A RoBERTa imported from Hugging Face transformers (scripts/import_hf.py): fairseq's RoBERTa
with the one thing fairseq does not let a config set, the layer norms' epsilon (BERTs use 1e-12,
fairseq 1e-5; at the small activations of some models that changes the outputs)."""

from fairseq.models import register_model, register_model_architecture
from fairseq.models.roberta import RobertaModel
from fairseq.models.roberta.model import base_architecture as roberta_base_architecture
from torch import nn

from .classification import CHUNK_LENGTH_HELP, POOLER_TOKENS, POOLER_TOKENS_HELP, PoolerTokens

FAIRSEQ_LAYERNORM_EPS = 1e-5  # torch's default, which fairseq's LayerNorm() never changes


def set_layernorm_eps(model: nn.Module, eps: float):
    """Every layer norm of ``model`` (torch's, or apex's fused one on GPUs) uses ``eps``."""
    for module in model.modules():
        if hasattr(module, "normalized_shape") and hasattr(module, "eps"):
            module.eps = eps


@register_model("roberta_imported")
class ImportedRobertaModel(PoolerTokens, RobertaModel):
    @staticmethod
    def add_args(parser):
        RobertaModel.add_args(parser)
        parser.add_argument(
            "--layernorm-eps", type=float, metavar="EPS", help="epsilon of every layer norm (default: 1e-5)"
        )
        parser.add_argument("--pooler-tokens", choices=POOLER_TOKENS, help=POOLER_TOKENS_HELP + " (default: first)")
        parser.add_argument("--chunk-length", type=int, metavar="N", help=CHUNK_LENGTH_HELP + " (default: 0)")

    @classmethod
    def build_model(cls, args, task):
        model = super().build_model(args, task)
        set_layernorm_eps(model, getattr(args, "layernorm_eps", FAIRSEQ_LAYERNORM_EPS))
        return model


@register_model_architecture("roberta_imported", "roberta_imported")
def imported_roberta_architecture(args):
    args.layernorm_eps = getattr(args, "layernorm_eps", FAIRSEQ_LAYERNORM_EPS)
    args.pooler_tokens = getattr(args, "pooler_tokens", None) or "first"
    args.chunk_length = getattr(args, "chunk_length", None) or 0
    roberta_base_architecture(args)
