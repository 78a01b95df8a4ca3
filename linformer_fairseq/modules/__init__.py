from .linformer_attention import (
    COMPRESS_SHARING,
    COMPRESS_TYPES,
    LinformerMultiheadAttention,
    LinformerSettings,
    SequenceProjection,
)
from .linformer_encoder import LinformerEncoderLayer, LinformerTransformerEncoder

__all__ = [
    "COMPRESS_SHARING",
    "COMPRESS_TYPES",
    "LinformerEncoderLayer",
    "LinformerMultiheadAttention",
    "LinformerSettings",
    "LinformerTransformerEncoder",
    "SequenceProjection",
]
