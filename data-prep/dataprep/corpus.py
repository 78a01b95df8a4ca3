"""Build the pretraining corpus: English Wikipedia and/or books -> train.txt, valid.txt.

Output layout (what fairseq's --sample-break-mode complete_doc expects): one paragraph per
line, a blank line after each document. Exact-duplicate documents are dropped and the
documents are split into train/valid at random with a fixed seed.
"""

import codecs
import functools
import hashlib
import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

from .common import (
    PrepError,
    Progress,
    Recipe,
    atomic,
    bad_input,
    check_sha1,
    cli,
    fetch_text,
    guess_encoding,
    local_or_download,
    log,
    parser,
    read_documents,
    read_lines,
    url_name,
    write_document,
)

WIKI_DUMP_URL = "https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-pages-articles.xml.bz2"
# Lines that are still list items, tables, templates or indents after wikiextractor.
MARKUP_LINE = re.compile(r"^\s*[*#:;|!{}=]")
WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
WIKITEXT_HEADING = re.compile(r"^ (= )+.*( =)+ $")
# WikiText's tokenizer splits hyphens and numbers as "1 @,@ 000" / "well @-@ known".
WIKITEXT_SPLIT = re.compile(r" @([-,.])@ ")
# WikiText replaced rare words by "<unk>"; sentencepiece learns no '<' '>' from it and would
# cut it in 4 pieces, two of them unknown, so it becomes the plain word "unk".
WIKITEXT_UNK = ("<unk>", "unk")
# A sentence ends at . ! or ? (and closing quotes or brackets) before a capital or a digit,
# but not after an initial ("J. R. R. Tolkien") or a common title ("Mr. Smith").
SENTENCE_END = re.compile(
    r"(?<!\b[A-Z])(?<!\bMr)(?<!\bMrs)(?<!\bMs)(?<!\bDr)(?<!\bSt)"
    r"([.!?][\"')\]]*)\s+(?=[\"'(\[]?[A-Z0-9])"
)


def clean_lines(lines, min_chars):
    """Drop markup and short lines (headings, captions, stubs); normalise whitespace."""
    kept = []
    for line in lines:
        line = " ".join(line.split())
        if len(line) >= min_chars and not MARKUP_LINE.match(line):
            kept.append(line)
    return kept


def split_sentences(lines):
    """One sentence per line instead of one paragraph (a simple rule, not a parser)."""
    return [sentence for line in lines for sentence in SENTENCE_END.sub("\\1\n", line).split("\n")]


# ---------------------------------------------------------------- Wikipedia


def extract_wikipedia(dump, out_dir, processes):
    """Run wikiextractor (JSON output, templates not expanded) on a pages-articles dump."""
    recipe = Recipe("wikiextractor", {"dump": dump})
    if recipe.done(out_dir):
        return out_dir
    if importlib.util.find_spec("wikiextractor") is None:
        raise PrepError('wikiextractor is not installed: pip install "wikiextractor>=3.1.0"')
    log(f"extracting {dump} with wikiextractor ({processes} processes) -> {out_dir}")
    with atomic(out_dir, recipe) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "wikiextractor.WikiExtractor",
            "--json",
            "--no-templates",
            "--processes",
            str(processes),
            "-o",
            str(tmp),
            str(dump),
        ]
        if subprocess.run(cmd).returncode != 0:
            bad_input(dump, None, "wikiextractor failed (is this a MediaWiki XML dump?)")
        if not any(tmp.rglob("wiki_*")):
            bad_input(dump, None, "wikiextractor found no articles (is this a MediaWiki XML dump?)")
    return out_dir


# Wikimedia publishes the sha1 of every dump file in <wiki>-<date>-sha1sums.txt beside it.
DUMP_NAME = re.compile(r"^(?P<wiki>[a-z_]+wiki)-(?P<date>\d{8}|latest)-")


def published_sha1(url):
    """The sha1 that Wikimedia publishes for the dump at `url`, or None (said why)."""
    name = url_name(url)
    match = DUMP_NAME.match(name)
    if not match:
        return None
    sums = f"{str(url).rsplit('/', 1)[0]}/{match['wiki']}-{match['date']}-sha1sums.txt"
    for line in (fetch_text(sums) or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1] == name:
            return fields[0]
    log(f"no published sha1 of {name} in {sums}: the download is not checked")
    return None


def wikipedia_documents(extracted_dir, min_chars):
    """One document per article of a wikiextractor --json output folder."""
    for path in sorted(Path(extracted_dir).rglob("wiki_*")):
        for lineno, line in read_lines(path):
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                bad_input(path, lineno, "not a wikiextractor --json record with a 'text' field")
            yield clean_lines(text.split("\n"), min_chars)


def wikitext_documents(path, min_chars):
    """One document per article of a WikiText-2/103 *.tokens file (a small Wikipedia stand-in)."""
    doc = []
    for _, line in read_lines(path):
        if WIKITEXT_TITLE.match(line):
            yield clean_lines(doc, min_chars)
            doc = []
        elif not WIKITEXT_HEADING.match(line):
            doc.append(WIKITEXT_SPLIT.sub(r"\1", line).replace(*WIKITEXT_UNK))
    yield clean_lines(doc, min_chars)


# ---------------------------------------------------------------- books


def book_documents(folder, min_chars, encoding="utf-8"):
    """One document per *.txt book; a paragraph (block between blank lines) becomes one line.
    encoding="auto": UTF-8, or cp1252 (a superset of Latin-1) for a book that is not UTF-8."""
    books = sorted(Path(folder).glob("*.txt"))
    if not books:
        bad_input(folder, None, "no *.txt books in this folder")
    for path in books:
        paragraphs, block = [], []
        for _, line in read_lines(path, guess_encoding(path) if encoding == "auto" else encoding):
            if line.strip():
                block.append(line)
            elif block:
                paragraphs.append(" ".join(block))
                block = []
        paragraphs.append(" ".join(block))
        yield clean_lines(paragraphs, min_chars)


# ---------------------------------------------------------------- corpus


def build_corpus(sources, out_dir, valid_fraction, valid_docs, seed, recipe=None):
    """Write out_dir/{train,valid}.txt and stats.json from an iterable of (source, doc)."""
    if recipe and recipe.done(out_dir):
        return json.loads((Path(out_dir) / "stats.json").read_text())
    with atomic(out_dir, recipe) as tmp:
        tmp.mkdir()
        stats = _dedup(sources, tmp / "all.txt")
        n = stats["documents"]
        k = valid_docs if valid_docs is not None else max(1, round(n * valid_fraction))
        if n < 2 or not 0 < k < n:
            bad_input(
                out_dir,
                None,
                f"cannot hold out {k} of {n} unique documents for valid; "
                "give more text or change --valid-docs/--valid-fraction",
            )
        valid = set(random.Random(seed).sample(range(n), k))
        stats.update(_split(tmp / "all.txt", valid, tmp))
        (tmp / "all.txt").unlink()
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    log(f"corpus: {json.dumps(stats)}")
    return stats


def _dedup(sources, path):
    """Write the non-empty, first-seen documents to `path`; return counts."""
    seen = set()
    stats = {"documents": 0, "duplicates": 0, "empty": 0, "by_source": {}}
    progress = Progress("reading documents", unit="documents")
    with open(path, "w") as f:
        for source, doc in sources:
            progress.update()
            if not doc:
                stats["empty"] += 1
                continue
            digest = hashlib.blake2b("\n".join(doc).encode(), digest_size=16).digest()
            if digest in seen:
                stats["duplicates"] += 1
                continue
            seen.add(digest)
            write_document(f, doc)
            stats["documents"] += 1
            stats["by_source"][source] = stats["by_source"].get(source, 0) + 1
    progress.close()
    return stats


def nonempty(path, documents):
    """Pass documents through; fail, naming `path`, if none of them has a line left."""
    empty = True
    for source, doc in documents:
        empty = empty and not doc
        yield source, doc
    if empty:
        bad_input(path, None, "empty corpus: no line of at least --min-chars characters")


def _split(path, valid, out_dir):
    """Deal the documents of `path` into out_dir/{train,valid}.txt; return their counts."""
    counts = {split: {"documents": 0, "lines": 0, "words": 0} for split in ("train", "valid")}
    progress = Progress("splitting", unit="documents")
    with open(out_dir / "train.txt", "w") as train, open(out_dir / "valid.txt", "w") as val:
        files = {"train": train, "valid": val}
        for i, doc in enumerate(read_documents(path)):
            split = "valid" if i in valid else "train"
            write_document(files[split], doc)
            c = counts[split]
            c["documents"] += 1
            c["lines"] += len(doc)
            c["words"] += sum(len(line.split()) for line in doc)
            progress.update()
    progress.close()
    return counts


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = parser(__doc__)
    p.add_argument("--out", required=True, type=Path, help="output folder (train.txt, valid.txt, stats.json)")
    src = p.add_argument_group("sources (at least one)")
    src.add_argument(
        "--wiki-dump",
        metavar="PATH|URL|latest",
        help=f"an enwiki pages-articles *.xml.bz2 dump: a local file, a URL, or 'latest' for {WIKI_DUMP_URL}",
    )
    src.add_argument("--wiki-extracted", type=Path, help="a wikiextractor --json output folder")
    src.add_argument("--wikitext", type=Path, nargs="+", help="WikiText *.tokens files")
    src.add_argument(
        "--books",
        type=Path,
        nargs="+",
        help="folders of plain-text books, one book per *.txt file (BookCorpus "
        "is no longer distributed: bring your own)",
    )
    src.add_argument(
        "--books-encoding",
        default="utf-8",
        metavar="ENCODING|auto",
        help="encoding of the books (e.g. cp1252, latin-1); auto: UTF-8, or "
        "cp1252 for a book that is not UTF-8 (logged per book)",
    )
    p.add_argument(
        "--wiki-sha1",
        metavar="HEX",
        help="sha1 of the dump to check after download (default: the one Wikimedia "
        "publishes in <wiki>-<date>-sha1sums.txt beside the dump)",
    )
    p.add_argument("--work-dir", type=Path, help="where the dump is downloaded and extracted (default: OUT.work)")
    p.add_argument(
        "--min-chars", type=int, default=40, help="drop lines shorter than this (headings, captions, list residue)"
    )
    p.add_argument(
        "--split-sentences", action="store_true", help="write one sentence per line instead of one paragraph per line"
    )
    p.add_argument("--valid-fraction", type=float, default=0.01, help="documents held out for valid")
    p.add_argument("--valid-docs", type=int, help="exact number of valid documents (overrides the fraction)")
    p.add_argument("--seed", type=int, default=1, help="seed of the train/valid split")
    p.add_argument("--workers", type=int, default=2, help="wikiextractor processes")
    return p


def check_required(p, args):
    """At least one source, which argparse cannot require (tests/test_readme.py checks the
    README's commands with it too)."""
    if not (args.wiki_dump or args.wiki_extracted or args.wikitext or args.books):
        p.error("give at least one source: --wiki-dump, --wiki-extracted, --wikitext or --books")


def main():
    p = build_parser()
    args = p.parse_args()
    check_required(p, args)
    if args.books_encoding != "auto":
        try:
            codecs.lookup(args.books_encoding)
        except LookupError:
            p.error(f"--books-encoding: unknown encoding {args.books_encoding!r}")
    for folder in filter(None, [args.wiki_extracted, *(args.books or [])]):
        if not Path(folder).is_dir():
            bad_input(folder, None, "folder not found")
    dump_url = args.wiki_dump and (WIKI_DUMP_URL if args.wiki_dump == "latest" else args.wiki_dump)
    if dump_url and "://" not in dump_url:
        dump_url = None  # a local dump is identified by its size and mtime, not its name
    recipe = Recipe(
        "corpus",
        {
            "wiki_dump": None if dump_url else args.wiki_dump,
            "wiki_extracted": args.wiki_extracted,
            "wikitext": args.wikitext,
            "books": args.books,
        },
        wiki_dump_url=dump_url,
        books_encoding=args.books_encoding,
        min_chars=args.min_chars,
        split_sentences=args.split_sentences,
        valid_fraction=args.valid_fraction,
        valid_docs=args.valid_docs,
        seed=args.seed,
    )
    if recipe.done(args.out):
        return
    work = args.work_dir or args.out.with_name(args.out.name + ".work")
    extracted = list(filter(None, [args.wiki_extracted]))
    if dump_url:
        sha1 = args.wiki_sha1 or published_sha1(dump_url)
        dump = local_or_download(dump_url, work, sha1=sha1)
    elif args.wiki_dump:
        dump = local_or_download(args.wiki_dump, work)
        if args.wiki_sha1:
            check_sha1(dump, args.wiki_sha1)
    if args.wiki_dump:
        extracted.append(extract_wikipedia(dump, work / "wiki-extracted", args.workers))

    def sources():
        books = functools.partial(book_documents, encoding=args.books_encoding)
        for kind, reader, inputs in (
            ("wikipedia", wikipedia_documents, extracted),
            ("wikitext", wikitext_documents, args.wikitext or []),
            ("books", books, args.books or []),
        ):
            for path in inputs:
                docs = reader(path, args.min_chars)
                if args.split_sentences:
                    docs = map(split_sentences, docs)
                yield from nonempty(path, ((kind, d) for d in docs))

    build_corpus(sources(), args.out, args.valid_fraction, args.valid_docs, args.seed, recipe)


if __name__ == "__main__":
    cli(main)
