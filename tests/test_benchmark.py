"""scripts/benchmark_inference.py: FLOP counts, and a tiny grid end to end (fresh subprocess per
point) whose memory figures must show what each model stores."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import _common  # noqa: E402
import benchmark_inference as bench  # noqa: E402


def test_flops_of_base_widths_match_hand_count():
    n, d, f, layers, k = 1024, 768, 3072, 12, 256
    # RoBERTa layer: 8nd^2 = 4,831,838,208 + 4n^2d = 3,221,225,472 + 4ndf = 9,663,676,416
    assert bench.encoder_flops(n, d, f, layers) == 12 * 17_716_740_096 == 212_600_881_152
    # Linformer layer, layerwise: 4nd^2 = 2,415,919,104 + 4kd^2 = 603,979,776 + one E: 2knd = 402,653,184
    # + 4nkd = 805,306,368 + FFN 9,663,676,416
    assert bench.encoder_flops(n, d, f, layers, k, "layerwise") == 12 * 13_891_534_848
    # headwise: E and F, one more 2knd
    assert bench.encoder_flops(n, d, f, layers, k, "headwise") == 12 * (13_891_534_848 + 402_653_184)
    # mean pooling: no E matmul at all
    assert bench.encoder_flops(n, d, f, layers, k, "headwise", "mean") == 12 * (13_891_534_848 - 402_653_184)


def cpu_flash_flops(query, key, value, *args, **kwargs):
    return sdpa_flop_count(query, key, value)


# FlopCounterMode does not count the CPU flash-attention kernel by itself
CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_flops}


@pytest.mark.parametrize("model", ["roberta-fused", "roberta-explicit", "none/linear", "headwise/linear",
                                   "kv/linear", "layerwise/linear", "headwise/conv", "kv/mean"])  # fmt: skip
def test_flop_formula_matches_torch_flop_counter_on_built_model(model, tmp_path):
    n, d, f, heads, layers, k = 64, 32, 48, 4, 2, 16
    _common.write_dict(tmp_path, ["w"])
    flags = ["--encoder-layers", str(layers), "--encoder-embed-dim", str(d), "--encoder-ffn-embed-dim", str(f),
             "--encoder-attention-heads", str(heads), "--max-positions", str(n)]  # fmt: skip
    if model.startswith("roberta"):
        built, _ = _common.build_model("roberta_base", flags, tmp_path)
        if model == "roberta-explicit":
            assert _common.force_explicit_attention(built) == layers
        expected = bench.encoder_flops(n, d, f, layers)
    else:
        sharing, kind = model.split("/")
        extra = ["--compressed-dim", str(k), "--compress-sharing", sharing, "--compress-type", kind]
        built, _ = _common.build_model("linformer_roberta_base", flags + extra, tmp_path)
        expected = bench.encoder_flops(n, d, f, layers, k, sharing, kind)
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        built.eval()(torch.full((1, n), 4), features_only=True)
    assert counter.get_total_flops() == expected


def test_tiny_grid_end_to_end(tmp_path):
    out = tmp_path / "out"
    # widths chosen so that the n x n scores dominate RoBERTa-explicit's peak and the FFN
    # intermediate (n x 128) dominates the Linformer's
    heads, ffn, n_max = 8, 128, 64
    cmd = [sys.executable, str(SCRIPTS / "benchmark_inference.py"), "--lengths", "64", "--ks", "16",
           "--ffn-chunk-size", "0,8", "--encoder-layers", "1", "--encoder-embed-dim", "32",
           "--encoder-ffn-embed-dim", str(ffn), "--encoder-attention-heads", str(heads), "--threads", "1",
           "--repeats", "2", "--max-batch-budget-gb", "0.03", "--out-dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((out / "benchmark.json").read_text())
    points = {(bench.label(p["spec"]), p["spec"]["n"]): p for p in report["points"]}
    assert set(points) == {(m, n_max) for m in ("roberta-fused", "roberta-explicit", "linformer-k16",
                                                "linformer-k16-chunk8")}  # fmt: skip
    assert all(p["status"] == "ok" and len(p["seconds"]) == 2 for p in points.values())
    peak = {key: p["peak_bytes"] for key, p in points.items()}
    # the explicit path holds the fp32 n x n scores of every head; the fused kernel never does
    assert peak["roberta-explicit", n_max] - peak["roberta-fused", n_max] >= heads * n_max * n_max * 4
    # chunking the FFN over 8 positions removes most of its n x ffn intermediate
    assert peak["linformer-k16", n_max] - peak["linformer-k16-chunk8", n_max] >= (n_max - 8) * ffn * 4
    batches = {key: p["max_batch"] for key, p in points.items()}
    assert 0 < batches["roberta-explicit", n_max] < batches["roberta-fused", n_max]
    assert batches["linformer-k16-chunk8", n_max] > batches["linformer-k16", n_max]

    rows = {(r["model"], r["n"]): r for r in bench.summarize(report)}
    row = rows["linformer-k16", n_max]
    assert row["time_vs_fused"] == pytest.approx(bench.ms_per_seq(points["roberta-fused", n_max])
                                                 / bench.ms_per_seq(points["linformer-k16", n_max]))  # fmt: skip
    assert row["flop_ideal"] == pytest.approx(bench.encoder_flops(64, 32, ffn, 1) / bench.encoder_flops(
        64, 32, ffn, 1, 16, "layerwise"))  # fmt: skip
    table = (out / "benchmark.md").read_text()
    assert "| 64 | 16 | linformer-k16-chunk8 |" in table and "roberta-explicit" in table
    assert (out / "benchmark.csv").read_text().count("\n") == 1 + len(points)
    assert (out / "time_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --resume reuses every finished point instead of measuring again
    proc = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((out / "benchmark.json").read_text())
    assert [p["seconds"] for p in again["points"]] == [p["seconds"] for p in report["points"]]


def test_points_over_the_memory_limit_are_skipped_and_reported(tmp_path, capsys):
    bench.main(["--lengths", "1024", "--ks", "128", "--memory-limit-gb", "0.01", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert [p["status"] for p in report["points"]] == ["skipped"] * 3
    assert "skipped: estimated" in (tmp_path / "benchmark.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--baselines", "fused,flash"], "--baselines: unknown"),
    (["--compress-type", "mean", "--lengths", "1000", "--ks", "128"], "needs n divisible by k: n=1000"),
    (["--encoder-embed-dim", "100"], "not divisible by --encoder-attention-heads 12"),
])  # fmt: skip
def test_bad_arguments_fail_naming_the_value(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        bench.main(argv + ["--out-dir", str(tmp_path)])
