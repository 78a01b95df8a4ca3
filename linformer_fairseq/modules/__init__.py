from importlib.util import find_spec

from .linformer_attention import (
    COMPRESS_SHARING,
    COMPRESS_TYPES,
    LinformerMultiheadAttention,
    LinformerSettings,
    SequenceProjection,
)

__all__ = [
    "COMPRESS_SHARING",
    "COMPRESS_TYPES",
    "LinformerMultiheadAttention",
    "LinformerSettings",
    "SequenceProjection",
]

# the encoder builds on fairseq's; the attention needs torch alone (scripts/benchmark_attention.py
# imports it on a GPU node without fairseq)
if find_spec("fairseq") is not None:
    from .linformer_encoder import LinformerEncoderLayer, LinformerTransformerEncoder

    __all__ += ["LinformerEncoderLayer", "LinformerTransformerEncoder"]
