"""The long-document study's records: one per finetuning seed, with what it was (the run, its
head, reading and recipe, the command and the date) and what it scored (validation accuracy,
and the test reviews right in each length bin). The report writes OUT/records.json from them;
studies/long_documents_records.py merges them into docs/long_documents/records.json, from which
the docs' tables are made."""

import json

from long_documents.data import corpus_name, length_bins
from long_documents.runs import READINGS


def test_bins(rows, bins):
    """{bin label: [reviews, right]} of a seed's predictions ((length, label, right) rows)."""
    return {label: [sum(keep(x) for x, _, _ in rows), sum(bool(c) for x, _, c in rows if keep(x))]
            for label, keep in bins}  # fmt: skip


def seed_records(args, specs, predictions, validation_accuracy):
    """Every finished seed of OUT as a record, a band model's once for each way it read the test
    reviews; a seed finetuned before records were written has no head, command or date (which
    long_documents_records.py add refuses)."""
    bins, found = length_bins(args.n, args.factors), []
    for name in specs:
        for seed in range(1, args.seeds + 1):
            if not predictions(args, name, seed):
                continue
            folder = args.out / "runs" / name / f"seed{seed}"
            record = dict(run=name, seed=seed, command=None, date=None)
            record = json.loads((folder / "record.json").read_text()) if (folder / "record.json").is_file() else record
            record.update(corpus=corpus_name(args), n=args.n, valid=validation_accuracy(args, name, seed))
            for reading, file in READINGS.items():  # a band model also with its rows, or its band, masked
                if (folder / file).is_file():
                    rows = json.loads((folder / file).read_text())
                    found.append(dict(record, reading=reading, test=test_bins(rows, bins)))
    return found
