"""Shared plumbing: clear errors, atomic outputs, progress, resumable downloads, subprocesses."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path


class PrepError(Exception):
    """Bad input or a failed step; the message names the file (and line) at fault."""


def fail(path, line, message):
    where = f"{path}:{line}" if line else str(path)
    raise PrepError(f"{where}: {message}")


def log(message):
    print(message, file=sys.stderr, flush=True)


def cli(main):
    """Run main(); turn PrepError into one 'error: ...' line and exit status 1."""
    try:
        main()
    except PrepError as e:
        log(f"error: {e}")
        sys.exit(1)


def parser(description):
    return argparse.ArgumentParser(
        prog=os.environ.get("DATAPREP_PROG"),  # the *.sh wrapper's name
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def require_file(path, what="input file"):
    path = Path(path)
    if not path.is_file():
        fail(path, None, f"{what} not found")
    return path


def read_lines(path):
    """Yield (line number, line without its end of line) of a UTF-8 text file.

    Lines are split on LF only (a CR inside a TSV field must not split a row) and decoded one
    by one, so an encoding error names its line.
    """
    path = require_file(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                fail(path, lineno, f"not valid UTF-8 ({e.reason} at byte {e.start})")
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # MRPC's files start with a BOM
            yield lineno, line.rstrip("\r\n")


def remove(path):
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def finished(path, what):
    """True (and says so) if a previous run already produced `path`."""
    if Path(path).exists():
        log(f"skip {what}: {path} exists")
        return True
    return False


@contextmanager
def atomic(final):
    """Yield a hidden temporary sibling of `final` (a file or a folder) and rename it onto
    `final` only when the block completes: a killed or failed step never leaves something
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


class Progress:
    """Counts work and reports it on stderr at most every `every` seconds."""

    def __init__(self, label, unit="lines", every=10.0):
        self.label, self.unit, self.every = label, unit, every
        self.count = 0
        self.start = self.last = time.time()

    def update(self, n=1):
        self.count += n
        now = time.time()
        if now - self.last >= self.every:
            self.last = now
            self.report()

    def report(self, done=False):
        elapsed = time.time() - self.start
        log(f"{self.label}: {self.count:,} {self.unit}{' done' if done else ''} ({elapsed:.0f} s)")

    def close(self):
        self.report(done=True)


def download(url, dest, chunk_size=1 << 20):
    """Fetch `url` to `dest`, resuming a previous partial download with an HTTP Range request.

    The bytes go to `dest`.part and are renamed to `dest` once the server's full length arrived.
    """
    dest = Path(dest)
    if finished(dest, "download"):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    log(f"downloading {url} -> {dest}" + (f" (resuming at {have:,} bytes)" if have else ""))
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            if have and response.status != 206:  # server ignored the range: start over
                have = 0
            total = _total_length(response, have)
            progress = Progress(f"  {dest.name}", unit="MB")
            with open(part, "ab" if have else "wb") as out:
                while block := response.read(chunk_size):
                    out.write(block)
                    progress.update(len(block) / 1e6)
    except urllib.error.HTTPError as e:
        if e.code != 416 or not have:  # 416: nothing left after `have` bytes, i.e. complete
            raise PrepError(f"{url}: HTTP {e.code} {e.reason}") from e
        total = have
    except (urllib.error.URLError, OSError) as e:
        raise PrepError(f"{url}: download interrupted ({e}); run again to resume") from e
    size = part.stat().st_size
    if total is not None and size != total:
        raise PrepError(f"{url}: got {size:,} of {total:,} bytes; run again to resume")
    os.replace(part, dest)
    return dest


def _total_length(response, have):
    content_range = response.headers.get("Content-Range")  # "bytes 100-199/200"
    if content_range and "/" in content_range and not content_range.endswith("*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) + have if length is not None else None


def local_or_download(source, download_dir):
    """`source` is a local path or an http(s)/ftp URL; return a local path."""
    if "://" not in str(source):
        return require_file(source)
    name = str(source).split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return download(source, Path(download_dir) / name)


def run(cmd, what):
    """Run a subprocess quietly; on failure show its output tail and name the step."""
    result = subprocess.run(
        [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-20:])
        raise PrepError(f"{what} failed (exit {result.returncode}):\n{tail}")
    return result.stdout


def preprocess_argv(srcdict, destdir, workers, trainpref=None, validpref=None, testpref=None):
    """Arguments of `fairseq-preprocess --only-source --srcdict` for one output folder."""
    argv = ["--only-source", "--srcdict", srcdict, "--destdir", destdir, "--workers", workers]
    for flag, pref in (("--trainpref", trainpref), ("--validpref", validpref),
                       ("--testpref", testpref)):
        if pref:
            argv += [flag, pref]
    return [str(a) for a in argv]


# fairseq-preprocess's own main() for several folders in one process: importing fairseq
# takes seconds, more than binarizing a small GLUE task.
_PREPROCESS_MANY = """
import json, sys
from fairseq import options
from fairseq_cli import preprocess
for argv in json.loads(sys.argv[1]):
    preprocess.main(options.get_preprocessing_parser().parse_args(argv))
    for handler in preprocess.logger.handlers[:]:  # main() adds a log file per destdir
        preprocess.logger.removeHandler(handler)
        handler.close()
"""


def fairseq_preprocess(*argvs):
    """Run fairseq-preprocess once per argv (see preprocess_argv); log its per-file summary."""
    destdirs = ", ".join(argv[argv.index("--destdir") + 1] for argv in argvs)
    output = run([sys.executable, "-c", _PREPROCESS_MANY, json.dumps(list(argvs))],
                 f"fairseq-preprocess into {destdirs}")
    for line in output.splitlines():
        if "replaced" in line:  # "[None] FILE: N sents, M tokens, X% replaced (by <unk>)"
            log("  " + line.split("| ")[-1])


def default_workers():
    return max(1, min(os.cpu_count() or 1, 8))
