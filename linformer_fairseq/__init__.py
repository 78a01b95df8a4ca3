"""linformer-fairseq: the Linformer (Wang et al. 2020) as a fairseq plugin.

Use as ``fairseq-train --user-dir linformer_fairseq --arch linformer_roberta_base ...``.
Importing registers the ``linformer_roberta`` model and its architectures, the
``roberta_imported`` model (a RoBERTa imported from transformers by scripts/import_hf.py), the
``long_sentence_prediction`` task (documents longer than the model: head / tail / head+tail),
``--bpe hf_tokenizer`` (a tokenizer.json) and ``--optimizer adam_fused`` (fairseq's adam in
PyTorch's fused AdamW kernel).

Without fairseq installed, importing registers nothing: ``linformer_fairseq.modules.linformer_attention``
needs torch alone, and scripts/benchmark_attention.py imports it on a GPU node with a bare PyTorch.
"""

from importlib.util import find_spec

if find_spec("fairseq") is not None:
    from .registration import ImportedRobertaModel, LinformerRobertaModel

    __all__ = ["ImportedRobertaModel", "LinformerRobertaModel"]
