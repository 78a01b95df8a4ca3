"""Paths, failing on bad input, and writing outputs whole."""

import csv
import io
import os
import platform
import shutil
import sys
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "linformer_fairseq"
CONFIGS = REPO / "configs"
SAMPLE = REPO / "data" / "sample"
SCRIPTS_DIR = REPO / "scripts"

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


def cell(value) -> str:
    """A table cell: '-' for no value, floats to one decimal."""
    return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)


def markdown_table(rows, leave_out=()) -> str:
    """Markdown of dict rows, without the columns in ``leave_out`` or without any value."""
    if not rows:
        return "(none)\n"
    header = [h for h in rows[0] if h not in leave_out and any(r[h] is not None for r in rows)]
    lines = [header, ["---" if h in ("model", "run", "status", "note") else "---:" for h in header]]
    lines += [[cell(r[h]) for h in header] for r in rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def write_csv(path, rows, fields):
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buf.getvalue())


def machine(device: str = "cpu") -> dict:
    """What a measurement ran on: hardware, versions, date (without importing fairseq, seconds to load)."""
    import torch

    cpus = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    cpu = f"{(cpus or [platform.machine()])[0]}, {os.cpu_count()} logical CPUs"
    return dict(
        hardware=torch.cuda.get_device_name(0) if device == "cuda" else cpu,
        torch=torch.__version__,
        fairseq=metadata.version(metadata.packages_distributions().get("fairseq", ["fairseq"])[0]),
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
