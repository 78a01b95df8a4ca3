"""Shared test fixtures. Everything here runs on the bundled sample (data/sample), never on
../shared, so a fresh clone can run the tests."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"


def run(cmd, cwd=None, timeout=600):
    """Run a command, failing the test with its output when it exits non-zero."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="session")
def wikitext_bin(tmp_path_factory) -> Path:
    """A fairseq data-bin (dict.txt, train.*, valid.*) of the bundled WikiText-2 sample,
    binarized word-level with a 5000-word dictionary (the rest maps to <unk>)."""
    out = tmp_path_factory.mktemp("wikitext_bin")
    wt = SAMPLE / "wikitext-2"
    run([
        sys.executable, "-m", "fairseq_cli.preprocess", "--only-source",
        "--trainpref", wt / "wiki.train.tokens", "--validpref", wt / "wiki.valid.tokens",
        "--destdir", out, "--nwordssrc", "5000", "--workers", "1",
    ])
    return out
