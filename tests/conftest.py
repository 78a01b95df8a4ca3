"""What the tests share: running commands, tiny data-bins of the bundled sample (data/sample,
never ../shared, so a fresh clone runs the tests), and the tiny model the launcher, distributed
and Slurm tests train with the real configs. Test modules import the constants from here.

The tests of a script's or a study's functions import it by its name (``import linearize``,
``from long_documents import runs``): pyproject.toml's pytest ``pythonpath`` puts scripts/ and
studies/ on sys.path, as running the script puts its own folder there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from linformer_tools.common import REPO, SAMPLE

SCRIPTS = REPO / "scripts"
STUDIES = REPO / "studies"
CONFIG = "linformer_n512_k128_kv"
# hydra overrides that shrink a pretraining config to seconds per run on a CPU
TINY = [
    "model.encoder_layers=2",
    "model.encoder_embed_dim=32",
    "model.encoder_ffn_embed_dim=64",
    "model.encoder_attention_heads=2",
    "task.tokens_per_sample=32",
    "model.compressed_dim=8",
    "lr_scheduler.warmup_updates=4",
    "common.log_interval=1",
    "dataset.num_workers=0",
]
# one thread per run: the runs share two cores, and the distributed test runs three at once
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)


def pytest_configure(config):
    """Under pytest-xdist's -n, each worker (its torch and the runs it starts) takes its share of
    the cores: two workers whose runs each spread over all cores ran the quickstart 3x slower.
    The controller hands out files in the order pytest_collection_modifyitems gives, not by
    their number of tests (xdist's default, which sent the longest file out last)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first, the longest first (``pytest.mark.slow(minutes=M)``, the
    minutes a file takes under -n 2; 1 when not said), each file's tests together (its module
    fixtures are built once): under -n --dist loadfile the workers take files in this order, and
    a long file taken last would run alone at the end."""
    minutes = {}
    for item in items:
        for marker in item.iter_markers("slow"):
            minutes[item.path] = max(minutes.get(item.path, 0), marker.kwargs.get("minutes", 1))
    items.sort(key=lambda item: -minutes.get(item.path, 0))


def call_main(module, *argv):
    """A script's main(argv) in this process: its exit status (0 when it returns)."""
    try:
        module.main([str(a) for a in argv])
    except SystemExit as e:
        return e.code
    return 0


def error_line(capsys):
    """The one 'error: ...' line a script printed on stderr."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def run(cmd, cwd=None, timeout=600):
    """Run a command, failing the test with its output when it exits non-zero."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


@pytest.fixture(scope="session")
def wikitext_bin(tmp_path_factory) -> Path:
    """A fairseq data-bin (dict.txt, train.*, valid.*) of the bundled WikiText-2 sample,
    binarized word-level with a 5000-word dictionary (the rest maps to <unk>)."""
    out = tmp_path_factory.mktemp("wikitext_bin")
    wt = SAMPLE / "wikitext-2"
    run(
        [
            sys.executable,
            "-m",
            "fairseq_cli.preprocess",
            "--only-source",
            "--trainpref",
            wt / "wiki.train.tokens",
            "--validpref",
            wt / "wiki.valid.tokens",
            "--destdir",
            out,
            "--nwordssrc",
            "5000",
            "--workers",
            "1",
        ]
    )
    return out


def build_sst2_bin(root: Path, wikitext_bin: Path) -> Path:
    """The bundled SST-2 sample (320 train, 200 dev sentences) as a sentence_prediction
    data-bin in ROOT, words mapped with the pretraining dictionary."""
    from fairseq.data import Dictionary, indexed_dataset

    words, labels = Dictionary.load(str(wikitext_bin / "dict.txt")), Dictionary()
    for label in "01":
        labels.add_symbol(label)
    for split, name, rows in (("train", "train.tsv", 320), ("valid", "dev.tsv", 200)):
        lines = (SAMPLE / "glue" / "SST-2" / name).read_text().splitlines()[1 : rows + 1]
        columns = list(zip(*(line.rsplit("\t", 1) for line in lines)))
        for folder, dictionary, texts in (("input0", words, columns[0]), ("label", labels, columns[1])):
            (root / folder).mkdir(parents=True, exist_ok=True)
            dictionary.save(str(root / folder / "dict.txt"))
            out = indexed_dataset.make_builder(
                str(root / folder / f"{split}.bin"), impl="mmap", vocab_size=len(dictionary)
            )
            for text in texts:
                out.add_item(dictionary.encode_line(text, add_if_not_exist=False).long())
            out.finalize(str(root / folder / f"{split}.idx"))
    return root
