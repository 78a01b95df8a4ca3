"""The studies end to end at tiny size on the bundled sample. studies/study_quality.py: data,
pretraining, the short-input table, SST-2 and CoLA finetuning over seeds, timing and the report;
resuming a finished study redoes nothing; another study's settings in the same folder are
refused. studies/study_long_documents.py on its models and the bundled IMDB reviews: the
extension, continued pretraining (and the control's at n), truncated and whole-review finetuning,
the report."""

import json
import subprocess
import sys

import pytest
from conftest import SAMPLE, STUDIES, run

pytestmark = pytest.mark.slow(minutes=8)


def study(out, *extra):
    return [
        sys.executable,
        STUDIES / "study_quality.py",
        "--out",
        out,
        "--size",
        "tiny",
        "--wikitext",
        SAMPLE / "wikitext-2",
        "--books",
        SAMPLE / "books",
        "--glue",
        SAMPLE / "glue",
        "--train-rows",
        "200",
        "--finetune-epochs",
        "1",
        "--seeds",
        "2",
        "--eval-blocks",
        "20",
        "--valid-batches",
        "2",
        "--timing-seconds",
        "0.5",
        "--jobs",
        "2",
        "--threads",
        "1",
        *extra,
    ]


QUALITY_RUNS = ["--budget", "16", "--runs", "roberta", "linformer", "resample"]


@pytest.fixture(scope="module")
def quality_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "study"
    run(study(out, *QUALITY_RUNS), timeout=900)
    return out


def test_study_runs_end_to_end_and_resumes(quality_study):
    out = quality_study
    cmd = study(out, *QUALITY_RUNS)

    rows = {r["name"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert set(rows) == {"roberta", "linformer", "resample"}
    n, k, layers = 64, 16, 2
    for name, r in rows.items():
        curve = json.loads((out / "results.json").read_text())["curves"][name]
        assert [u for u, _ in curve] == list(range(2, 17, 2)), curve
        assert curve[-1][1] < curve[0][1], f"{name}: validation perplexity did not fall: {curve}"
        assert sorted(map(int, r["short"])) == [n // 16, n // 8, n // 4, n]
        assert all(0 < loss < 20 for loss in r["short"].values()), r["short"]
        assert len(r["SST-2"]) == 2 and all(0 <= a <= 100 for a in r["SST-2"]), r["SST-2"]
        assert len(r["CoLA"]) == 2 and all(-100 <= m <= 100 for m in r["CoLA"]), r["CoLA"]
        assert r["seconds_per_update"] > 0 and r["peak_mb"] > 0
    # same model but for E and F (k x n, two per layer under headwise sharing)
    assert rows["linformer"]["parameters"] - rows["roberta"]["parameters"] == 2 * k * n * layers
    assert rows["linformer"]["flags"].endswith("--compress-length-norm linear --compress-init normal")
    # resample shares the reference's pretraining (full blocks: the same model), not its short inputs
    linformer, resample = rows["linformer"], rows["resample"]
    assert resample["ppl"] == linformer["ppl"] and resample["short"][str(n)] == linformer["short"][str(n)]
    assert resample["short"][str(n // 16)] != linformer["short"][str(n // 16)]
    report = (out / "report.md").read_text()
    assert all(f"| {name} |" in report for name in rows)
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert len({line.count("|") for line in table}) == 1, table[:3]  # header, rule and rows: one column count
    assert (out / "perplexity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = run(cmd, timeout=300).stdout
    assert ": pretraining" not in again and " finetuning" not in again, again[-2000:]

    refused = subprocess.run(study(out, "--budget", "32", "--runs", "roberta"), capture_output=True, text=True)
    assert refused.returncode != 0 and "other settings" in refused.stderr, refused.stderr


def test_long_document_study_on_the_quality_studys_models(quality_study, tmp_path):
    out = tmp_path / "long"
    cmd = [sys.executable, STUDIES / "study_long_documents.py", "--quality", quality_study, "--out", out]
    cmd += ["--imdb", SAMPLE / "imdb" / "aclImdb_sample.tar.gz", "--train-size", 16, "--test-size", 8]
    # one seed (the quality study's test covers the mean over several), the Linformer only (the
    # full-attention extension: test_long_documents' imported encoder), head truncation left out
    cmd += ["--valid-size", 4, "--epochs", 1, "--batch", 4, "--seeds", 1, "--factors", 2]
    cmd += ["--models", "linformer", "--runs", "linformer-n128-u4", "linformer-n64-head_tail"]
    cmd += ["--continue-updates", 4, "--continue-tokens", 512, "--eval-blocks", 4]
    cmd += ["--timing-seconds", 0.5, "--jobs", 2, "--threads", 1]
    cmd = [str(c) for c in cmd]
    run(cmd, timeout=900)
    results = json.loads((out / "results.json").read_text())
    n = 64
    expected = ["linformer-n64-head_tail", "linformer-n128-u4"]
    assert list(results) == expected
    for name, r in results.items():
        assert len(r["all"]) == 1 and all(0 <= a <= 100 for a in r["all"]), (name, r)
        assert r["seconds_per_update"] > 0 and r["peak_mb"] > 0 and r["documents_per_second"] > 0
        # the length bins (<= 64, 65-128, > 128) split the 8 test reviews, each read by the seed
        bins = r["by_length"]
        assert list(bins) == ["<= 64", "65-128", "> 128"] and sum(b["reviews"] for b in bins.values()) == 8, bins
        assert all(len(b["accuracy"]) == (1 if b["reviews"] else 0) for b in bins.values()), bins
    # every test review is predicted once per seed, with its whole length recorded
    rows = json.loads((out / "runs" / f"linformer-n{2 * n}-u4" / "seed1" / "predictions.json").read_text())
    assert len(rows) == 8 and sum(length > n for length, _, _ in rows) >= 4
    assert not list((out / "runs").rglob("checkpoint*.pt"))  # finetuned checkpoints removed after predicting
    # further pretraining at n', its folder named by its length
    losses = json.loads((out / "continued" / f"linformer-n{2 * n}-u4" / "losses.json").read_text())
    assert set(losses) == {"before", "after"} and set(losses["before"]) == {str(n), str(2 * n)}
    assert results[f"linformer-n{2 * n}-u4"]["losses"] == losses and losses["after"] != losses["before"]
    refused = subprocess.run([*cmd, "--control"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--control with --quality is not available yet" in refused.stderr
    report = (out / "report.md").read_text()
    assert all(f"| {name} |" in report for name in expected) and "longer than 64:" in report
    assert (out / "accuracy_by_length.png").stat().st_size > 10_000
    again = run(cmd, timeout=300).stdout
    assert "finetuning, seed" not in again and ": continued pretraining at" not in again, again[-2000:]
