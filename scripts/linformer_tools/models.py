"""Models outside fairseq-train, for the benchmark, the spectrum analysis and the tests: built
as fairseq-train builds them, with the plugin registered."""

import logging
import os
from pathlib import Path

from .common import PLUGIN_DIR, atomic

# fairseq's Dictionary puts <s>, <pad>, </s>, <unk> first; ids from here on are real words
FIRST_WORD_ID = 4


def import_fairseq():
    """Import fairseq and undo what its import does to logging: one of its modules sets the
    root logger to DEBUG, which would flood the output (matplotlib logs every font lookup)."""
    import fairseq  # noqa: F401

    logging.getLogger().setLevel(logging.WARNING)


def import_plugin():
    """Register the Linformer models (and the plugin's safe-loading allow-list)."""
    from argparse import Namespace

    from fairseq import utils

    utils.import_user_module(Namespace(user_dir=str(PLUGIN_DIR)))


def write_dict(directory, words):
    """Write a fairseq dict.txt listing ``words`` (the special symbols are implicit)."""
    with open(os.path.join(directory, "dict.txt"), "w") as f:
        f.writelines(f"{w} 1\n" for w in words)


def build_model(arch: str, model_flags, data_dir, user_dir=PLUGIN_DIR):
    """Build ``arch`` exactly as fairseq-train would: parse ``model_flags`` with fairseq's
    training parser (``user_dir`` loaded through --user-dir: this plugin, or another, such as
    fairseq's original Linformer example), set up the masked_lm task on ``data_dir`` (which
    holds dict.txt) and call ``task.build_model``.

    Returns (model, cfg); the weights are fairseq's random initialisation.
    """
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    argv = [str(data_dir), "--task", "masked_lm", "--user-dir", str(user_dir), "--arch", arch, *model_flags]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    return task.build_model(cfg.model), cfg


def force_explicit_attention(model) -> int:
    """Send every fairseq MultiheadAttention of ``model`` down its own bmm + softmax path.

    Its forward hands the work to ``F.multi_head_attention_forward`` (PyTorch's fused
    scaled-dot-product kernel when no weights are asked for, and weights averaged over heads
    when they are) unless ``skip_embed_dim_check`` is set; ``_set_skip_embed_dim_check`` is
    fairseq's own switch for that (used for pruned heads) and changes nothing else. The
    explicit path stores the n x n attention matrix per head, as fairseq did in 2020, and
    honours ``need_head_weights``. Returns the number of modules switched.
    """
    from fairseq.modules import MultiheadAttention

    switched = [m for m in model.modules() if type(m) is MultiheadAttention]
    for m in switched:
        m._set_skip_embed_dim_check()
    return len(switched)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq sets the root logger to DEBUG
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path):
    with atomic(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip("."), dpi=120)
