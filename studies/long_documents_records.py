"""The long-document study's committed records (docs/long_documents/records.json: one record a
finetuning seed) and the tables of docs/long_documents.md made from them.

  add OUT/records.json [--corpus NAME] [--tag TAG]   merge a study folder's records (a seed
        already recorded, same corpus, run, head and projections, is replaced); --tag names
        runs made in their own OUT with other flags ("band W = 128": run NAME [band W = 128])
  add-cost COST.json   the side-by-side cost (studies/long_documents_cost.py) replaces the one recorded
  tables [--check]   rewrite each table between <!-- records: NAME --> and <!-- /records -->
        in docs/long_documents.md from the records; --check fails if one differs instead

A table's figures are the mean ± sd over its seeds; "chosen on validation" is the head whose
seeds' mean validation accuracy is highest, for each option and corpus.
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # linformer_tools
from linformer_tools.common import REPO, fail, write_text

RECORDS = REPO / "docs" / "long_documents" / "records.json"
PAGE = REPO / "docs" / "long_documents.md"
CORPORA = ("IMDB", "Pang & Lee")
HEADS = {
    "random-first": "random on `<s>` (fairseq's)",
    "random-mean": "random on the mean",
    "probe-mean": "the probe's, on the mean (`--lp-ft mean`)",
}
# option -> (what it reads, its run in each corpus's study)
OPTIONS = {
    "head+tail truncation": ("512", {c: "original-n512-head_tail" for c in CORPORA}),
    "chunks of 512, the head on their mean": ("whole, in chunks", {c: "original-n512-chunks-n2048" for c in CORPORA}),
    "full attention, n' = 2,048": ("whole", {c: "original-n2048" for c in CORPORA}),
    "Linformer, k = 512 at n' = 2,048": (
        "whole",
        {"IMDB": "linformer-n2048-k512-s300-docs-exact", "Pang & Lee": "linformer-n2048-k512-s300-docs"},
    ),
    "the same with a local band, W = 128": (
        "whole",
        {
            "IMDB": "linformer-n2048-k512-s300-docs-exact [band W = 128]",
            "Pang & Lee": "linformer-n2048-k512-s300-docs [band W = 128]",
        },
    ),
    "head truncation": ("512", {"IMDB": "original-n512-head"}),
    "full attention, n' = 1,024": ("up to 1,024", {"IMDB": "original-n1024"}),
}


def key(record):
    return (record["corpus"], record["run"], record["head"], record["frozen_projections"], record["seed"],
            reading(record))  # fmt: skip


def reading(record):
    """How the model read the test reviews: as finetuned, or a band model with its rows or band masked."""
    return record.get("reading", "as finetuned")


def load():
    return json.loads(RECORDS.read_text())


def add(path, corpus, tag):
    found = json.loads(Path(path).read_text())
    if not isinstance(found, list) or not all("test" in r and "run" in r for r in found):
        fail(f"{path}: not a study's records.json (a list of seed records)")
    committed = load()
    by_key = {key(r): r for r in committed["records"]}
    for record in found:
        if record.get("date") is None:
            fail(f"{path}: {record['run']} seed {record['seed']} has no command or date (finetuned before records)")
        record = dict(record, corpus=corpus or record["corpus"])
        if record["corpus"] not in CORPORA:
            fail(f"{path}: its corpus is {record['corpus']}: name it with --corpus ({' or '.join(CORPORA)})")
        record["run"] += f" [{tag}]" if tag else ""
        record.setdefault("head", "random-first")
        record.setdefault("frozen_projections", False)
        record.setdefault("reading", "as finetuned")
        by_key[key(record)] = record
    committed["records"] = sorted(by_key.values(), key=lambda r: (CORPORA.index(r["corpus"]), *key(r)[1:]))
    write_text(RECORDS, json.dumps(committed, indent=1) + "\n")
    print(f"{RECORDS.relative_to(REPO)}: {len(found)} records from {path}; {len(committed['records'])} in all")


def add_cost(path):
    found = json.loads(Path(path).read_text())
    if not isinstance(found, dict) or not {"options", "date", "command"} <= set(found):
        fail(f"{path}: not the JSON of studies/long_documents_cost.py")
    committed = load()
    committed["side_by_side"] = found
    write_text(RECORDS, json.dumps(committed, indent=1) + "\n")
    print(f"{RECORDS.relative_to(REPO)}: the side-by-side cost of {path} ({found['date']})")


# ---------------------------------------------------------------- figures


def accuracy(record, longer_than=None):
    """Test accuracy (%) of a seed: all reviews, or those longer than LONGER_THAN tokens."""
    bins = [b for label, b in record["test"].items() if longer_than is None or label != f"<= {longer_than}"]
    return 100 * sum(right for _, right in bins) / sum(reviews for reviews, _ in bins)


def mean_sd(values):
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.1f} (1 seed)"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def seeds_of(records, corpus, run, head, read="as finetuned"):
    """The seeds of RUN on CORPUS finetuned with HEAD, a (head, projections frozen) pair."""
    return [r for r in records if (r["corpus"], r["run"], head_of(r), reading(r)) == (corpus, run, head, read)]


def head_of(record):
    return record["head"], record["frozen_projections"]


def head_label(head):
    return HEADS[head[0]] + (", E/F frozen" if head[1] else "")


def valid_mean(seeds):
    logged = [r["valid"] for r in seeds if r["valid"] is not None]
    return statistics.mean(logged) if logged else None


def options_table(records):
    """Each option with each head it was finetuned with: validation and test accuracy, both corpora."""
    columns = [f"{c}: valid | {c}: test, all | {c}: test, > 512" for c in CORPORA]
    lines = ["| option | reads | head | " + " | ".join(columns) + " |", "| --- " * (3 + 3 * len(CORPORA)) + "|"]
    for option, (reads, runs) in OPTIONS.items():
        heads = {head_of(r) for r in records if r["run"] in runs.values()}
        for head in sorted(heads, key=lambda h: ([*HEADS].index(h[0]), h[1])):
            cells = []
            for corpus in CORPORA:
                run, seeds = runs.get(corpus), seeds_of(records, corpus, runs.get(corpus), head)
                chosen = chosen_head(records, corpus, run) == head
                valid = valid_mean(seeds)
                cells += ["-" if valid is None else f"{valid:.1f}" + (" (chosen)" if chosen else "")]
                cells += [mean_sd([accuracy(r) for r in seeds]), mean_sd([accuracy(r, 512) for r in seeds])]
            lines.append(f"| {option} | {reads} | {head_label(head)} | " + " | ".join(cells) + " |")
    return lines


def heads_of(records, corpus, run):
    """The heads RUN was finetuned with on CORPUS."""
    return {head_of(r) for r in records if (r["corpus"], r["run"]) == (corpus, run)}


def chosen_head(records, corpus, run):
    """The head whose seeds validate best, for RUN on CORPUS (None unless two or more heads have
    validation to choose by)."""
    scored = {h: v for h in heads_of(records, corpus, run) if (v := valid_mean(seeds_of(records, corpus, run, h)))}
    return max(scored, key=scored.get) if len(scored) > 1 else None


def readings_table(records):
    """The band models read three ways: as finetuned, with their rows masked out (the band alone)
    and with their band off (the rows alone); test accuracy on all reviews and on those past 512."""
    scored = sorted({(r["corpus"], r["run"], head_of(r)) for r in records if reading(r) != "as finetuned"})
    if not scored:
        return ["(no band model scored so yet)"]
    lines = ["| corpus | run | head | as finetuned | band only | rows only |", "| --- " * 6 + "|"]
    for corpus, run, head in scored:
        cells = []
        for read in ("as finetuned", "band only", "rows only"):
            seeds = seeds_of(records, corpus, run, head, read)
            cells.append(
                f"{mean_sd([accuracy(r) for r in seeds])}; > 512: {mean_sd([accuracy(r, 512) for r in seeds])}"
            )
        lines.append(f"| {corpus} | {run} | {head_label(head)} | " + " | ".join(cells) + " |")
    return lines


def cost_table(_records):
    """The side-by-side cost: each option's timings, their mean against full attention's."""
    measured = load()["side_by_side"]
    if not measured:
        return ["(not measured yet)"]
    options = measured["options"]
    full = next(o for name, o in options.items() if name.startswith("full attention"))
    lines = ["| option | reads | s/update | peak MB | documents/s predicting | against full attention |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for name, o in options.items():
        speed = statistics.mean(full["seconds_per_update"]) / statistics.mean(o["seconds_per_update"])
        memory = statistics.mean(full["peak_mb"]) / statistics.mean(o["peak_mb"])
        against = "" if o is full else f"{speed:.2f}x the speed, 1/{memory:.1f} the memory"
        cells = [name, f"{o['reads']:,}", ", ".join(f"{t:.1f}" for t in o["seconds_per_update"]),
                 f"{statistics.mean(o['peak_mb']):,.0f}", ", ".join(f"{d:.2f}" for d in o["documents_per_second"]),
                 against]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


TABLES = {"options": options_table, "cost": cost_table, "readings": readings_table}


def tables(check):
    records, page = load()["records"], PAGE.read_text()
    made = page
    for name, table in TABLES.items():
        block = re.compile(rf"(<!-- records: {name} -->\n).*?(<!-- /records -->)", re.S)
        if not block.search(made):
            fail(f"{PAGE.relative_to(REPO)} has no <!-- records: {name} --> ... <!-- /records --> block")
        made = block.sub(lambda m: m.group(1) + "\n".join(table(records)) + "\n" + m.group(2), made)
    if check:
        if made != page:
            fail(f"{PAGE.relative_to(REPO)}: a records table differs from {RECORDS.relative_to(REPO)}: run "
                 "python studies/long_documents_records.py tables")  # fmt: skip
        print(f"{PAGE.relative_to(REPO)}: every records table as {RECORDS.relative_to(REPO)} makes it")
    elif made != page:
        write_text(PAGE, made)
        print(f"{PAGE.relative_to(REPO)}: tables rewritten from {RECORDS.relative_to(REPO)}")


def build_parser():
    """The command line (tests/test_readme.py parses the docs' commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("add", help="merge a study folder's OUT/records.json")
    a.add_argument("path", type=Path, help="a study's OUT/records.json")
    a.add_argument("--corpus", choices=CORPORA, help="the corpus (default: the records' own; Pang & Lee's tarball "
                   "is named by its file)")  # fmt: skip
    a.add_argument("--tag", help="appended to each run's name in brackets: a run made in its own OUT")
    c = sub.add_parser("add-cost", help="record studies/long_documents_cost.py's JSON")
    c.add_argument("path", type=Path, help="the JSON long_documents_cost.py wrote")
    t = sub.add_parser("tables", help="rewrite docs/long_documents.md's tables from the records")
    t.add_argument("--check", action="store_true", help="only check that they are as the records make them")
    return p


def main():
    p = build_parser()
    args = p.parse_args()
    if args.command == "add":
        if not args.path.is_file():
            p.error(f"{args.path} not found")
        add(args.path, args.corpus, args.tag)
    elif args.command == "add-cost":
        if not args.path.is_file():
            p.error(f"{args.path} not found")
        add_cost(args.path)
    else:
        tables(args.check)


if __name__ == "__main__":
    main()
