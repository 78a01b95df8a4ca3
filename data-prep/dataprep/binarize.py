"""Binarize an encoded corpus into fairseq shards: DESTDIR/shard0 ... shardN-1.

The train documents are dealt round robin into N shards (document i goes to shard i % N);
every shard has the same dict.txt and the same valid set (binarized once, then hard-linked),
so `--data DESTDIR/shard0:DESTDIR/shard1:...` trains on one shard per epoch, as fairseq expects.
"""

import os
import shutil
from pathlib import Path

from .common import (
    PrepError,
    Recipe,
    atomic,
    bad_input,
    cli,
    default_workers,
    fairseq_preprocess,
    log,
    parser,
    preprocess_argv,
    read_documents,
    read_lines,
    remove,
    require_file,
    write_document,
)

# Encoded text has almost every token in dict.txt; raw text has most of its words outside.
MAX_UNK_RATE = 0.2
UNK_SAMPLE_TOKENS = 1_000_000  # enough to tell, fast on any corpus


def binarize(train, valid, srcdict, destdir, shards, workers, max_unk_rate=MAX_UNK_RATE):
    destdir = Path(destdir)
    names = [destdir / f"shard{k}" for k in range(shards)]
    train, valid, srcdict = (require_file(p) for p in (train, valid, srcdict))
    recipe = Recipe("binarizing", {"train": train, "valid": valid, "srcdict": srcdict}, shards=shards)
    if all([recipe.done(d) for d in names]):  # each one checked: a stale shard stops the run
        return names
    for text in (train, valid):
        check_encoded(text, srcdict, max_unk_rate)
    scratch = destdir / ".shard-text"  # never mistaken for output: only shardK counts
    remove(scratch)
    try:
        texts = split_documents(train, scratch, shards)
        for k, (name, text) in enumerate(zip(names, texts)):
            if name.exists():  # checked above
                continue
            log(f"binarizing shard {k + 1}/{shards}")
            with atomic(name, recipe) as tmp:
                # valid is binarized once, with shard0, and hard-linked into the others
                fairseq_preprocess(
                    preprocess_argv(srcdict, tmp, workers, trainpref=text, validpref=None if k else valid)
                )
                for f in ("valid.bin", "valid.idx") if k else ():
                    _link(names[0] / f, tmp / f)
    finally:
        remove(scratch)
    log(f"train with: --data {':'.join(str(d) for d in names)}")
    return names


def check_encoded(path, srcdict, max_unk_rate):
    """Stop if too many tokens of `path` (its first UNK_SAMPLE_TOKENS) are not in `srcdict`:
    fairseq would silently binarize them all as <unk>."""
    known = {line.split(" ", 1)[0] for _, line in read_lines(srcdict)}
    tokens = unknown = 0
    for _, line in read_lines(path):
        words = line.split()
        tokens += len(words)
        unknown += sum(w not in known for w in words)
        if tokens >= UNK_SAMPLE_TOKENS:
            break
    rate = unknown / max(tokens, 1)
    if rate > max_unk_rate:
        bad_input(
            path,
            None,
            f"{rate:.0%} of its first {tokens:,} tokens are not in the dictionary "
            f"{srcdict} and would become <unk>: was this text never encoded with spm.sh "
            f"encode (or encoded with another model)? Encode it first, or give --max-unk-rate "
            f"{min(1, rate + 0.01):.2f} to binarize it anyway",
        )
    log(f"{path}: {rate:.2%} of the first {tokens:,} tokens are not in the dictionary")


def _link(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # another file system, or no hard links there
        shutil.copyfile(src, dst)


def split_documents(train, out_dir, shards):
    """Write N text files of whole documents; fail if there are fewer documents than N."""
    n = sum(1 for _ in read_documents(train))
    if n < shards:
        bad_input(train, None, f"{n} documents cannot fill {shards} shards")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"shard{k}.txt" for k in range(shards)]
    files = [open(p, "w") for p in paths]
    try:
        for i, doc in enumerate(read_documents(train)):
            write_document(files[i % shards], doc)  # round robin: sources mix
    finally:
        for f in files:
            f.close()
    return paths


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = parser(__doc__)
    p.add_argument("--train", required=True, type=Path, help="encoded train text (corpus layout)")
    p.add_argument("--valid", required=True, type=Path, help="encoded valid text")
    p.add_argument("--srcdict", required=True, type=Path, help="dict.txt written by spm.sh train")
    p.add_argument("--destdir", required=True, type=Path, help="output folder of the shards")
    p.add_argument("--shards", type=int, default=1, help="number of train shards")
    p.add_argument("--workers", type=int, default=default_workers(), help="fairseq-preprocess workers")
    p.add_argument(
        "--max-unk-rate",
        type=float,
        default=MAX_UNK_RATE,
        help="stop if more of the tokens than this are not in --srcdict (a sign of "
        "text that was never encoded); 1 accepts any text",
    )
    return p


def main():
    args = build_parser().parse_args()
    if args.shards < 1:
        raise PrepError(f"--shards must be at least 1, got {args.shards}")
    binarize(args.train, args.valid, args.srcdict, args.destdir, args.shards, args.workers, args.max_unk_rate)


if __name__ == "__main__":
    cli(main)
