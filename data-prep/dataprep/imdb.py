"""IMDB (aclImdb_v1.tar.gz) -> DESTDIR/IMDB-bin, in the same layout as the GLUE tasks.

Reads the reviews straight from the tarball (aclImdb/{train,test}/{pos,neg}/<id>_<stars>.txt),
replaces the <br /> tags by spaces, holds out a fixed random valid set from train
(--valid-size reviews, --seed) and keeps test as test.
Every review is kept whole: truncating to a model's length is the finetuning task's choice.
--train-size and --test-size keep fixed subsets, half of each class (for studies on a CPU).
Classes: neg = 0, pos = 1. train/unsup's 50,000 unlabelled reviews are left out of the task;
--unlabeled FILE writes them as text, one a line (e.g. for scripts/linearize.py --text).
"""

import random
import re
import tarfile
from pathlib import Path

from . import spm
from .common import (
    PrepError,
    Progress,
    Recipe,
    atomic,
    bad_input,
    cli,
    default_workers,
    local_or_download,
    parser,
    require_file,
)
from .labelled import Split, write_task

IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
CLASSES = ("neg", "pos")
MEMBER = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg|unsup)/(\d+)_\d+\.txt$")
BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)


def read_reviews(tarball, unlabeled=False):
    """{"train": [(label, text)], "test": [...]}, each sorted by (label, review id); with
    ``unlabeled`` also "unsup": train/unsup's reviews as [("unsup", text)]."""
    tarball = require_file(tarball, "IMDB tarball")
    found = {"train": [], "test": [], "unsup": []}
    progress = Progress(f"reading {tarball}", unit="reviews")
    try:
        with tarfile.open(tarball, "r:*") as tar:
            for member in tar:
                match = MEMBER.search(member.name)
                if not (match and member.isfile()):
                    continue
                split, label, review_id = match.groups()
                if label == "unsup":
                    if not unlabeled:
                        continue
                    split = "unsup"
                try:
                    text = tar.extractfile(member).read().decode("utf-8")
                except UnicodeDecodeError as e:
                    bad_input(f"{tarball}:{member.name}", None, f"not valid UTF-8 ({e.reason})")
                found[split].append((label, int(review_id), " ".join(BREAK.sub(" ", text).split())))
                progress.update()
    except (tarfile.TarError, EOFError, OSError) as e:
        bad_input(tarball, None, f"cannot read the tar archive ({e})")
    progress.close()
    if unlabeled and not found["unsup"]:
        bad_input(tarball, None, "no aclImdb/train/unsup/*.txt reviews for --unlabeled")
    if not unlabeled:
        del found["unsup"]
    for split, reviews in found.items():
        for label in CLASSES if split != "unsup" else ():
            if not any(r[0] == label for r in reviews):
                bad_input(tarball, None, f"no aclImdb/{split}/{label}/*.txt reviews: not the aclImdb_v1 layout")
    return {split: [(label, text) for label, _, text in sorted(reviews)] for split, reviews in found.items()}


def imdb_splits(reviews, valid_size, seed, train_size=None, test_size=None):
    train = list(reviews["train"])
    if not 0 < valid_size < len(train):
        raise PrepError(
            f"--valid-size {valid_size} must be between 1 and {len(train) - 1} (the number of train reviews - 1)"
        )
    random.Random(seed).shuffle(train)
    train, valid = stratified(train[valid_size:], train_size, seed, "--train-size"), train[:valid_size]
    test = stratified(reviews["test"], test_size, seed, "--test-size")
    return [_split("train", train), _split("valid", valid), _split("test", test)]


def stratified(reviews, size, seed, flag):
    """``size`` of ``reviews`` (all if None), half of each class, drawn with ``seed``, in their order."""
    if size is None:
        return reviews
    by_class = [[i for i, r in enumerate(reviews) if r[0] == label] for label in CLASSES]
    if size < 2 or size % 2 or size // 2 > min(map(len, by_class)):
        raise PrepError(
            f"{flag} {size} must be even, >= 2 and at most twice the smaller class ({min(map(len, by_class))})"
        )
    rng = random.Random(seed)
    kept = sorted(i for indices in by_class for i in rng.sample(indices, size // 2))
    return [reviews[i] for i in kept]


def _split(name, reviews):
    return Split(name, [[text for _, text in reviews]], [label for label, _ in reviews])


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = parser(__doc__)
    p.add_argument(
        "--tarball",
        required=True,
        metavar="PATH|URL|download",
        help=f"aclImdb_v1.tar.gz: a local file, a URL, or 'download' for {IMDB_URL}",
    )
    p.add_argument("--download-dir", type=Path, default=Path("."), help="where a downloaded tarball goes")
    spm.add_model_argument(p)
    p.add_argument("--srcdict", required=True, type=Path, help="the pretraining dict.txt")
    p.add_argument("--destdir", required=True, type=Path, help="writes DESTDIR/IMDB-bin")
    p.add_argument("--valid-size", type=int, default=2500, help="train reviews held out as valid")
    p.add_argument("--train-size", type=int, help="keep this many train reviews, half of each class (default: all)")
    p.add_argument("--test-size", type=int, help="keep this many test reviews, half of each class (default: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument("--unlabeled", type=Path, help="also write train/unsup's reviews to this text file, one a line")
    return p


def main():
    args = build_parser().parse_args()
    spm.check_model(args.spm_model)
    require_file(args.srcdict, "dictionary")
    source = IMDB_URL if args.tarball == "download" else args.tarball
    url = "://" in source  # a URL names its tarball; a local one is identified by its bytes
    recipe = Recipe(
        "IMDB",
        {
            "tarball": None if url else require_file(source, "IMDB tarball"),
            "spm_model": args.spm_model,
            "srcdict": args.srcdict,
        },
        tarball_url=source if url else None,
        valid_size=args.valid_size,
        seed=args.seed,
        # only when set: the records of whole-set outputs stay as they were
        **{k: v for k, v in (("train_size", args.train_size), ("test_size", args.test_size)) if v is not None},
    )
    dest = args.destdir / "IMDB-bin"
    unlabeled = args.unlabeled is not None and not args.unlabeled.is_file()
    if recipe.done(dest) and not unlabeled:
        return
    tarball = local_or_download(source, args.download_dir)
    reviews = read_reviews(tarball, unlabeled)
    if unlabeled:
        with atomic(args.unlabeled) as tmp:
            tmp.write_text("".join(f"{text}\n" for _, text in reviews.pop("unsup")), encoding="utf-8")
        print(f"wrote {args.unlabeled}")
    if not recipe.done(dest):
        splits = imdb_splits(reviews, args.valid_size, args.seed, args.train_size, args.test_size)
        write_task(dest, splits, args.spm_model, args.srcdict, CLASSES, args.workers, recipe)


if __name__ == "__main__":
    cli(main)
