"""Binarize an encoded corpus into fairseq shards: DESTDIR/shard0 ... shardN-1.

The train documents are dealt round robin into N shards (document i goes to shard i % N);
every shard has the same dict.txt and the same valid set (binarized once, then hard-linked),
so `--data DESTDIR/shard0:DESTDIR/shard1:...` trains on one shard per epoch, as fairseq expects.
"""

import os
import shutil
from pathlib import Path

from .common import (
    PrepError, atomic, cli, default_workers, fail, fairseq_preprocess, finished, log, parser,
    preprocess_argv, remove, require_file,
)
from .corpus import read_documents, write_document


def binarize(train, valid, srcdict, destdir, shards, workers):
    destdir = Path(destdir)
    names = [destdir / f"shard{k}" for k in range(shards)]
    if all(finished(d, "binarizing") for d in names):
        return names
    train, valid, srcdict = (require_file(p) for p in (train, valid, srcdict))
    scratch = destdir / ".shard-text"  # never mistaken for output: only shardK counts
    remove(scratch)
    try:
        texts = split_documents(train, scratch, shards)
        for k, (name, text) in enumerate(zip(names, texts)):
            if finished(name, "binarizing"):
                continue
            log(f"binarizing shard {k + 1}/{shards}")
            with atomic(name) as tmp:
                # valid is binarized once, with shard0, and hard-linked into the others
                fairseq_preprocess(preprocess_argv(srcdict, tmp, workers, trainpref=text,
                                                   validpref=None if k else valid))
                for f in ("valid.bin", "valid.idx") if k else ():
                    _link(names[0] / f, tmp / f)
    finally:
        remove(scratch)
    log(f"train with: --data {':'.join(str(d) for d in names)}")
    return names


def _link(src, dst):
    try:
        os.link(src, dst)
    except OSError:  # another file system, or no hard links there
        shutil.copyfile(src, dst)


def split_documents(train, out_dir, shards):
    """Write N text files of whole documents; fail if there are fewer documents than N."""
    n = sum(1 for _ in read_documents(train))
    if n < shards:
        fail(train, None, f"{n} documents cannot fill {shards} shards")
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


def main():
    p = parser(__doc__)
    p.add_argument("--train", required=True, type=Path, help="encoded train text (corpus layout)")
    p.add_argument("--valid", required=True, type=Path, help="encoded valid text")
    p.add_argument("--srcdict", required=True, type=Path, help="dict.txt written by spm.sh train")
    p.add_argument("--destdir", required=True, type=Path, help="output folder of the shards")
    p.add_argument("--shards", type=int, default=1, help="number of train shards")
    p.add_argument("--workers", type=int, default=default_workers(), help="fairseq-preprocess workers")
    args = p.parse_args()
    if args.shards < 1:
        raise PrepError(f"--shards must be at least 1, got {args.shards}")
    binarize(args.train, args.valid, args.srcdict, args.destdir, args.shards, args.workers)


if __name__ == "__main__":
    cli(main)
