"""The fairseq-train flags that every run of the scripts and tests shares, in one place so that
the warm-start continuation, the quality study and the tests train with the same recipe. No
fairseq import: the drivers that only build command lines stay quick to start."""

from .common import PLUGIN_DIR


def shared_flags(cpu: bool = False, weight_decay: float = 0.01) -> list:
    """The plugin, RoBERTa's optimizer (Adam, betas (0.9, 0.98), eps 1e-6, weight decay 0.01
    unless ``weight_decay`` says otherwise) and polynomial-decay schedule, data loading in the
    main process, plain-text logs; with ``cpu``, --cpu. Each run adds its own lr, warmup,
    updates, batch, seed and log interval."""
    return [
        "--user-dir", str(PLUGIN_DIR),
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6", "--weight-decay", str(weight_decay),
        "--lr-scheduler", "polynomial_decay",
        # no prefetch thread: fairseq's, still running at interpreter exit, can abort the process
        "--num-workers", "0", "--data-buffer-size", "0",
        "--log-format", "simple",
        *(["--cpu"] if cpu else []),
    ]  # fmt: skip
