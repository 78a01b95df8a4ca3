from . import linformer_roberta  # noqa: F401
