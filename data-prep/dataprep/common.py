"""Shared plumbing: clear errors, atomic outputs and the record of what made them, progress,
resumable and checked downloads, subprocesses."""

import argparse
import hashlib
import http.client
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from linformer_tools.common import atomic as atomic_output
from linformer_tools.common import fail, remove, write_text


class PrepError(Exception):
    """Bad input or a failed step; the message names the file (and line) at fault."""


def bad_input(path, line, message):
    """Raise PrepError naming the file (and line) at fault; cli() turns it into one line."""
    where = f"{path}:{line}" if line else str(path)
    raise PrepError(f"{where}: {message}")


def log(message):
    print(message, file=sys.stderr, flush=True)


def cli(main):
    """Run main(); turn PrepError into one 'error: ...' line and exit status 2."""
    try:
        main()
    except PrepError as e:
        fail(str(e))


def parser(description):
    return argparse.ArgumentParser(
        prog=os.environ.get("DATAPREP_PROG"),  # the *.sh wrapper's name
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )


def require_file(path, what="input file"):
    path = Path(path)
    if not path.is_file():
        bad_input(path, None, f"{what} not found")
    return path


def read_lines(path, encoding="utf-8"):
    """Yield (line number, line without its end of line) of a text file.

    Lines are split on LF only (a CR inside a TSV field must not split a row) and decoded one
    by one, so an encoding error names its line. A legacy 8-bit `encoding` (cp1252, latin-1)
    decodes almost any bytes, so there control characters are what tells binary garbage.
    """
    path = require_file(path)
    utf8 = encoding.replace("_", "-").lower() in ("utf-8", "utf8")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode(encoding)
            except UnicodeDecodeError as e:
                hint = "; for Latin-1/cp1252 books give --books-encoding cp1252 (or auto)"
                bad_input(
                    path,
                    lineno,
                    f"not valid {'UTF-8' if utf8 else encoding} ({e.reason} at byte {e.start}){hint if utf8 else ''}",
                )
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # MRPC's files start with a BOM
            line = line.rstrip("\r\n")
            if not utf8 and (bad := CONTROL.search(line)):
                bad_input(
                    path,
                    lineno,
                    f"not text in {encoding} (control character "
                    f"U+{ord(bad.group()):04X}): wrong --books-encoding, or not a text file",
                )
            yield lineno, line


# C0 and C1 control characters but tab, form feed and the line ends: never in a real book.
CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")


def guess_encoding(path, fallback="cp1252"):
    """'utf-8' if the whole file decodes as UTF-8, else `fallback` (with a note saying so)."""
    try:
        Path(path).read_bytes().decode("utf-8")
        return "utf-8"
    except UnicodeDecodeError:
        log(f"{path}: not UTF-8, read as {fallback}")
        return fallback


def finished(path, what):
    """True (and says so) if `path` exists: for inputs fetched once (a GLUE task folder)."""
    if Path(path).exists():
        log(f"skip {what}: {path} exists")
        return True
    return False


# ---------------------------------------------------------------- what an output was made from

RECORD = "made-from.json"
HASH_LIMIT = 64 << 20  # files up to this size are identified by content, larger ones by mtime


def record_path(output, is_dir):
    """A folder's record is inside it; a file's is its sibling NAME.made-from.json."""
    output = Path(output)
    return output / RECORD if is_dir else output.with_name(f"{output.name}.{RECORD}")


def identity(path):
    """What tells an input apart from another version of it: the content hash of a small file;
    size and mtime of a large one; for a folder, the names and identities of its files (by
    content, so that a copied or re-downloaded folder of small files is still the same input)."""
    path = Path(path)
    if path.is_dir():
        digest = hashlib.sha256()
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.endswith(RECORD))
        for p in files:
            file = _without_path(identity(p))
            digest.update(f"{p.relative_to(path)}\0{json.dumps(file, sort_keys=True)}\n".encode())
        return {"path": str(path), "files": len(files), "digest": digest.hexdigest()}
    st = require_file(path).stat()
    if st.st_size <= HASH_LIMIT:
        return {"path": str(path), "size": st.st_size, "sha256": file_hash(path, "sha256")}
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_hash(path, algorithm):
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _same(a, b):
    """Two identities (or lists of them) match; the path only names the input, so a moved or
    copied input with the same content is still the same."""
    return _without_path(a) == _without_path(b)


def _without_path(x):
    if isinstance(x, list):
        return [_without_path(i) for i in x]
    return {k: v for k, v in x.items() if k != "path"} if isinstance(x, dict) else x


class Recipe:
    """The inputs (paths, or lists of paths) and parameters that an output is made from.

    Saved next to the output when it is complete; a re-run skips the output only if both are
    unchanged and stops otherwise, naming what changed: silently keeping an output made from
    other data (or redoing hours of work by surprise) is worse than asking to delete it.
    """

    def __init__(self, what, inputs=None, **params):
        self.what = what
        self.paths = {k: v for k, v in (inputs or {}).items() if v is not None}
        self.params = json.loads(json.dumps(params, default=str))  # as it reads back
        self._inputs = None

    @property
    def inputs(self):  # computed once, and only when needed (it may hash files)
        if self._inputs is None:
            self._inputs = {
                k: [identity(p) for p in v] if isinstance(v, (list, tuple)) else identity(v)
                for k, v in self.paths.items()
            }
        return self._inputs

    def done(self, output):
        """True (and says so) if `output` exists and was made by this recipe; False if it is
        missing; a PrepError if it exists but was made from something else."""
        output = Path(output)
        self._check_not_an_input(output)
        if not output.exists():
            _ = self.inputs  # identify the inputs now, before the work reads them
            return False
        record = record_path(output, output.is_dir())
        if not record.is_file() and os.environ.get("DATAPREP_ADOPT") == "1":
            # an output made before records existed, vouched for by the user
            self.write(output, output.is_dir())
            log(f"adopted {output}: recorded it as made from the current inputs")
        if not record.is_file():
            bad_input(
                output,
                None,
                f"exists, but with no record of what made it ({record.name}); "
                f"delete it to redo the {self.what}, choose another output, or run with "
                "DATAPREP_ADOPT=1 if you know it was made from these inputs",
            )
        old = json.loads(record.read_text())
        changes = self._changes(old.get("inputs", {}), old.get("params", {}))
        if changes:
            bad_input(
                output,
                None,
                f"made from other inputs or parameters ({'; '.join(changes)}); "
                f"delete it to redo the {self.what}, or choose another output",
            )
        log(f"skip {self.what}: {output} is up to date")
        return True

    def _changes(self, inputs, params):
        changes = [
            f"{k} {params.get(k, 'unset')} -> {self.params.get(k, 'unset')}"
            for k in sorted(set(params) | set(self.params))
            if params.get(k) != self.params.get(k)
        ]
        for k in sorted(set(inputs) | set(self.inputs)):
            if not _same(inputs.get(k), self.inputs.get(k)):
                paths = self.paths.get(k, "(none)")
                shown = " ".join(map(str, paths)) if isinstance(paths, (list, tuple)) else paths
                changes.append(f"{k} {shown} changed")
        return changes

    def _check_not_an_input(self, output):
        out = output.resolve()
        for name, paths in self.paths.items():
            for p in paths if isinstance(paths, (list, tuple)) else [paths]:
                p = Path(p).resolve()
                if p == out:
                    bad_input(output, None, f"the output is also the {name} input; choose another output")
                if out in p.parents:
                    bad_input(output, None, f"the output folder holds the {name} input {p}; choose another output")

    def write(self, output, is_dir, **extra):
        record = record_path(output, is_dir)
        text = json.dumps({"step": self.what, "inputs": self.inputs, "params": self.params, **extra}, indent=2) + "\n"
        write_text(record, text)


@contextmanager
def atomic(final, recipe=None):
    """linformer_tools.common.atomic, saving the `recipe`'s record first (inside a folder,
    beside a file) when one is given."""
    with atomic_output(final) as tmp:
        yield tmp
        if recipe:
            recipe.write(tmp if tmp.is_dir() else final, tmp.is_dir())


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


def download(url, dest, sha1=None, chunk_size=1 << 20):
    """Fetch `url` to `dest`, resuming a previous partial download with an HTTP Range request.

    The bytes go to `dest`.part; `dest`.part.json keeps what the server offered when the part
    began (ETag, Last-Modified, length), and a resumed download whose server now offers
    something else starts over. Once complete, the file is checked against `sha1` if given
    and renamed to `dest`.
    """
    dest = Path(dest)
    recipe = Recipe("download", url=url)
    if recipe.done(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    offer_path = part.with_name(part.name + ".json")
    try:
        offer = _fetch(url, part, offer_path, chunk_size)
    except urllib.error.HTTPError as e:
        raise PrepError(f"{url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise PrepError(f"{url}: download interrupted ({e!r}); run again to resume") from e
    size = part.stat().st_size
    if offer["length"] is not None and size != offer["length"]:
        raise PrepError(f"{url}: got {size:,} of {offer['length']:,} bytes; run again to resume")
    if sha1:
        try:
            check_sha1(part, sha1, url)
        except PrepError:
            remove(part)  # these bytes are wrong: resuming from them cannot help
            remove(offer_path)
            raise
    recipe.write(dest, False, offered=offer, sha1=sha1)
    os.replace(part, dest)
    remove(offer_path)
    return dest


def check_sha1(path, sha1, name=None):
    log(f"checking the sha1 of {path}")
    got = file_hash(path, "sha1")
    if got != sha1.lower():
        bad_input(
            name or path,
            None,
            f"sha1 {got} is not the expected {sha1.lower()}"
            + ("; the download was deleted, run again to fetch it anew" if name else ""),
        )


def _fetch(url, part, offer_path, chunk_size):
    """Append the missing bytes of `url` to `part` (all of them if it changed); return what
    the server offers: {"url", "etag", "last_modified", "length"}."""
    saved = _read_json(offer_path) if part.exists() else None
    have = part.stat().st_size if saved else 0  # a part of unknown origin cannot be trusted
    for _ in range(2):  # a changed file is fetched again from byte 0, once
        headers = {"Range": f"bytes={have}-"} if have else {}
        validator = _if_range(saved) if have else None
        if validator:  # then the server itself sends all (200) if its file is another one now
            headers["If-Range"] = validator
        log(f"downloading {url} -> {part.with_suffix('')}" + (f" (resuming at {have:,} bytes)" if have else ""))
        try:
            response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60)
        except urllib.error.HTTPError as e:
            if e.code != 416 or not have:  # 416: no bytes after `have`, complete if unchanged
                raise
            total = (e.headers.get("Content-Range") or "").rpartition("/")[2]  # "bytes */200"
            if total in ("", str(have)) and saved["length"] == have:
                return saved
            log(f"{url}: the file on the server changed; starting over")
            have = 0
            continue
        with response:
            offer = _offer(url, response, have if response.status == 206 else 0)
            if have and not (response.status == 206 and _same_offer(saved, offer)):
                if response.status == 206:  # the server ignored If-Range: ask again
                    log(f"{url}: the file on the server changed; starting over")
                    have = 0
                    continue
                have = 0  # a full answer (200): the file changed, or no Range support
            if not have:
                offer_path.write_text(json.dumps(offer) + "\n")
            _copy(response, part, have, chunk_size)
            return offer
    raise PrepError(f"{url}: the file on the server keeps changing; run again later")


def _offer(url, response, have):
    return {
        "url": url,
        "etag": response.headers.get("ETag"),
        "last_modified": response.headers.get("Last-Modified"),
        "length": _total_length(response, have),
    }


def _if_range(saved):
    etag = saved["etag"]
    return etag if etag and not etag.startswith("W/") else saved["last_modified"]  # no weak ETag


def _same_offer(saved, offer):
    """The server still offers the file that the part began with: every validator that both
    sides know agrees, and at least one is known."""
    known = [k for k in ("etag", "last_modified", "length") if saved[k] and offer[k]]
    return bool(known) and all(saved[k] == offer[k] for k in known)


def _copy(response, part, have, chunk_size):
    progress = Progress(f"  {part.name}", unit="MB")
    with open(part, "ab" if have else "wb") as out:
        while block := response.read(chunk_size):
            out.write(block)
            progress.update(len(block) / 1e6)


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _total_length(response, have):
    content_range = response.headers.get("Content-Range")  # "bytes 100-199/200"
    if content_range and "/" in content_range and not content_range.endswith("*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) + have if length is not None else None


def fetch_text(url, timeout=60):
    """A small text file from `url` (e.g. a checksum list), or None if it cannot be had."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        log(f"{url}: not available ({e})")
        return None


def local_or_download(source, download_dir, sha1=None):
    """`source` is a local path or an http(s)/ftp URL; return a local path."""
    if "://" not in str(source):
        return require_file(source)
    return download(source, Path(download_dir) / url_name(source), sha1=sha1)


def url_name(url):
    return str(url).split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def run(cmd, what):
    """Run a subprocess quietly; on failure show its output tail and name the step."""
    result = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-20:])
        raise PrepError(f"{what} failed (exit {result.returncode}):\n{tail}")
    return result.stdout


def preprocess_argv(srcdict, destdir, workers, trainpref=None, validpref=None, testpref=None):
    """Arguments of `fairseq-preprocess --only-source --srcdict` for one output folder."""
    argv = ["--only-source", "--srcdict", srcdict, "--destdir", destdir, "--workers", workers]
    for flag, pref in (("--trainpref", trainpref), ("--validpref", validpref), ("--testpref", testpref)):
        if pref:
            argv += [flag, pref]
    return [str(a) for a in argv]


def fairseq_preprocess(*argvs):
    """Run fairseq-preprocess once per argv (see preprocess_argv) in one child process (importing
    fairseq takes seconds, more than binarizing a small GLUE task); log its per-file summary."""
    destdirs = ", ".join(argv[argv.index("--destdir") + 1] for argv in argvs)
    output = run(
        [sys.executable, "-m", "dataprep.common", json.dumps(list(argvs))], f"fairseq-preprocess into {destdirs}"
    )
    for line in output.splitlines():
        if "replaced" in line:  # "[None] FILE: N sents, M tokens, X% replaced (by <unk>)"
            log("  " + line.split("| ")[-1])


def _preprocess_many(argvs):
    """fairseq-preprocess's own main() for each argv; the child of fairseq_preprocess."""
    from fairseq import options
    from fairseq_cli import preprocess

    for argv in argvs:
        preprocess.main(options.get_preprocessing_parser().parse_args(argv))
        for handler in preprocess.logger.handlers[:]:  # main() adds a log file per destdir
            preprocess.logger.removeHandler(handler)
            handler.close()


def default_workers():
    return max(1, min(os.cpu_count() or 1, 8))


# ---------------------------------------------------------------- the corpus format
# One document per block of non-empty lines, blocks separated by an empty line: what corpus.py
# writes and binarize.py shards.


def write_document(f, lines):
    f.write("\n".join(lines) + "\n\n")


def read_documents(path):
    """Yield the documents (lists of lines) of a corpus file in our layout."""
    doc = []
    for _, line in read_lines(path):
        if line:
            doc.append(line)
        elif doc:
            yield doc
            doc = []
    if doc:
        yield doc


if __name__ == "__main__":
    _preprocess_many(json.loads(sys.argv[1]))
