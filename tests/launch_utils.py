"""What tests/test_launchers.py and tests/test_distributed.py share: a tiny model for CPU runs
of the real configs, and reading fairseq's json log."""
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "linformer_n512_k128_kv"
# hydra overrides that shrink a pretraining config to seconds per run on a CPU
TINY = ["model.encoder_layers=2", "model.encoder_embed_dim=32", "model.encoder_ffn_embed_dim=64",
        "model.encoder_attention_heads=2", "task.tokens_per_sample=32", "model.compressed_dim=8",
        "lr_scheduler.warmup_updates=4", "common.log_interval=1", "dataset.num_workers=0"]
# one thread per run: the runs share two cores, and the distributed test runs three at once
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)


def records(log: Path, tag: str, start: int = 0, end: int = -1):
    """The json stats fairseq logged under `tag` (train_inner, valid, ...) in bytes [start, end)."""
    if not log.exists():
        return []
    with open(log, "rb") as f:
        f.seek(start)
        lines = f.read(end - start if end >= 0 else -1).decode().splitlines()
    return [json.loads(line[line.index("{"):]) for line in lines if f"][{tag}][" in line]


def losses(stats):
    return {int(s["num_updates"]): float(s["loss"]) for s in stats}
