"""Every figure a reader meets first comes from a committed record: each measured figure (a
number with decimals: 71.8, 0.928, 1.67x, 88.2 ± 1.0) of README's Results table and of each
docs page's opening (its title to the end of its first section) is found in the records its
page answers from, at the precision shown. A record is a study's JSON (a value, or the mean and
sd of a list of seeds; the long-document records per run and head) or a table a benchmark tool
printed (docs/benchmarks/, and the GPU check's tables in docs/benchmarks.md). Finding a figure
there is necessary, not sufficient: a large record may hold a number by chance, so the test
catches figures that have no record, not every misquote. Integers (settings, counts) are not
checked."""

import json
import re
import statistics

import pytest

from linformer_tools.common import REPO

DOCS = REPO / "docs"
FIGURE = re.compile(r"(?<![\w.,/=-])(\d+\.\d+)x?(?: ± (\d+\.\d+))?(?![\w.])")
BENCHMARK_TABLES = ["docs/benchmarks/cpu.md", "docs/benchmarks/gpu.md", "docs/benchmarks/update.md",
                    "docs/benchmarks.md#GPU check"]  # fmt: skip
LINEARIZE, LONG = "docs/linearize/results.json", "docs/long_documents/records.json"
QUALITY = "docs/quality/small-800-updates.json"
# a page -> the records its figures come from
SOURCES = {
    "docs/quality.md": [QUALITY],
    "docs/benchmarks.md": BENCHMARK_TABLES,
    "docs/linearize.md": [LINEARIZE],
    "docs/local_band.md": [LINEARIZE, LONG, *BENCHMARK_TABLES],
    "docs/long_documents.md": [LONG],
    "docs/model.md": [QUALITY, LINEARIZE, LONG, *BENCHMARK_TABLES],
    "docs/spectrum.md": [],
    "docs/warm_start.md": [],
}


def leaves(value):
    """Every number in a JSON value, and the mean and sd of each list of numbers (seeds)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield (value, None)
        return
    items = list(value.values()) if isinstance(value, dict) else list(value)
    numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(numbers) >= 2 and len(numbers) == len(items):
        yield (statistics.mean(numbers), statistics.stdev(numbers))
    for item in items:
        yield from leaves(item)


def long_document_figures(found):
    """The long-document records' figures: each run and head's test accuracy (all reviews, and
    those past n) per seed and as mean ± sd, its validation, and the costs and their ratios."""
    import long_documents_records as made

    groups = {}
    for r in found["records"]:
        groups.setdefault((r["corpus"], r["run"], r["head"], r["frozen_projections"]), []).append(r)
    for seeds in groups.values():
        for past in (False, True):
            values = [made.accuracy(r, r["n"] if past else None) for r in seeds]
            yield from ((v, None) for v in values)
            if len(values) > 1:
                yield (statistics.mean(values), statistics.stdev(values))
        logged = [r["valid"] for r in seeds if r["valid"] is not None]
        yield from ((v, None) for v in logged + ([statistics.mean(logged)] if logged else []))
    for r in {r["corpus"]: r for r in found["records"]}.values():  # each corpus's share of long reviews
        yield (100 - 100 * r["test"][f"<= {r['n']}"][0] / sum(b[0] for b in r["test"].values()), None)
    timed = [list(runs.values()) for runs in found["costs"]["runs"].values()]
    if found["side_by_side"]:  # each option's timings: their mean
        options = found["side_by_side"]["options"].values()
        yield from ((t, None) for o in options for v in o.values() if isinstance(v, list) for t in v)
        timed.append([{k: statistics.mean(v) if isinstance(v, list) else v for k, v in o.items()} for o in options])
    for costs in timed:
        for key in ("seconds_per_update", "peak_mb", "documents_per_second"):
            measured = [c[key] for c in costs if key in c]
            yield from ((v, None) for v in measured)
            yield from ((a / b, None) for a in measured for b in measured if b)


def table_figures(path, section=None):
    """The numbers in the cells of a markdown page's tables (of one section, if named), and the
    ratios of the numbers of each row."""
    text = (REPO / path).read_text()
    if section:
        text = text.split(f"\n## {section}")[1].split("\n## ")[0]
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [float(m.group(1)) for m in FIGURE.finditer(line.replace(",", ""))]
            cells += [float(x) for x in re.findall(r"(?<![\w.])\d+(?![\w.])", line.replace(",", ""))]
            yield from ((v, None) for v in cells)
            yield from ((a / b, None) for a in cells for b in cells if b)  # a ratio of one row's measures


def record_figures(source):
    path, _, section = source.partition("#")
    if path.endswith(".md"):
        return list(table_figures(path, section or None))
    found = json.loads((REPO / path).read_text())
    return list(long_document_figures(found) if path == LONG else leaves(found))


def shown(figure):
    """(value, half a unit of its last digit)."""
    return float(figure), 0.5 * 10 ** -len(figure.split(".")[1]) + 1e-9


def unrecorded(text, sources):
    """The figures of TEXT found in none of SOURCES' records."""
    known = [f for s in sources for f in record_figures(s)]
    missing = []
    for m in FIGURE.finditer(text):
        (value, tol), sd = shown(m.group(1)), m.group(2) and shown(m.group(2))
        if not any(abs(v - value) <= tol and (not sd or (s is not None and abs(s - sd[0]) <= sd[1])) for v, s in known):
            missing.append(m.group(0))
    return missing


def opening(page):
    """A page from its title to the end of its first section."""
    parts = (REPO / page).read_text().split("\n## ")
    return "\n## ".join(parts[:2])


def results_rows():
    section = (REPO / "README.md").read_text().split("\n## Results")[1].split("\n## ")[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and (link := re.search(r"\]\((docs/[\w/]+\.md)", cells[2])):
            yield cells[0], cells[1], link.group(1)


def test_every_page_answering_a_results_row_names_its_records():
    rows = list(results_rows())
    assert len(rows) >= 8, rows
    assert {page for _, _, page in rows} <= set(SOURCES), {page for _, _, page in rows} - set(SOURCES)
    for source in {s for sources in SOURCES.values() for s in sources}:
        assert record_figures(source), f"{source}: no figures read"


@pytest.mark.parametrize("question, answer, page", list(results_rows()), ids=lambda x: x[:40])
def test_readme_results_figures_are_in_records(question, answer, page):
    assert not unrecorded(answer, SOURCES[page]), (
        f"README Results, '{question}': {unrecorded(answer, SOURCES[page])} in no record of {SOURCES[page]}"
    )


# pages whose openings quote figures derived from their records (percent of the original, a
# difference of two losses) or with no record at all; strict: each fails the suite once it passes
DERIVED = {
    "docs/linearize.md": "percent of the original's STS-B, differences of SST-2 means",
    "docs/quality.md": "short-input penalties (differences of two losses), percent of STS-B",
    "docs/warm_start.md": "losses of the bundled sample, no record",
    "docs/spectrum.md": "no record",
}


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=DERIVED[p])) if p in DERIVED else p
     for p in sorted(SOURCES)],
)  # fmt: skip
def test_docs_openings_figures_are_in_records(page):
    missing = unrecorded(opening(page), SOURCES[page])
    assert not missing, f"{page}'s opening: {missing} in no record of {SOURCES[page]}"


def test_the_check_finds_a_figure_without_a_record():
    assert unrecorded("perplexity 555.1, SST-2 71.8 ± 0.7", [QUALITY]) == []
    assert unrecorded("perplexity 555.4; SST-2 71.8 ± 0.9", [QUALITY]) == ["555.4", "71.8 ± 0.9"]
    assert unrecorded("head+tail 88.2 ± 1.0 at 13.5x", [LONG]) == []
    assert unrecorded("the recipe's 84.9 ± 0.8", [LONG]) == ["84.9 ± 0.8"]


def test_the_long_document_tables_are_the_records(capsys):
    """docs/long_documents.md's tables are what studies/long_documents_records.py makes of the
    committed records (no figure typed), and every record says how it was made."""
    import long_documents_records as made

    made.tables(check=True)
    assert "every records table as" in capsys.readouterr().out
    records = made.load()["records"]
    for r in records:
        assert r["date"] and (r["command"] or r.get("source")), r
        reviews = sum(b[0] for b in r["test"].values())
        assert reviews == r["recipe"]["test_size"] and all(0 <= b[1] <= b[0] for b in r["test"].values()), r
    assert len({made.key(r) for r in records}) == len(records), "a seed recorded twice"


def test_records_merge_by_seed_and_refuse_seeds_without_a_command(tmp_path, monkeypatch):
    import long_documents_records as made

    committed = tmp_path / "records.json"
    committed.write_text(json.dumps(dict(records=[], costs={}, side_by_side=None)))
    monkeypatch.setattr(made, "RECORDS", committed)
    monkeypatch.setattr(made, "REPO", tmp_path)
    seed = dict(run="original-n512-head_tail", seed=1, head="probe-mean", frozen_projections=False, corpus="x.tar.gz",
                n=512, valid=80.0, command="python studies/study_long_documents.py", date="2026-12-02",
                test={"<= 512": [2, 1], "> 512": [2, 2]})  # fmt: skip
    found = tmp_path / "out.json"
    found.write_text(json.dumps([seed, dict(seed, seed=2)]))
    made.add(found, "Pang & Lee", None)
    found.write_text(json.dumps([dict(seed, test={"<= 512": [2, 2], "> 512": [2, 2]})]))
    made.add(found, "Pang & Lee", "band W = 128")
    made.add(found, "Pang & Lee", None)  # seed 1 again: replaced, not added
    records = json.loads(committed.read_text())["records"]
    assert [(r["run"], r["seed"], made.accuracy(r)) for r in records] == [
        ("original-n512-head_tail", 1, 100.0), ("original-n512-head_tail", 2, 75.0),
        ("original-n512-head_tail [band W = 128]", 1, 100.0)]  # fmt: skip
    assert made.accuracy(records[1], longer_than=512) == 100.0
    found.write_text(json.dumps([dict(seed, command=None, date=None)]))
    with pytest.raises(SystemExit):
        made.add(found, "Pang & Lee", None)
