"""CI's resolver guard: for every pyenv Python that setup.py's python_requires claims, pip's
resolver must find a complete install (a dry run: wheel metadata only, nothing built).

fairseq-fixed is a source distribution whose metadata needs torch to build, so it is replaced
by its own requirements (read from the installed copy), and a release of it that the Python
may install must exist. Pythons are checked in parallel; the exit status is 1 if any fails.
"""

import importlib.metadata as md
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

TORCH = "torch==2.13.0"  # README: Install
REPO = Path(__file__).resolve().parents[1]


def our_requirements(scratch: Path):
    """(requirements with fairseq-fixed's own in its place, the fairseq-fixed requirement, Requires-Python)."""
    subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", scratch],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    ours = md.PathDistribution(scratch / "linformer_fairseq.egg-info")
    fixed_deps = [r for r in md.requires("fairseq-fixed") if "extra ==" not in r]
    reqs, fixed = [], None
    for line in ours.requires:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        if req.name != "fairseq-fixed":
            reqs.append(line)
            continue
        fixed = req
        reqs += [f"{dep}; {req.marker}" if req.marker else dep for dep in fixed_deps]
    return reqs + [TORCH], fixed, ours.metadata["Requires-Python"]


def resolve(python: Path, version: str, reqs, fixed, scratch: Path):
    """(ok, report) for one Python."""
    env = scratch / version
    subprocess.run([python, "-m", "venv", "--without-pip", env], check=True)
    pip = ["pip", "--python", str(env / "bin" / "python")]
    dry = subprocess.run(
        [*pip, "install", "--dry-run", "--ignore-installed", "--prefer-binary", *reqs], capture_output=True, text=True
    )
    if dry.returncode:
        return False, dry.stdout[-3000:] + dry.stderr[-3000:]
    report = " ".join(
        w
        for line in dry.stdout.splitlines()
        if line.startswith("Would install")
        for w in line.split()
        if w.startswith(("torch-", "omegaconf-", "numpy-"))
    )
    env_markers = {"python_version": ".".join(version.split(".")[:2]), "python_full_version": version}
    if fixed is not None and (fixed.marker is None or fixed.marker.evaluate(env_markers)):
        index = subprocess.run([*pip, "index", "versions", "fairseq-fixed"], capture_output=True, text=True).stdout
        available = [
            v.strip()
            for line in index.splitlines()
            if line.startswith("Available versions:")
            for v in line.split(":", 1)[1].split(",")
        ]
        if not any(fixed.specifier.contains(v) for v in available):
            return False, f"no release of {fixed} for Python {version} (available: {', '.join(available) or 'none'})"
    return True, report


def main():
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        reqs, fixed, claimed = our_requirements(scratch)
        root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
        pythons = {}
        for python in sorted(root.glob("3.*/bin/python")):
            version = subprocess.run(
                [python, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True
            ).stdout.strip()
            if version in SpecifierSet(claimed):
                pythons[version] = python
        if not pythons:
            print(f"WARNING: no claimed Python under {root}: nothing checked")
        with ThreadPoolExecutor(len(pythons) or 1) as pool:
            results = pool.map(lambda v: (v, *resolve(pythons[v], v, reqs, fixed, scratch)), pythons)
            failed = 0
            for version, ok, report in results:
                if ok:
                    print(f"Python {version}: {report}")
                else:
                    print(
                        f"{report}\nFAIL: Python {version} is claimed by python_requires {claimed}, "
                        "but the install does not resolve on it"
                    )
                    failed = 1
    print(f"resolver guard: {len(pythons)} Python(s) in {time.time() - start:.0f} s")
    return failed


if __name__ == "__main__":
    sys.exit(main())
