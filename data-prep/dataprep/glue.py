"""GLUE (CoLA, SST-2, MRPC, QQP, STS-B, MNLI, QNLI, RTE) -> DESTDIR/<TASK>-bin for fairseq.

Reads the glue_data/<TASK>/*.tsv layout written by the standard download_glue_data.py (or
downloads the same files with --download), picks each task's own columns by header name,
checks every row and label, encodes the texts with the pretraining sentencepiece model (or
tokenizer.json) and binarizes them as fairseq's sentence_prediction task expects (see
labelled.py). STS-B is a regression target, scaled from [0, 5] to [0, 1] as in fairseq's
RoBERTa recipe.
"""

import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from . import spm
from .common import (
    PrepError,
    Recipe,
    atomic,
    bad_input,
    cli,
    default_workers,
    download,
    finished,
    log,
    parser,
    read_lines,
    remove,
    require_file,
)
from .labelled import Split, write_task

BINARY = ("0", "1")
NLI2 = ("entailment", "not_entailment")


@dataclass(frozen=True)
class Task:
    inputs: tuple  # column names of input0 (and input1)
    label: str  # label column name
    classes: tuple = BINARY  # label values in class-index order; None: regression
    # fairseq split name -> file name; test files are optional and unlabelled
    files: dict = field(default_factory=lambda: {"train": "train.tsv", "valid": "dev.tsv", "test": "test.tsv"})
    headerless: tuple = ()  # column names of train/dev files that have no header row
    skip_malformed: bool = False  # drop rows with a wrong field count (QQP has a few)


TASKS = {
    "CoLA": Task(("sentence",), "label", headerless=("source", "label", "original_label", "sentence")),
    "SST-2": Task(("sentence",), "label"),
    "MRPC": Task(("#1 String", "#2 String"), "Quality"),
    "QQP": Task(("question1", "question2"), "is_duplicate", skip_malformed=True),
    "STS-B": Task(("sentence1", "sentence2"), "score", classes=None),
    "MNLI": Task(
        ("sentence1", "sentence2"),
        "gold_label",
        classes=("contradiction", "entailment", "neutral"),
        files={
            "train": "train.tsv",
            "valid": "dev_matched.tsv",
            "valid1": "dev_mismatched.tsv",
            "test": "test_matched.tsv",
            "test1": "test_mismatched.tsv",
        },
    ),
    "QNLI": Task(("question", "sentence"), "label", classes=NLI2),
    "RTE": Task(("sentence1", "sentence2"), "label", classes=NLI2),
}
STSB_MAX = 5.0

GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data/"
GLUE_ZIPS = {
    "CoLA": "CoLA.zip",
    "SST-2": "SST-2.zip",
    "QQP": "QQP-clean.zip",
    "STS-B": "STS-B.zip",
    "MNLI": "MNLI.zip",
    "QNLI": "QNLIv2.zip",
    "RTE": "RTE.zip",
}
# GLUE does not host MRPC: its train/test come from SentEval, its dev ids from GLUE.
MRPC_FILES = {
    "msr_paraphrase_train.txt": "https://dl.fbaipublicfiles.com/senteval/senteval_data/msr_paraphrase_train.txt",
    "msr_paraphrase_test.txt": "https://dl.fbaipublicfiles.com/senteval/senteval_data/msr_paraphrase_test.txt",
    "dev_ids.tsv": GLUE_URL + "mrpc_dev_ids.tsv",
}


# ---------------------------------------------------------------- parsing


def read_split(task, path, labelled):
    """(inputs, labels) of one TSV file; labels is None for an unlabelled (test) file."""
    lines = read_lines(path)
    if task.headerless and labelled:
        columns = list(task.headerless)
    else:
        _, header = next(lines, (1, None))
        if header is None:
            bad_input(path, 1, "empty file, expected a header row")
        columns = header.split("\t")
    wanted = list(task.inputs) + ([task.label] if labelled else [])
    missing = [c for c in wanted if c not in columns]
    if missing:
        bad_input(path, 1, f"no column {missing[0]!r} in the header {columns}")
    index = [columns.index(c) for c in wanted]
    inputs, labels, skipped = [[] for _ in task.inputs], [], 0
    for lineno, line in lines:
        fields = line.split("\t")
        if len(fields) != len(columns):
            if task.skip_malformed:
                skipped += 1
                continue
            bad_input(path, lineno, f"expected {len(columns)} tab-separated fields, found {len(fields)}")
        values = [fields[i].replace("\r", " ").strip() for i in index]
        for column, text in zip(inputs, values):
            column.append(text)
        if labelled:
            labels.append(_check_label(task, path, lineno, values[-1]))
    if not inputs[0]:
        bad_input(path, None, "no data rows")
    if skipped:
        log(f"{path}: skipped {skipped} rows with a wrong number of fields")
    return inputs, labels if labelled else None


def _check_label(task, path, lineno, label):
    if task.classes:
        if label not in task.classes:
            bad_input(path, lineno, f"label {label!r} (column {task.label!r}) is not one of {', '.join(task.classes)}")
        return label
    try:
        score = float(label)
    except ValueError:
        score = None
    if score is None or not 0 <= score <= STSB_MAX:
        bad_input(path, lineno, f"score {label!r} (column {task.label!r}) is not a number in [0, {STSB_MAX:g}]")
    return f"{score / STSB_MAX:g}"


def read_task(glue_dir, name):
    """All splits of one task; train and dev files must exist, test files are optional."""
    task, folder = TASKS[name], Path(glue_dir) / name
    splits = []
    for split, file in task.files.items():
        path = folder / file
        labelled = not split.startswith("test")
        if not labelled and not path.exists():
            log(f"{path} not found: no test split for {name}")
            continue
        inputs, labels = read_split(task, require_file(path, f"{name} {split} file"), labelled)
        splits.append(Split(split, inputs, labels))
    return splits


# ---------------------------------------------------------------- download


def fetch(glue_dir, name):
    """Download one task into glue_dir/<name>/ (resumable; skipped when the folder exists)."""
    folder = Path(glue_dir) / name
    if finished(folder, f"{name} download"):
        return
    downloads = Path(glue_dir) / "downloads"
    with atomic(folder) as tmp:
        if name == "MRPC":
            tmp.mkdir()
            for file, url in MRPC_FILES.items():
                download(url, downloads / file)
            build_mrpc(downloads, tmp)
            return
        archive = download(GLUE_URL + GLUE_ZIPS[name], downloads / GLUE_ZIPS[name])
        scratch = tmp.with_name(tmp.name + "-zip")
        remove(scratch)
        try:
            with zipfile.ZipFile(archive) as z:
                z.extractall(scratch)
        except zipfile.BadZipFile:
            bad_input(archive, None, "not a zip archive; delete it and run again")
        top = [p for p in scratch.iterdir() if p.is_dir()]
        if len(top) != 1:
            bad_input(archive, None, "expected one top folder in the zip")
        top[0].rename(tmp)
        remove(scratch)


def build_mrpc(src, dest):
    """train/dev/test.tsv of MRPC from the SentEval files, as download_glue_data.py lays them
    out: dev = the train rows listed in dev_ids.tsv, test without its labels."""
    dev_ids = {tuple(line.split("\t")) for _, line in read_lines(src / "dev_ids.tsv") if line}
    rows = read_lines(src / "msr_paraphrase_train.txt")
    _, header = next(rows)
    with open(dest / "train.tsv", "w") as train, open(dest / "dev.tsv", "w") as dev:
        for out in (train, dev):
            out.write("\ufeff" + header + "\n")  # the original files keep the BOM
        for lineno, line in rows:
            fields = line.split("\t")
            if len(fields) != 5:
                bad_input(src / "msr_paraphrase_train.txt", lineno, "expected 5 tab-separated fields")
            (dev if tuple(fields[1:3]) in dev_ids else train).write(line + "\n")
    rows = read_lines(src / "msr_paraphrase_test.txt")
    next(rows)
    with open(dest / "test.tsv", "w") as test:
        test.write("index\t#1 ID\t#2 ID\t#1 String\t#2 String\n")
        for i, (_, line) in enumerate(rows):
            test.write(f"{i}\t" + "\t".join(line.split("\t")[1:]) + "\n")


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = parser(__doc__)
    p.add_argument("--glue-dir", required=True, type=Path, help="glue_data folder with one sub-folder per task")
    p.add_argument("--download", action="store_true", help="download missing tasks into --glue-dir first")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    spm.add_model_argument(p)
    p.add_argument("--srcdict", required=True, type=Path, help="the pretraining dict.txt")
    p.add_argument("--destdir", required=True, type=Path, help="writes DESTDIR/<TASK>-bin")
    p.add_argument("--workers", type=int, default=default_workers())
    return p


def main():
    args = build_parser().parse_args()
    spm.check_model(args.spm_model)
    require_file(args.srcdict, "dictionary")
    for name in args.tasks:
        if args.download:
            fetch(args.glue_dir, name)  # only if its folder is missing
        if not (args.glue_dir / name).is_dir():
            raise PrepError(f"{args.glue_dir / name}: task folder not found (use --download)")
        recipe = Recipe(
            f"{name} task",
            {"task_folder": args.glue_dir / name, "spm_model": args.spm_model, "srcdict": args.srcdict},
            task=name,
        )
        dest = args.destdir / f"{name}-bin"
        if recipe.done(dest):
            continue
        write_task(
            dest,
            read_task(args.glue_dir, name),
            args.spm_model,
            args.srcdict,
            TASKS[name].classes,
            args.workers,
            recipe,
        )


if __name__ == "__main__":
    cli(main)
