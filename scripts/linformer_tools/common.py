"""Paths, failing on bad input, and writing outputs whole."""
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "linformer_fairseq"
CONFIGS = REPO / "configs"
SAMPLE = REPO / "data" / "sample"

BAD_INPUT = 2  # the exit status of argparse and the bash launchers on bad input


def fail(message: str):
    """Stop with one 'error: ...' line on stderr and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(BAD_INPUT)


def remove(path):
    """Delete a file, link or folder if it exists."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic(final):
    """Yield a hidden temporary sibling of ``final`` (a file or a folder to create) and rename it
    onto ``final`` only when the block completes: a killed or failed step never leaves something
    under the final name, so a later run can trust that a present output is complete."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.partial")
    remove(tmp)  # left over by a killed run
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    os.replace(tmp, final)


def write_text(path, text: str):
    with atomic(path) as tmp:
        tmp.write_text(text)
