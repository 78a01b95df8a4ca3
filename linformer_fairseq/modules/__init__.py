from .linformer_attention import COMPRESS_SHARING, COMPRESS_TYPES, LinformerMultiheadAttention, SequenceProjection
from .linformer_encoder import LinformerEncoderLayer, LinformerTransformerEncoder

__all__ = [
    "COMPRESS_SHARING",
    "COMPRESS_TYPES",
    "LinformerEncoderLayer",
    "LinformerMultiheadAttention",
    "LinformerTransformerEncoder",
    "SequenceProjection",
]
