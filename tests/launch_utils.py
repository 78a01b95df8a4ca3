"""What tests/test_launchers.py, tests/test_distributed.py and tests/test_slurm.py share: a
tiny model for CPU runs of the real configs, a tiny SST-2 data-bin, and reading fairseq's json
log."""
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
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


def sst2_bin(root: Path, wikitext_bin: Path) -> Path:
    """The bundled SST-2 sample (320 train, 200 dev sentences) as a sentence_prediction
    data-bin in ROOT, words mapped with the pretraining dictionary."""
    from fairseq.data import Dictionary, indexed_dataset

    words, labels = Dictionary.load(str(wikitext_bin / "dict.txt")), Dictionary()
    for label in "01":
        labels.add_symbol(label)
    for split, name, rows in (("train", "train.tsv", 320), ("valid", "dev.tsv", 200)):
        lines = (REPO / "data" / "sample" / "glue" / "SST-2" / name).read_text().splitlines()[1:rows + 1]
        columns = list(zip(*(line.rsplit("\t", 1) for line in lines)))
        for folder, dictionary, texts in (("input0", words, columns[0]), ("label", labels, columns[1])):
            (root / folder).mkdir(parents=True, exist_ok=True)
            dictionary.save(str(root / folder / "dict.txt"))
            out = indexed_dataset.make_builder(str(root / folder / f"{split}.bin"), impl="mmap", vocab_size=len(dictionary))
            for text in texts:
                out.add_item(dictionary.encode_line(text, add_if_not_exist=False).long())
            out.finalize(str(root / folder / f"{split}.idx"))
    return root
