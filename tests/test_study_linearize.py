"""studies/study_linearize.py end to end on a tiny imported BERT (2 layers, 512 positions: the
study measures the teacher's spectrum at n = 128, 256 and 512 whatever runs it makes; the first
layer's attention made sharp, so that the layers' spectra differ and k = 16 is not exact): two of its
n = 128 runs into a fresh --out, the teacher and one run finetuned on a tiny SST-2, the report,
and a rerun that finds everything done. Data: the bundled sample (WikiText-2, SST-2) and an
STS-B dev.tsv made here of SST-2 sentences."""

import json
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import ENV, STUDIES
from test_import_hf import save_tiny, transformers  # skips this module too without transformers (the hf extra)

import study_linearize
from linformer_tools import checkpoints
from linformer_tools.common import SAMPLE

RUN, SPECTRUM_RUN = "n128-k16-exact", "n128-spectrum-k16-exact"
TEACHER = "teacher-n128"


def study(*argv):
    """The study as a user runs it: (exit status, its output and errors)."""
    done = subprocess.run(
        [sys.executable, STUDIES / "study_linearize.py", *map(str, argv)], env=ENV, capture_output=True, text=True
    )
    return done.returncode, done.stdout + done.stderr


def sharp_first_layer(folder):
    """A tiny BERT of 512 positions whose first layer's attention is sharp (queries scaled up, a
    high-rank spectrum) and whose second layer's is flat (a random init's: rank one)."""
    original = save_tiny(folder, "bert", head=False, max_position_embeddings=512)
    model = transformers.BertModel.from_pretrained(original)
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight.mul_(30)
    model.save_pretrained(original)
    return original


def head(src, dst, lines):
    """The first ``lines`` lines of src written to dst."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[:lines]))
    return dst


def sts_dev(path):
    """A GLUE STS-B dev.tsv (its header) of SST-2 sentences: each with itself (5), with its first
    half (3) and with another sentence (0)."""
    sentences = [line.rsplit("\t", 1)[0].strip() for line in (SAMPLE / "glue/SST-2/dev.tsv").read_text().splitlines()]
    sentences = [s for s in sentences[1:] if len(s.split()) >= 6][:24]
    rows = ["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"]
    for i, s in enumerate(sentences[:12]):
        words = s.split()
        pairs = ((s, 5.0), (" ".join(words[: len(words) // 2]), 3.0), (sentences[12 + i], 0.0))
        rows += [f"{len(rows)}\tmain-captions\tx\t2012\t0\tnone\tnone\t{s}\t{other}\t{score}" for other, score in pairs]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(the study's command, its folder, its output) after one run into a fresh --out."""
    root = tmp_path_factory.mktemp("study_linearize")
    hf = sharp_first_layer(root / "hf")
    wikitext = root / "wikitext"
    head(SAMPLE / "wikitext-2/wiki.train.tokens", wikitext / "wiki.train.tokens", 300)
    head(SAMPLE / "wikitext-2/wiki.valid.tokens", wikitext / "wiki.valid.tokens", 120)
    glue = root / "glue"  # SST-2 alone: --tasks SST-2 once needed CoLA's files too
    for split in ("train.tsv", "dev.tsv"):
        head(SAMPLE / "glue" / "SST-2" / split, glue / "SST-2" / split, 65)
    out = root / "study"
    assert not out.exists()  # a fresh --out: its runs/ folder is made by the first run's log
    cmd = ["--hf-dir", hf, "--wikitext", wikitext, "--sts", sts_dev(root / "sts-dev.tsv"), "--out", out]
    cmd += ["--runs", RUN, SPECTRUM_RUN, "--spectrum-sequences", 1, "--short-steps", 4]
    cmd += ["--glue", glue, "--tasks", "SST-2", "--train-rows", 32, "--finetune-epochs", 1, "--seeds", 1]
    cmd += ["--finetune", RUN]
    code, output = study(*cmd)
    assert code == 0, output[-4000:]
    return cmd, out, output


@pytest.mark.slow(minutes=2)  # the module's study: about 70 s on one thread
def test_a_fresh_study_reports_its_runs_and_their_finetuning(made):
    """Into a --out that does not exist yet (its first run's log once failed for want of OUT/runs):
    the runs' folders and logs, their fidelity (STS-B Spearman of a model, the teacher's) and
    the finetuned SST-2 accuracy of the run and of the teacher, in results.json and report.md."""
    _, out, output = made
    for name in (RUN, SPECTRUM_RUN):
        assert f"{name}: linearize.py" in output
        assert (out / "runs" / name / "checkpoint.pt").is_file() and (out / "runs" / name / f"{TEACHER}.pt").is_file()
        assert (out / "runs" / f"{name}.log").is_file() and not (out / "runs" / f"{name}.log.partial").exists()
        assert "distillation" in (out / "runs" / f"{name}.log").read_text()
    for n in (128, 256, 512):
        assert json.loads((out / "spectrum" / f"n{n}" / "spectrum.json").read_text())["seq_len"] == n
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == [RUN, SPECTRUM_RUN]
    report = (out / "report.md").read_text()
    teacher_sts = results["runs"][RUN]["teacher_sts"]
    assert 0.3 < teacher_sts <= 1, teacher_sts  # identical pairs score highest for any encoder
    assert f"Teacher STS-B dev Spearman (zero-shot, mean pooling, n=128): {teacher_sts:.4f}" in report
    assert report.startswith(f"# Linearizing {(out.parent / 'hf').resolve()}: results")  # not a fixed name
    assert "32-row training subset, 1 epoch, lr" in report
    for name, r in results["runs"].items():
        assert r["args"]["compress_length_norm"] == "exact" and r["args"]["distill_steps"] == 4, r["args"]
        assert r["args"]["max_positions"] == 128 and r["args"]["batch_blocks"] == 16
        assert set(r["stages"]) == {"converted", "transfer", "distillation"}
        distilled = r["stages"]["distillation"]["fidelity"]
        assert 0 < distilled["cosine"] <= 1 and -1 <= distilled["sts"] <= 1, distilled
        row = next(line for line in report.splitlines() if line.startswith(f"| {name} |"))
        assert f"{distilled['cosine']:.3f}" in row and f"{distilled['sts']:.4f}" in row, row
    # finetuned: the run and the teacher it was made from, one seed each, on SST-2 only
    settings = json.loads((out / "finetune" / "settings.json").read_text())
    assert settings == {"SST-2": {"train_rows": 32, "finetune_epochs": 1, "finetune_lr": 1e-4}}
    assert sorted(p.name for p in (out / "finetune").iterdir() if p.is_dir()) == sorted([RUN, TEACHER])
    finetuned = results["finetune"]
    rows = {line.split(" | ")[0][2:]: line for line in report.splitlines() if line.startswith("| ")}
    for name in (TEACHER, RUN):
        (accuracy,) = finetuned[name]["SST-2"]
        assert 0 <= accuracy <= 100 and finetuned[name]["CoLA"] == [], finetuned
        assert f"| {accuracy:.1f} ± 0.0 ({accuracy:.1f}) |" in rows[name], rows[name]
    gap = statistics.mean(finetuned[RUN]["SST-2"]) - statistics.mean(finetuned[TEACHER]["SST-2"])
    assert rows[RUN].endswith(f"| {gap:+.1f} | - | - |"), rows[RUN]


@pytest.mark.slow
def test_the_spectrum_run_gets_per_layer_k_at_the_requested_mean(made):
    """n128-spectrum-k16-exact: the k per layer the study passed to linearize.py is the one the
    teacher's spectrum at n = 128 gives, at a mean of 16, and the Linformer was built with it."""
    _, out, _ = made
    passed = json.loads((out / "runs" / SPECTRUM_RUN / "report.json").read_text())["args"]["layer_compressed_dims"]
    dims = [int(k) for k in passed.split(",")]
    assert len(dims) == 2 and statistics.mean(dims) == 16, dims
    assert dims[0] > dims[1] == 8, dims  # the flat layer (a spectrum of rank one) held at 8, the sharp one the rest
    spectrum = json.loads((out / "spectrum" / "n128" / "spectrum.json").read_text())
    assert passed == study_linearize.spectrum_dims(spectrum, 16, 128)
    ns = checkpoints.model_namespace(checkpoints.read_checkpoint(out / "runs" / SPECTRUM_RUN / "checkpoint.pt"))
    assert ns.layer_compressed_dims == passed


@pytest.mark.slow
def test_a_rerun_finds_everything_done(made):
    """The same command again: no run, spectrum or finetuning is redone (files untouched), and the
    report is rewritten with the same numbers."""
    cmd, out, _ = made
    kept = [out / "runs" / name / "checkpoint.pt" for name in (RUN, SPECTRUM_RUN)]
    kept += [out / "runs" / f"{RUN}.log", out / "spectrum" / "n512" / "spectrum.json"]
    kept += [out / "finetune" / name / "SST-2-seed1.log" for name in (RUN, TEACHER)]
    before = {path: path.stat().st_mtime_ns for path in kept}
    results = json.loads((out / "results.json").read_text())
    code, output = study(*cmd)
    assert code == 0, output[-4000:]
    assert "linearize.py" not in output and "finetuning, seed" not in output, output[-4000:]
    assert {path: path.stat().st_mtime_ns for path in kept} == before
    assert json.loads((out / "results.json").read_text()) == results
    # a finished run made with other settings is refused, not kept as if it were this command's
    steps = cmd.index("--short-steps")
    code, output = study(*cmd[:steps], "--short-steps", 5, *cmd[steps + 2 :])
    assert code != 0 and "another --short-steps" in output and "--distill-steps 4" in output, output[-2000:]
    assert {path: path.stat().st_mtime_ns for path in kept} == before
