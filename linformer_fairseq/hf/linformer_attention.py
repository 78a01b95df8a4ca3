"""The plugin's attention module under the name the exported model imports it by.

An exported folder holds ``linformer_fairseq/modules/linformer_attention.py`` itself, and the
files it imports, copied byte for byte by ``scripts/export_hf.py``; inside the plugin this module
re-exports it, so ``modeling_linformer.py`` runs the same code in both places.
"""

from ..modules.linformer_attention import (  # noqa: F401
    COMPRESS_INITS,
    COMPRESS_SHARING,
    COMPRESS_TYPES,
    EXACT,
    LENGTH_NORM_POWERS,
    RESAMPLE,
    LinformerMultiheadAttention,
    LinformerSettings,
    SequenceProjection,
    attend,
    projection,
)
