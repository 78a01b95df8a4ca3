from . import imported_roberta, linformer_roberta  # noqa: F401
