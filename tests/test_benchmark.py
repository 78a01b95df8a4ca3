"""scripts/benchmark.py: FLOP counts, bad input refused, and a tiny grid end to end (a fresh process per
point) whose memory figures must show what each model stores and whose tables must agree with its JSON;
the model FLOPs utilization's FLOPs and peaks (linformer_tools.mfu)."""

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import fairseq
import pytest
import torch
from conftest import ENV, REPO, SCRIPTS
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import benchmark as bench
from linformer_tools import mfu, models
from linformer_tools.benchmark_report import VOCAB_SIZE, encoder_flops, step_flops

TINY_SPEC = dict(
    mode="training",
    encoder_layers=1,
    encoder_embed_dim=32,
    encoder_ffn_embed_dim=64,
    encoder_attention_heads=4,
    n=32,
    k=8,
    ffn_chunk=0,
    local_window=0,
    compress_sharing="headwise",
    compress_type="linear",
    checkpoint_activations=False,
    device="cpu",
    model="linformer",
)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["linformer", "roberta-fused"])
def test_training_step_updates_the_model_and_learns_a_batch(model, dtype):
    """The timed training step is a real update (the same code runs on CUDA with --dtype bf16/fp16)."""
    torch.manual_seed(0)
    spec = dict(TINY_SPEC, model=model, dtype=dtype, k=8 if model == "linformer" else None)
    built = bench.build_point_model(spec)
    step = bench.training_step(built, spec, batch=4)
    before = {name: p.detach().clone() for name, p in built.named_parameters()}
    losses = [step().item() for _ in range(12)]
    assert all(p.dtype == bench.DTYPES[dtype] for p in built.parameters())
    assert not torch.equal(
        before["encoder.sentence_encoder.layers.0.fc1.weight"], built.encoder.sentence_encoder.layers[0].fc1.weight
    )
    assert losses[-1] < losses[0] - 0.03, losses  # the same batch again and again: its loss falls


def test_grid_puts_each_band_counted_once_beside_it():
    """--local-count-once adds a -once point after each band Linformer (none for W = 0 or the
    baselines), and that point's model counts the band once in every layer."""
    args = bench.build_parser().parse_args(
        ["--lengths", "32", "--ks", "8", "--local-windows", "0,8", "--local-count-once"]
    )
    specs = bench.make_grid(args)
    assert [s["label"] for s in specs] == [
        "roberta-fused", "roberta-explicit", "linformer-k8", "linformer-k8-w8", "linformer-k8-w8-once"
    ]  # fmt: skip
    once = dict(TINY_SPEC, **{key: specs[-1][key] for key in ("local_window", "local_count_once")}, dtype="fp32")
    layers = bench.build_point_model(once).encoder.sentence_encoder.layers
    assert [layer.self_attn.local_count_once for layer in layers] == [True]
    plain = bench.build_point_model(dict(once, local_count_once=False)).encoder.sentence_encoder.layers
    assert [layer.self_attn.local_count_once for layer in plain] == [False]


def test_flops_of_base_widths_match_hand_count():
    n, d, f, layers, k = 1024, 768, 3072, 12, 256
    # RoBERTa layer: 8nd^2 = 4,831,838,208 + 4n^2d = 3,221,225,472 + 4ndf = 9,663,676,416
    assert encoder_flops(n, d, f, layers) == 12 * 17_716_740_096 == 212_600_881_152
    # Linformer layer, layerwise: 4nd^2 = 2,415,919,104 + 4kd^2 = 603,979,776 + one E: 2knd = 402,653,184
    # + 4nkd = 805,306,368 + FFN 9,663,676,416
    assert encoder_flops(n, d, f, layers, k, "layerwise") == 12 * 13_891_534_848
    # headwise: E and F, one more 2knd
    assert encoder_flops(n, d, f, layers, k, "headwise") == 12 * (13_891_534_848 + 402_653_184)
    # mean pooling: no E matmul at all
    assert encoder_flops(n, d, f, layers, k, "headwise", "mean") == 12 * (13_891_534_848 - 402_653_184)


def test_mfu_flops_of_a_tiny_config_match_hand_count():
    """2 layers x 128 (FFN 512), n = 128, k = 32, V = 1,000, 15% masked: each term counted by hand."""
    n, d, f, layers, k, vocab = 128, 128, 512, 2, 32, 1000
    qo, ffn = 4 * 128 * 128**2, 4 * 128 * 128 * 512  # q and out maps 8,388,608; FFN 33,554,432
    assert (qo, ffn) == (8_388_608, 33_554_432)
    head = 2 * (0.15 * 128) * (128**2 + 128 * 1000)  # masked-LM head on 19.2 positions: 5,544,345.6
    # Linformer, headwise: k/v maps on the 32 rows 4kd^2, E and F 2 x 2knd, QK^T + PV against the rows 4nkd,
    # each 2,097,152
    linformer_layer = qo + 3 * 2_097_152 + ffn
    assert linformer_layer == 48_234_496
    expected = 3 * (2 * linformer_layer + head)
    assert expected == pytest.approx(306_040_012.8)
    assert mfu.matmul_flops(n, d, f, layers, k, "headwise", vocab=vocab) == pytest.approx(expected, rel=1e-12)
    assert mfu.matmul_flops(n, d, f, layers, [k, k], "headwise", vocab=vocab) == pytest.approx(expected, rel=1e-12)
    # the forward alone; no head (vocab 0)
    assert mfu.matmul_flops(n, d, f, layers, k, vocab=vocab, training=False) == pytest.approx(expected / 3)
    assert mfu.matmul_flops(n, d, f, layers, k) == 3 * 2 * linformer_layer
    # kv and layerwise: one projection, 2knd less
    assert mfu.matmul_flops(n, d, f, layers, k, "kv") == 3 * 2 * (linformer_layer - 1_048_576)
    # RoBERTa: q/k/v/out maps 8nd^2 = 16,777,216, QK^T + PV 4n^2 d = 8,388,608
    roberta_layer = 2 * qo + 8_388_608 + ffn
    assert mfu.matmul_flops(n, d, f, layers, vocab=vocab) == pytest.approx(3 * (2 * roberta_layer + head))
    # a band of W = 16: its scores and values 4nWd = 1,048,576 and the positions' own k/v maps 4nd^2 = 8,388,608
    band = mfu.matmul_flops(n, d, f, layers, k, window=16) - mfu.matmul_flops(n, d, f, layers, k)
    assert band == 3 * 2 * (1_048_576 + 8_388_608)
    # the benchmark's training step counts the same (RoBERTa's vocabulary)
    spec = dict(TINY_SPEC, n=n, k=k, encoder_layers=layers, encoder_embed_dim=d, encoder_ffn_embed_dim=f)
    assert step_flops(spec) == pytest.approx(mfu.matmul_flops(n, d, f, layers, k, "headwise", vocab=VOCAB_SIZE))
    # MFU: FLOPs per second over the peak
    assert mfu.utilization(expected, 1e-6, 989e12) == pytest.approx(expected / 989e6)
    assert mfu.utilization(expected, 1e-6, None) is None and mfu.percent(0.41234) == "41.2%"


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H200", "fp16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-PCIE-40GB", "fp16", 312e12),
        ("NVIDIA H100 PCIe", "bf16", None),  # a lower peak, not in the table: no guess
        ("NVIDIA H200 NVL", "bf16", None),
        ("NVIDIA H100 80GB HBM3", "fp32", None),
    ],
)
def test_dense_peaks_by_gpu_name(name, dtype, peak):
    why, found = mfu.dense_peak(name, dtype)
    assert found == peak
    unknown = f"unknown GPU: no MFU ({name})"
    if peak is None:
        assert why == ("no MFU for fp32: the peaks are bf16/fp16's" if dtype == "fp32" else unknown)
    assert mfu.cuda_peak("cpu", dtype) == ("no MFU on cpu", None)


def cpu_flash_flops(query, key, value, *args, **kwargs):
    return sdpa_flop_count(query, key, value)


# FlopCounterMode does not count the CPU flash-attention kernel by itself
CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_flops}


@pytest.mark.parametrize(
    "model",
    ["roberta-fused", "roberta-explicit", "none/linear", "headwise/linear", "kv/linear", "layerwise/linear",
     "headwise/conv", "kv/mean"],
)  # fmt: skip
def test_flop_formula_matches_torch_flop_counter_on_built_model(model, tmp_path):
    n, d, f, heads, layers, k = 64, 32, 48, 4, 2, 16
    models.write_dict(tmp_path, ["w"])
    flags = f"--encoder-layers {layers} --encoder-embed-dim {d} --encoder-ffn-embed-dim {f} "
    flags += f"--encoder-attention-heads {heads} --max-positions {n}"
    if model.startswith("roberta"):
        built, _ = models.build_model("roberta_base", flags.split(), tmp_path)
        if model == "roberta-explicit":
            assert models.force_explicit_attention(built) == layers
        expected = encoder_flops(n, d, f, layers)
    else:
        sharing, kind = model.split("/")
        flags += f" --compressed-dim {k} --compress-sharing {sharing} --compress-type {kind}"
        built, _ = models.build_model("linformer_roberta_base", flags.split(), tmp_path)
        expected = encoder_flops(n, d, f, layers, k, sharing, kind)
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        built.eval()(torch.full((1, n), 4), features_only=True)
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("sharing", ["headwise", "none"])
def test_flops_of_a_local_band_are_its_ideal_plus_the_blocks_overlap(sharing, tmp_path):
    """The ideal counts W keys a query (4 n W d a layer) and the maps of every position's keys and values
    (4 n d^2, made anyway under sharing none); the blockwise band reads b + 2 * (W/2) keys a query
    (blocks of b = W/2): torch's count is the ideal plus that overlap."""
    n, d, f, heads, layers, k, window = 64, 32, 48, 4, 2, 16, 8
    models.write_dict(tmp_path, ["w"])
    flags = f"--encoder-layers {layers} --encoder-embed-dim {d} --encoder-ffn-embed-dim {f} --encoder-attention-heads "
    flags += f"{heads} --max-positions {n} --compressed-dim {k} --compress-sharing {sharing} --local-window {window}"
    built, _ = models.build_model("linformer_roberta_base", flags.split(), tmp_path)
    with torch.inference_mode(), FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        built.eval()(torch.full((1, n), 4), features_only=True)
    ideal = encoder_flops(n, d, f, layers, k, sharing, "linear", window=window)
    without = encoder_flops(n, d, f, layers, k, sharing, "linear")
    maps = 4 * n * d * d if sharing != "none" else 0
    assert ideal - without == layers * (4 * n * window * d + maps)
    read = window // 2 + 2 * (window // 2)  # keys a query's block reads
    assert counter.get_total_flops() == ideal + layers * 4 * n * (read - window) * d


# fairseq's original Linformer example, which the fairseq package installs with its examples
ORIGINAL_EXAMPLE = Path(fairseq.__file__).parent / "examples" / "linformer" / "linformer_src"


def training_step_flops(model, sharing):
    """FLOPs counted by torch in one training step of a tiny model, and the expected ones."""
    spec = dict(TINY_SPEC, model=model, dtype="fp32", k=None if model.startswith("roberta") else 8, label=model)
    spec |= {"baseline_user_dir": str(ORIGINAL_EXAMPLE), "compress_sharing": sharing, "batch_size": 2}
    built = bench.build_point_model(spec)
    torch.manual_seed(0)
    *_, masked = bench.masked_batch(spec, batch=2)
    torch.manual_seed(0)
    step = bench.training_step(built, spec, batch=2)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        step()
    return counter.get_total_flops(), 2 * step_flops(spec, masked_share=masked.float().mean().item())


@pytest.mark.parametrize(
    "model, sharing", [("roberta-fused", None), ("linformer", "headwise"), ("linformer", "kv"), ("original", "kv")]
)
def test_training_step_flops_match_torch_flop_counter(model, sharing):
    """A training step costs 3x the forward FLOPs of the encoder and of the masked-LM head on the masked positions;
    fairseq's original example applies a projection shared by keys and values twice."""
    if model == "original":  # its architectures' names are the plugin's: it registers them in a process of its own
        code = f"import test_benchmark; print(*test_benchmark.training_step_flops({model!r}, {sharing!r}))"
        env = dict(ENV, PYTHONPATH=str(SCRIPTS))  # scripts/ on sys.path, as pytest's pythonpath puts it here
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        counted, expected = map(float, proc.stdout.split()[-2:])
    else:
        counted, expected = training_step_flops(model, sharing)
    assert counted == pytest.approx(expected, rel=1e-9)


def markdown_tables(text):
    """Every table of a benchmark.md as a list of {column: cell}, keyed by the paragraph before it."""
    blocks = [block.strip() for block in text.split("\n\n")]
    tables = {}
    for caption, block in zip(blocks, blocks[1:]):
        if block.startswith("| "):
            header, _, *rows = ([c.strip() for c in line.strip("|").split("|")] for line in block.splitlines())
            tables[caption] = [dict(zip(header, cells)) for cells in rows]
    return tables


def ms_per_seq(point):
    return statistics.median(1000 * t / point["spec"]["batch_size"] for t in point["seconds"])


def ms_per_seq_at_max_batch(point):
    return 1000 * statistics.median(point["max_batch_seconds"]) / point["max_batch"]


@pytest.mark.slow
def test_tiny_grid_end_to_end(tmp_path):
    out = tmp_path / "out"
    # widths chosen so that the n x n scores dominate RoBERTa-explicit's peak and the FFN
    # intermediate (n x 128) dominates the Linformer's
    heads, ffn, n = 8, 128, 64
    cmd = [sys.executable, str(SCRIPTS / "benchmark.py"), "--lengths", str(n), "--ks", "16",
           "--ffn-chunk-size", "0,8", "--encoder-layers", "1", "--encoder-embed-dim", "32",
           "--encoder-ffn-embed-dim", str(ffn), "--encoder-attention-heads", str(heads), "--threads", "1",
           "--min-run-time", "0.05", "--max-batch-budget-gb", "0.03", "--out-dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((out / "benchmark.json").read_text())
    points = {p["spec"]["label"]: p for p in report["points"]}
    assert list(points) == ["roberta-fused", "roberta-explicit", "linformer-k16", "linformer-k16-chunk8"]
    assert all(p["status"] == "ok" and p["seconds"] and p["spec"]["n"] == n for p in points.values())
    peak = {name: p["peak_bytes"] for name, p in points.items()}
    # the explicit path holds the fp32 n x n scores of every head; the fused kernel never does
    assert peak["roberta-explicit"] - peak["roberta-fused"] >= heads * n * n * 4
    # chunking the FFN over 8 positions removes most of its n x ffn intermediate
    assert peak["linformer-k16"] - peak["linformer-k16-chunk8"] >= (n - 8) * ffn * 4
    batches = {name: p["max_batch"] for name, p in points.items()}
    assert 0 < batches["roberta-explicit"] < batches["roberta-fused"]
    assert batches["linformer-k16-chunk8"] > batches["linformer-k16"]

    # the report's rows and ratios are the JSON's, computed here independently
    text = (out / "benchmark.md").read_text()
    assert text in proc.stdout
    measured, time_saved, memory_saved = markdown_tables(text).values()
    assert [(r["model"], r["status"]) for r in measured] == [(name, "ok") for name in points]
    assert float(measured[0]["ms_per_seq"]) == pytest.approx(ms_per_seq(points["roberta-fused"]), abs=0.051)
    rows = {r["model"]: r for r in time_saved}
    assert list(rows) == ["linformer-k16", "linformer-k16-chunk8"]
    lin, fused, explicit = points["linformer-k16"], points["roberta-fused"], points["roberta-explicit"]
    assert rows["linformer-k16"]["vs fused"] == f"{ms_per_seq(fused) / ms_per_seq(lin):.2f}x"
    at_max = ms_per_seq_at_max_batch(explicit) / ms_per_seq_at_max_batch(lin)
    assert rows["linformer-k16"]["max batch vs explicit"] == f"{at_max:.2f}x"
    flop_ideal = encoder_flops(n, 32, ffn, 1) / encoder_flops(n, 32, ffn, 1, 16, "layerwise")
    assert rows["linformer-k16"]["FLOP-ideal"] == f"{flop_ideal:.2f}x" != "1.00x"
    assert "paper" not in rows["linformer-k16"]  # the paper has no n = 64: the column is left out
    memory = {r["model"]: r for r in memory_saved}["linformer-k16-chunk8"]
    mib = {name: p / 2**20 for name, p in peak.items()}
    assert memory["peak vs explicit"] == f"{mib['roberta-explicit'] / mib['linformer-k16-chunk8']:.2f}x"
    assert memory["max batch vs fused"] == f"{batches['linformer-k16-chunk8'] / batches['roberta-fused']:.2f}x"

    with open(out / "benchmark.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["model"] for r in table] == list(points)
    assert int(table[2]["flops_per_seq"]) == encoder_flops(n, 32, ffn, 1, 16, "layerwise")
    assert (out / "time_vs_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --resume reuses every finished point instead of measuring again
    proc = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((out / "benchmark.json").read_text())
    assert [p["seconds"] for p in again["points"]] == [p["seconds"] for p in report["points"]]


def test_points_over_the_memory_limit_are_skipped_and_reported(tmp_path):
    bench.main(["--lengths", "1024", "--ks", "128", "--memory-limit-gb", "0.01", "--out-dir", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert [p["status"] for p in report["points"]] == ["skipped"] * 3
    measured = markdown_tables((tmp_path / "benchmark.md").read_text())
    rows = next(iter(measured.values()))
    assert [r["status"] for r in rows] == ["skipped"] * 3 and rows[0]["note"].startswith(
        "needs more than --memory-limit-gb"
    )
    assert "ms_per_seq" not in rows[0]  # nothing measured: the column is left out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--baselines", "fused,flash"], "error: --baselines: unknown ['flash']"),
        (["--compress-type", "mean", "--lengths", "1000", "--ks", "128"], "needs n divisible by k: n=1000"),
        (["--encoder-embed-dim", "100"], "error: --encoder-embed-dim 100 is not divisible by"),
        (["--batch-size", "0"], "error: argument --batch-size: expected integers >= 1, got '0'"),
        (["--encoder-layers", "1,2"], "error: argument --encoder-layers: invalid count value: '1,2'"),
        (["--max-batch-budget-gb", "8", "--memory-limit-gb", "4"], "exceeds --memory-limit-gb 4.0"),
        (["--lengths", "512,x"], "error: argument --lengths: invalid positive value: '512,x'"),
        (["--ks", "0"], "error: argument --ks: expected integers >= 1, got '0'"),
    ],
)
def test_bad_arguments_fail_naming_the_value(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(argv + ["--out-dir", str(tmp_path)])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before measuring anything


def test_attention_benchmark_times_fairseqs_attention_and_each_band(tmp_path, capsys):
    """scripts/benchmark_attention.py: its full-attention baseline computes fairseq's MultiheadAttention
    (same weights, same output); the grid has full attention and a Linformer per k < n and band W, and
    its JSON holds the printed rows; bad input is refused."""
    from fairseq.modules import MultiheadAttention

    # imported here: it imports the plugin, whose architectures the original-kv test's process must not have
    import benchmark_attention as layers

    torch.manual_seed(0)
    reference = MultiheadAttention(32, 4, self_attention=True).eval()
    full = layers.FullAttention(32, 4).eval()
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        getattr(full, name).load_state_dict(getattr(reference, name).state_dict())
    x = torch.randn(20, 2, 32)
    with torch.no_grad():
        torch.testing.assert_close(full(x)[0], reference(x, x, x, need_weights=False)[0], atol=1e-5, rtol=0)

    out = tmp_path / "layers.json"
    argv = ["--lengths", "64,128", "--ks", "32,64", "--local-windows", "0,8", "--embed-dim", "32", "--heads", "4"]
    layers.main([*argv, "--repeats", "1", "--mode", "training", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    names = [(r["n"], r["model"]) for r in rows]
    assert names == [(64, "full"), (64, "linformer-k32"), (64, "linformer-k32-w8"),
                     (128, "full"), (128, "linformer-k32"), (128, "linformer-k32-w8"),
                     (128, "linformer-k64"), (128, "linformer-k64-w8")]  # fmt: skip
    assert all(r["vs_full"] == 1 for r in rows if r["model"] == "full")
    # a training step's matmul FLOPs, 3x the forward: full attention 8nd^2 + 4n^2 d; the Linformer
    # (headwise) 4nd^2 + 4kd^2 + 2 x 2knd + 4nkd, with a band of 8 also 4nWd + 4nd^2; no MFU on a CPU
    n, d, k = 128, 32, 64
    linformer = 4 * n * d * d + 4 * k * d * d + 2 * 2 * k * n * d + 4 * n * k * d
    flops = {r["model"]: r["flops"] for r in rows if r["n"] == n}
    assert flops["full"] == 3 * (8 * n * d * d + 4 * n * n * d) and flops["linformer-k64"] == 3 * linformer
    assert flops["linformer-k64-w8"] == 3 * (linformer + 4 * n * 8 * d + 4 * n * d * d)
    assert all(r["mfu"] is None for r in rows)
    out = capsys.readouterr().out
    assert out.count("| 128 | 1 |") == 5 and "| MFU |" in out and "MFU: no MFU on cpu" in out
    args = layers.parse_args(["--lengths", "64", "--ks", "32", "--local-windows", "0,8", "--local-count-once"])
    built = {name: make() for name, make in layers.models(args, 64)}
    assert list(built) == ["full", "linformer-k32", "linformer-k32-w8", "linformer-k32-w8-once"]
    assert [layer.local_count_once for name, layer in built.items() if name != "full"] == [False, False, True]
    with pytest.raises(SystemExit):
        layers.main(["--local-windows", "7"])


# a Python without fairseq (a GPU node's bare PyTorch): a name that sys.modules maps to None does not
# import, and importlib.util.find_spec finds no such module; omegaconf and hydra come with fairseq
WITHOUT_FAIRSEQ = "import sys\nsys.modules.update(dict.fromkeys(['fairseq', 'fairseq_cli', 'omegaconf', 'hydra']))\n"
TINY_FORWARD = """
import sys
import torch
from linformer_fairseq.modules import linformer_attention as attention
settings = attention.LinformerSettings(max_positions=32, compressed_dims=(8,), local_window=4)
out, _ = attention.LinformerMultiheadAttention(16, 2, settings, 8)(query=torch.randn(32, 2, 16))
assert out.shape == (32, 2, 16) and out.isfinite().all(), out.shape
loaded = [name for name, module in sys.modules.items() if module and name.split(".")[0] in ("fairseq", "omegaconf")]
assert not loaded, loaded
"""


def test_attention_imports_and_benchmarks_without_fairseq(tmp_path):
    """linformer_fairseq.modules.linformer_attention needs torch alone: with fairseq hidden (a
    sitecustomize.py), the plugin imports without registering anything, a Linformer layer with a
    band runs forward, and scripts/benchmark_attention.py times a grid, the checkout on PYTHONPATH
    as scripts/gpu_check.sh puts it."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_FAIRSEQ)
    env = dict(ENV, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")

    def python(*argv):
        return subprocess.run([sys.executable, *map(str, argv)], env=env, capture_output=True, text=True, cwd=tmp_path)

    hidden = python("-c", "import fairseq")
    assert hidden.returncode != 0 and "ModuleNotFoundError" in hidden.stderr, hidden.stderr[-2000:]
    for argv in (["-c", TINY_FORWARD], [SCRIPTS / "benchmark_attention.py", "--lengths", "64", "--ks", "16",
                 "--local-windows", "0,8", "--embed-dim", "16", "--heads", "2", "--repeats", "1"]):  # fmt: skip
        done = python(*argv)
        assert done.returncode == 0, done.stderr[-3000:]
    assert "| 64 | 1 | linformer-k16-w8 |" in done.stdout, done.stdout
