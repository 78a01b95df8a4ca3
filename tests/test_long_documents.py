"""Long documents (README: "Long documents"): the documented path from a model pretrained at n
to predictions on whole reviews at n' = 4n: extend_max_positions.py -> pretrain.sh --from
(configs/pretraining/extend.yaml) -> finetune.sh imdb -> the hub's predict (the truncation
task itself: tests/test_truncation.py). Data: the bundled sample (data/sample/imdb: 48 real
reviews in the aclImdb layout) through data-prep, as a user's would go."""

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ENV, SCRIPTS, STUDIES

from linformer_tools import checkpoints
from linformer_tools.common import REPO, SAMPLE
from linformer_tools.logs import records
from linformer_tools.probe import PENALTIES

from common import sh
from long_documents import data as reads
from long_documents import report as reports
from long_documents import runs as makes

DP = REPO / "data-prep"
N, LONG_N = 64, 256  # the long path: pretrained at n = 64, extended to 256


def run(cmd, cwd=None, timeout=900):
    """Run a command with this Python as $PYTHON (the launchers and data-prep wrappers run it)."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def prep(script, *args):
    run([DP / script, *args, "--workers", 1])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The bundled sample's corpus, a 500-piece sentencepiece model, its data-bin, and IMDB-bin
    of the bundled reviews (whole, as data-prep keeps them)."""
    out = tmp_path_factory.mktemp("long")
    wt = SAMPLE / "wikitext-2"
    prep("corpus.sh", "--out", out / "corpus", "--valid-docs", 2, "--wikitext", wt / "wiki.train.tokens")
    prep("spm.sh", "train", "--corpus", out / "corpus/train.txt", "--out", out / "spm", "--vocab-size", 500)
    spm_model, srcdict = out / "spm/spm.model", out / "spm/dict.txt"
    texts = [out / "corpus/train.txt", out / "corpus/valid.txt"]
    prep(
        "spm.sh", "encode", "--model", spm_model, "--inputs", *texts, "--outputs", out / "train.spm", out / "valid.spm"
    )
    binarize = ["--train", out / "train.spm", "--valid", out / "valid.spm", "--srcdict", srcdict]
    prep("binarize.sh", *binarize, "--destdir", out / "bin", "--shards", 1)
    tarball = SAMPLE / "imdb/aclImdb_sample.tar.gz"
    prep(
        "imdb.sh",
        "--tarball",
        tarball,
        "--spm-model",
        spm_model,
        "--srcdict",
        srcdict,
        "--destdir",
        out,
        "--valid-size",
        8,
    )
    return out


def documents(data):
    """Each training review as fairseq binarized it (its tokens and </s>), with <s> in front."""
    from fairseq.data import Dictionary, data_utils

    d = Dictionary.load(str(data / "IMDB-bin/input0/dict.txt"))
    reviews = data_utils.load_indexed_dataset(str(data / "IMDB-bin/input0/train"), d)
    return [torch.cat([torch.tensor([0]), reviews[i]]) for i in range(len(reviews))]


def test_the_long_path_from_n_to_whole_reviews_at_4n(data, tmp_path):
    """Pretrain at n = 64, extend to 256, continue pretraining at 256 through pretrain.sh --from,
    finetune on IMDB at 256, and predict a 200-token review alone and inside a padded batch."""
    tiny = ["model.encoder_layers=2", "model.encoder_embed_dim=32", "model.encoder_ffn_embed_dim=64"]
    tiny += ["model.encoder_attention_heads=2", "common.log_interval=1", "dataset.num_workers=0"]
    cpu = ["--cpu", "--batch-size", "8", "--global-batch", "8"]
    pretrained = tmp_path / "pretrain"
    run(
        [SCRIPTS / "pretrain.sh", *cpu, "--save-dir", pretrained, "quickstart", data / "bin/shard0", *tiny]
        + [f"task.tokens_per_sample={N}", "model.compressed_dim=16", "optimization.max_update=20"]
    )

    extended = tmp_path / f"n{LONG_N}.pt"
    run(
        [sys.executable, SCRIPTS / "extend_max_positions.py", pretrained / "checkpoint_last.pt", extended]
        + ["--max-positions", LONG_N]
    )

    # continued pretraining: the model (n', k, sizes) is the checkpoint's; a fresh optimizer
    out = run(
        [SCRIPTS / "pretrain.sh", *cpu, "--from", extended, "extend", data / "bin/shard0"]
        + ["optimization.max_update=4", "common.log_interval=1", "dataset.num_workers=0"],
        cwd=tmp_path,
    ).stdout
    continued = tmp_path / "checkpoints/extend" / f"n{LONG_N}"
    assert f"save dir: {continued}" in out
    assert f"Loaded checkpoint {extended}" in (continued / "hydra_train.log").read_text()
    state = torch.load(continued / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["cfg"]["task"]["tokens_per_sample"] == state["cfg"]["model"]["max_positions"] == LONG_N
    assert state["optimizer_history"][-1]["num_updates"] == 4
    losses = [r["loss"] for r in records(continued / "hydra_train.log", "train_inner")]
    assert losses and all(np.isfinite(losses))

    # finetuning at n': reviews up to 256 tokens whole, longer ones head + tail
    save = tmp_path / "imdb"
    run(
        [SCRIPTS / "finetune.sh", *cpu, "--data", data / "IMDB-bin", "--save-dir", save, "imdb"]
        + [continued / "checkpoint_last.pt", "optimization.max_update=6", "lr_scheduler.warmup_updates=1"],
        cwd=tmp_path,
    )
    cfg = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)["cfg"]
    assert (cfg["task"]["_name"], cfg["task"]["truncation"], cfg["task"]["max_positions"]) == (
        "long_sentence_prediction",
        "head_tail",
        LONG_N,
    )

    from fairseq.data import data_utils

    from linformer_fairseq import LinformerRobertaModel

    hub = LinformerRobertaModel.from_pretrained(
        str(save),
        "checkpoint_last.pt",
        str(data / "IMDB-bin"),
        bpe="sentencepiece",
        sentencepiece_model=str(data / "spm/spm.model"),
    ).eval()
    reviews = documents(data)  # <s> review </s>, as the hub's encode gives them
    review = min(reviews, key=lambda r: abs(len(r) - 200))
    longest = max(reviews, key=len)
    longer = torch.cat([longest[: LONG_N - 1], longest[-1:]])  # n' tokens: the row that pads the other
    assert 150 <= len(review) < len(longer) == LONG_N
    head = "sentence_classification_head"
    with torch.no_grad():
        alone = hub.predict(head, review, return_logits=True)
        batch = data_utils.collate_tokens([longer, review], pad_idx=hub.task.source_dictionary.pad())
        together = hub.predict(head, batch, return_logits=True)
    torch.testing.assert_close(together[1:], alone, atol=1e-5, rtol=0)
    too_long = torch.cat([review] * 2)
    with pytest.raises(Exception, match=str(LONG_N)):  # past n': an error naming the model's length
        hub.predict(head, too_long)


def tarball_with_unlabeled(path):
    """The bundled reviews plus a train/unsup of WikiText-2 sample paragraphs (aclImdb's layout)."""
    import io
    import tarfile

    with tarfile.open(SAMPLE / "imdb/aclImdb_sample.tar.gz") as source, tarfile.open(path, "w:gz") as tar:
        for member in source:
            tar.addfile(member, source.extractfile(member) if member.isfile() else None)
        lines = [line for line in (SAMPLE / "wikitext-2/wiki.train.tokens").read_text().splitlines() if len(line) > 200]
        for i, line in enumerate(lines):
            info = tarfile.TarInfo(f"aclImdb/train/unsup/{i}_0.txt")
            info.size = len(line.encode())
            tar.addfile(info, io.BytesIO(line.encode()))
    return path


@pytest.mark.slow(minutes=3)
def test_long_document_study_of_an_imported_encoder(tmp_path):
    """--hf-dir on a tiny BERT (n = 64): the original truncated head+tail (--runs leaves out head
    alone) and extended to n' = 128 with full attention, a Linformer linearized at n' (k = n'/4)
    on the unlabeled reviews, each finetuned and predicting every test review; the
    linearization's fidelity and each run's cost are reported, and a rerun redoes nothing."""
    from test_import_hf import save_tiny

    hf = save_tiny(tmp_path / "hf", "bert", head=False)
    out = tmp_path / "long"
    cmd = [sys.executable, STUDIES / "study_long_documents.py", "--hf-dir", hf, "--out", out]
    cmd += ["--imdb", tarball_with_unlabeled(tmp_path / "imdb.tar.gz"), "--train-size", 16, "--test-size", 8]
    cmd += ["--valid-size", 4, "--epochs", 1, "--batch", 4, "--seeds", 1, "--factors", 2, "--ks", "n/4"]
    cmd += ["--linearize-steps", 6, "--linearize-tokens", 256, "--transfer-steps", 4, "--valid-blocks", 2]
    cmd += ["--timing-seconds", 0.2, "--step-tokens", 256]  # at n' = 128 an update of 4 takes 2 steps of 2
    refused = subprocess.run([*map(str, cmd), "--runs", "original-n64-tail"], capture_output=True, text=True)
    assert refused.returncode != 0 and "original-n64-tail: not runs of this study" in refused.stderr
    cmd += ["--runs", "linformer-n128-k32-s6", "original-n128", "original-n64-head_tail"]
    cmd += ["--linearize-flags", "--lr", "5e-4"]
    run(cmd)
    from fairseq.data import data_utils

    test_set = data_utils.load_indexed_dataset(str(out / "data" / "IMDB-bin" / "input0" / "test"))
    results = json.loads((out / "results.json").read_text())  # the report's order, not --runs' order
    assert list(results) == ["original-n64-head_tail", "original-n128", "linformer-n128-k32-s6"]
    for name, r in results.items():
        assert len(r["all"]) == 1 and 0 <= r["all"][0] <= 100, (name, r)
        assert r["seconds_per_update"] > 0 and r["peak_mb"] > 0 and r["documents_per_second"] > 0
        step = 4 if name == "original-n64-head_tail" else 2
        assert r["reviews_per_step"] == step, (name, r)
        plan = f"batch: {step} sequences per GPU x update_freq {4 // step} x world size 1 = global batch 4"
        assert plan in (out / "runs" / name / "seed1.log").read_text(), name
        rows = json.loads((out / "runs" / name / "seed1" / "predictions.json").read_text())
        assert len(rows) == 8 and sum(length > N for length, _, _ in rows) >= 4  # whole lengths recorded
        # predicted in batches by length, reported in the test set's order
        assert [length for length, _, _ in rows] == [size + 1 for size in test_set.sizes]
    # the Linformer's k and n' are the run's, its teacher the original extended to n'
    linearized = out / "linearized" / "n128-k32-s6"
    stages = json.loads((linearized / "report.json").read_text())["stages"]
    assert results["linformer-n128-k32-s6"]["linearize"] == {s: v["fidelity"]["cosine"] for s, v in stages.items()}
    assert set(stages) == {"converted", "transfer", "distillation"}
    ns = checkpoints.model_namespace(checkpoints.read_checkpoint(linearized / "checkpoint.pt"))
    assert (ns.max_positions, ns.compressed_dim) == (128, 32)
    assert (linearized / "teacher-n128.pt").is_file()
    assert len((out / "unsup.txt").read_text().splitlines()) > 10
    report = (out / "report.md").read_text()
    assert "| linformer-n128-k32-s6 |" in report
    # named by its tarball: only aclImdb's own is called IMDB (Pang & Lee's comes in the same layout)
    assert "imdb.tar.gz 16 train / 8 test reviews" in report and "IMDB" not in report, report[:500]
    # its fidelity to the original at n' on test reviews, by length: those it reads whole, 24 a bin at most
    fidelity = results["linformer-n128-k32-s6"]["fidelity_by_length"]
    lengths = [size + 1 for size in test_set.sizes]
    assert {label: b["reviews"] for label, b in fidelity.items()} == {
        "<= 64": min(24, sum(x <= 64 for x in lengths)), "65-128": min(24, sum(64 < x <= 128 for x in lengths)),
        "> 128": 0}  # fmt: skip
    assert all(0 < b["cosine"] < 1 for b in fidelity.values() if b["reviews"]), fidelity
    (out / "timing" / "original-n128.json").unlink()  # --no-timing: its cost is left out, not measured under load
    again = run([*cmd[: cmd.index("--runs")], "--no-timing", "--probe", *cmd[cmd.index("--runs") :]]).stdout
    assert "finetuning, seed" not in again and "linearizing" not in again, again[-2000:]
    # --probe: every finished run's frozen model probed, each test review scored in the test set's order
    for name in results:
        probe = json.loads((out / "probe" / f"{name}.json").read_text())
        assert [length for length, _ in probe["test"]] == lengths and probe["penalty"] in PENALTIES
        assert [length for length, _ in probe["first"]["test"]] == lengths and probe["first"]["penalty"] in PENALTIES
        reported = json.loads((out / "results.json").read_text())[name]["probe"]
        assert reported["all"] == 100 * sum(right for _, right in probe["test"]) / 8, reported
    assert "Linear probe (--probe)" in again and "| original-n64-head_tail | " in again.split("Linear probe")[1]
    only = run([*cmd[: cmd.index("--runs")], "--no-timing", "--probe-only", "--runs", "original-n64-head"]).stdout
    assert "original-n64-head: linear probe" in only and "finetuning, seed" not in only, only[-2000:]
    assert not (out / "runs" / "original-n64-head").exists()
    assert only.split("Linear probe")[1].split("| original-n64-head | ")[1].splitlines()[0].endswith(" | - |")
    assert not (out / "timing" / "original-n128.json").exists()
    assert "| original-n128 | 128 | head_tail 128 |" in again and "| not timed | not timed | not timed |" in again
    assert "seconds_per_update" not in json.loads((out / "results.json").read_text())["original-n128"]
    # the folder's name does not hold --linearize-flags: one made with others is refused, not reused
    other = [*cmd[: cmd.index("--linearize-flags")], "--linearize-flags", "--lr", "1e-3"]
    refused = subprocess.run(list(map(str, other)), capture_output=True, text=True)
    assert refused.returncode != 0 and "--lr 5e-4, not " in refused.stderr, refused.stderr[-2000:]
    # --first-seed: a study continued elsewhere finetunes only the seeds it names; the report has all
    seeds = cmd.index("--seeds")
    seed2 = [*cmd[:seeds], "--seeds", 2, "--first-seed", 2, *cmd[seeds + 2 : cmd.index("--runs")]]
    refused = subprocess.run([*map(str, seed2), "--first-seed", "3"], capture_output=True, text=True)
    assert refused.returncode != 0 and "--first-seed 3 is past --seeds 2" in refused.stderr
    log = run([*seed2, "--no-timing", "--runs", "original-n64-head_tail"]).stdout
    assert "original-n64-head_tail: finetuning, seed 2" in log and "finetuning, seed 1" not in log, log[-2000:]
    both = json.loads((out / "results.json").read_text())["original-n64-head_tail"]
    assert len(both["all"]) == 2 and len(both["valid"]) == 2
    assert all(v in (0, 25, 50, 75, 100) for v in both["valid"]), both  # accuracy on 4 validation reviews
    assert both["test_of_best_on_validation"] == both["all"][both["valid"].index(max(both["valid"]))]
    # --lp-ft: the Linformer finetuned from the head of a probe of the mean of its states, kept to the
    # end (--pooler-tokens), predicting with the checkpoint best on validation; another --out, the same models
    lp = tmp_path / "lp"
    lp.mkdir()
    for made in ("data", "original", "original.log", "linearized", "unsup.txt"):
        (lp / made).symlink_to(out / made)
    lp_ft = [*cmd[: cmd.index("--out")], "--out", lp, *cmd[cmd.index("--out") + 2 : cmd.index("--runs")]]
    lp_ft += ["--no-timing", "--lp-ft", "--pooler-tokens", "mean", "--predict-with", "best"]
    lp_ft += ["--finetune-overrides", "++task.log_parameter_groups=true"]
    # and the original over chunks of n = 64 of reviews of up to n' = 128, its probe's head reading them so too
    lp_ft += ["--runs", "linformer-n128-k32-s6", "original-n64-chunks-n128"]
    run([*lp_ft, *cmd[cmd.index("--linearize-flags") :]])
    probed = (lp / "probed" / "linformer-n128-k32-s6.log").read_text()
    assert "probe of the mean final states" in probed and "agreeing with the probe on 100.0%" in probed, probed
    finetuned = (lp / "runs" / "linformer-n128-k32-s6" / "seed1.log").read_text()
    assert "'pooler_tokens': mean," in finetuned and "gshare_projections=" in finetuned, finetuned[-2000:]
    assert len(json.loads((lp / "runs" / "linformer-n128-k32-s6" / "seed1" / "predictions.json").read_text())) == 8
    logged = (lp / "probed" / "original-n64-chunks-n128.log").read_text().splitlines()
    chunked = json.loads(next(line for line in reversed(logged) if line.startswith("{")))  # probe_head's report
    assert (chunked["chunk_length"], chunked["max_positions"], chunked["agreement"]) == (64, 128, 100), chunked
    finetuned = (lp / "runs" / "original-n64-chunks-n128" / "seed1.log").read_text()
    assert "'chunk_length': 64," in finetuned and "'max_positions': 128," in finetuned, finetuned[-2000:]
    # one record a seed: its head and recipe, the command with this machine's paths named, the date
    records = {r["run"]: r for r in json.loads((lp / "records.json").read_text())}
    assert set(records) == {"linformer-n128-k32-s6", "original-n64-chunks-n128"}, records
    for name, r in records.items():
        rows = json.loads((lp / "runs" / name / "seed1" / "predictions.json").read_text())
        assert (r["head"], r["seed"], r["reads"], r["recipe"]["predict_with"]) == ("probe-mean", 1, 128, "best")
        bins = reads.length_bins(N, [2])  # <= 64, 65-128, > 128, by each review's whole length
        assert list(r["test"]) == ["<= 64", "65-128", "> 128"], r["test"]
        assert r["test"] == {label: [sum(keep(x) for x, _, _ in rows), sum(c for x, _, c in rows if keep(x))]
                             for label, keep in bins}, r  # fmt: skip
        assert " --out OUT " in r["command"] and str(tmp_path) not in r["command"] and r["date"].startswith("20")
    assert "++model.chunk_length=64" in records["original-n64-chunks-n128"]["recipe"]["overrides"]
    # --read-exact: each Linformer at n' also switched to exact length handling, the same weights
    listed = subprocess.run([*map(str, cmd[: cmd.index("--runs")]), "--read-exact", "--runs", "none"],
                            capture_output=True, text=True).stderr  # fmt: skip
    assert "its runs are" in listed and " linformer-n128-k32-s6-exact" in listed, listed[-2000:]
    # a seed's validation accuracy is that of its last validation, none if it logged none
    logged = tmp_path / "logs" / "runs" / "run" / "seed1" / "hydra_train.log"
    logged.parent.mkdir(parents=True)
    line = "[2026-11-27 06:24:50][valid][INFO] - epoch 00{} | valid on 'valid' subset | accuracy {} | best_accuracy 78"
    logged.write_text(line.format(1, 78) + "\n" + line.format(2, 50.5) + "\n")
    logs = argparse.Namespace(out=tmp_path / "logs")
    assert (reports.validation_accuracy(logs, "run", 1), reports.validation_accuracy(logs, "run", 2)) == (50.5, None)
    # the fidelity's reviews are read as finetuning reads them: <s> review </s>
    reviews = reads.test_reviews(argparse.Namespace(imdb_bin=out / "data" / "IMDB-bin"), 128)
    assert [len(review) for review in reviews] == [x for x in lengths if x <= 128]
    assert all(review[0] == 0 and review[-1] == 2 and not review[1:-1].le(2).any() for review in reviews)
    # and the probe's: cut head+tail as the run's finetuning cuts them, n/4 = 16 tokens of the head kept
    at = argparse.Namespace(imdb_bin=out / "data" / "IMDB-bin", n=64)
    cut, labels = reads.labeled_reviews(at, "test", 64, "head_tail")
    whole = reads.test_reviews(at, 10**9)
    assert sorted(labels) == [0] * 4 + [1] * 4  # stratified, as class indices
    for review, full in zip(cut, whole):
        assert len(review) == min(64, len(full))
        if len(full) > 64:
            torch.testing.assert_close(review, torch.cat([full[:17], full[-47:]]), rtol=0, atol=0)
    exact = checkpoints.read_checkpoint(makes.read_exact(linearized / "checkpoint.pt"))
    distilled = checkpoints.read_checkpoint(linearized / "checkpoint.pt")
    assert checkpoints.model_namespace(exact).compress_length_norm == "exact"
    for key, value in distilled["model"].items():
        want = torch.tensor(-2.0) if key.endswith("length_norm_power") else value
        torch.testing.assert_close(exact["model"][key], want, rtol=0, atol=0, msg=key)
    # --resample-probs: an -exact run finetuned reading short reviews through the projection now and then
    mixed = "linformer-n128-k32-s6-exact-resample0.5"
    linearize_flags = cmd[cmd.index("--linearize-flags") :]  # what its linearization was made with
    run([*cmd[: cmd.index("--runs")], "--no-timing", "--read-exact", "--resample-probs", "0.5", "--runs", mixed,
         *linearize_flags])  # fmt: skip
    config = (out / "runs" / mixed / "seed1.log").read_text()
    assert "'compress_resample_prob': 0.5" in config and "'compress_length_norm': exact" in config
    assert len(json.loads((out / "results.json").read_text())[mixed]["all"]) == 1


def test_a_study_step_logs_into_a_folder_not_made_yet(tmp_path):
    """A fresh study's first run logs to OUT/runs/NAME.log before anything made OUT/runs."""
    logfile = tmp_path / "runs" / "first.log"
    sh([sys.executable, "-c", "print('made')"], logfile)
    assert logfile.read_text() == "made\n" and not (tmp_path / "runs" / "first.log.partial").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_the_study_on_a_gpu_refuses_to_start_without_one(tmp_path):
    """--gpu where torch sees no GPU stops before any step, saying so."""
    imdb = tmp_path / "imdb.tar.gz"
    imdb.write_bytes(b"")
    cmd = [sys.executable, STUDIES / "study_long_documents.py", "--hf-dir", tmp_path, "--imdb", imdb, "--gpu"]
    refused = subprocess.run([*map(str, cmd), "--out", tmp_path / "out"], capture_output=True, text=True, env=ENV)
    assert refused.returncode == 2 and "--gpu: no GPU visible to torch" in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists()
