#!/usr/bin/env python
"""Time and peak memory of linformer_roberta against fairseq's RoBERTa of the same widths (paper Table 3, Figure 2
top right) over a grid of sequence lengths n and projected lengths k, each point in a fresh process: inference
(a forward) or training (forward, masked-LM loss, backward and Adam step), optionally next to fairseq's original
Linformer example. Writes benchmark.{md,csv,json} and time_vs_length.png to --out-dir. Method, columns and
figures: docs/benchmarks.md.

--mode update instead times fairseq's own update (Trainer.train_step, built from
configs/pretraining/CONFIG.yaml as the launchers build it: masked_lm, the config's optimizer and schedule,
--dtype fp16 / bf16 through fairseq's FP16Optimizer) against the model's bare training step on the same batch,
counts with torch.profiler where the difference goes (host syncs, copies, optimizer, CPU time), and ends with
"update/step speed: R" (bare step ms / update ms; 1.0: no overhead); on a GPU of linformer_tools/mfu.py's table
each also with its model FLOPs utilization (matmul FLOPs from the model's shapes over the dense bf16/fp16 peak).
--pretrain-log CONFIG=LOG adds a table of scripts/pretrain.sh's steady-state updates/s (updates 51 on, from LOG,
its hydra_train.log, logged every 50 updates) over the update's and the bare step's of the same config and batch
(use --data with pretrain.sh's data-bin). Writes update.json to --out-dir. E.g.
  benchmark.py --mode update --config roberta_base --batch-size 32 --device cuda --dtype fp16
  benchmark.py --mode update --config linformer_n512_k128_headwise --lengths 128 --encoder-layers 2 --batch-size 8"""

import argparse
import functools
import itertools
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from linformer_tools import measure, models, update
from linformer_tools.benchmark_report import BASELINES, MASKED_SHARE, PAPER_KS, VOCAB_SIZE, row, write_reports
from linformer_tools.common import cell, fail, machine, write_text

GIB = 1024**3
DEFAULT_LENGTHS = [2**i for i in range(9, 17)]
ENCODER_DEFAULTS = {"layers": 12, "embed_dim": 768, "ffn_embed_dim": 3072, "attention_heads": 12}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def int_list(text, least=0):  # argparse reports a ValueError as "invalid int_list value: 'TEXT'"
    if min(values := [int(v) for v in text.split(",")]) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got {text!r}")
    return values


def positive(text):
    return int_list(text, least=1)


def count(text):  # one integer >= 1
    (value,) = positive(text)
    return value


def config_list(text):
    names = [name.removesuffix(".yaml") for name in text.split(",")]
    choices = sorted(p.stem for p in update.PRETRAINING.glob("*.yaml") if p.stem not in ("recipe", "extend"))
    if bad := [name for name in names if name not in choices]:
        raise argparse.ArgumentTypeError(f"no pretraining config {bad}; choose from {','.join(choices)}")
    return names


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    arg = p.add_argument
    arg("--mode", default="inference", choices=sorted(STEPS) + ["update"], help="what one timed step is")
    arg(
        "--lengths",
        type=positive,
        help=f"sequence lengths n, comma-separated (default: {','.join(map(str, DEFAULT_LENGTHS))}; "
        "--mode update: each config's task.tokens_per_sample)",
    )
    arg("--ks", type=positive, default=list(PAPER_KS), help="projected lengths k; only k < n runs")
    arg("--ffn-chunk-size", type=int_list, default=[0], help="one Linformer per value; 0: no chunking")
    arg("--local-windows", type=int_list, default=[0], help="one Linformer per value: its local band W; 0: none")
    arg("--local-count-once", action="store_true", help="each band Linformer also counted once (-once), beside it")
    arg("--compress-sharing", default="layerwise", choices=["none", "headwise", "kv", "layerwise"], help="Linformer's")
    arg("--compress-type", default="linear", choices=["linear", "mean", "max", "conv"], help="Linformer's")
    arg("--baselines", default="fused,explicit", help="RoBERTa baselines, from fused,explicit")
    arg(
        "--baseline-user-dir",
        type=Path,
        help="adds fairseq's original example: examples/linformer/linformer_src of fairseq's source or package",
    )
    arg("--checkpoint-activations", action="store_true", help="every model recomputes activations in backward")
    arg("--profile", action="store_true", help="each point's torch.profiler table of one step (update: top operators)")
    for name, default in ENCODER_DEFAULTS.items():
        flag, why = f"--encoder-{name.replace('_', '-')}", f"every model's (default {default}; update: the config's)"
        arg(flag, type=count, help=why)
    arg("--batch-size", type=count, default=1, help="sequences per step")
    update_flags = p.add_argument_group("--mode update")
    update_flags.add_argument(
        "--config",
        type=config_list,
        default="linformer_n512_k128_headwise",
        help="pretraining configs (configs/pretraining/NAME.yaml), comma-separated: the model, optimizer, schedule",
    )
    update_flags.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="a hydra override for every config"
    )
    update_flags.add_argument(
        "--data", type=Path, help="a data-bin: its train batches in fairseq-train's epoch 1 order (default: synthetic)"
    )
    update_flags.add_argument("--batches", type=count, default=2, help="distinct batches the timed steps cycle over")
    update_flags.add_argument("--warmup", type=count, default=3, help="untimed updates first (their losses are kept)")
    update_flags.add_argument("--profile-steps", type=count, default=3, help="steps of each kind the profiler counts")
    update_flags.add_argument("--profile-rows", type=count, default=15, help="--profile: rows of each operator table")
    update_flags.add_argument("--vocab-size", type=count, default=VOCAB_SIZE, help="synthetic dictionary's size")
    update_flags.add_argument(
        "--pretrain-log",
        action="append",
        default=[],
        metavar="CONFIG=LOG",
        help="scripts/pretrain.sh's hydra_train.log of CONFIG (common.log_interval=50): its updates/s after update 50 "
        "beside the update's, with MFU",
    )
    arg("--dtype", default="fp32", choices=sorted(DTYPES), help="weights and activations")
    arg("--device", default="cpu", choices=["cpu", "cuda"], help="where the models run")
    arg("--threads", type=int, default=0, help="CPU threads per point; 0: torch's choice")
    arg("--min-run-time", type=float, default=1.0, help="seconds of timed steps per point (at least one step)")
    arg("--memory-limit-gb", type=float, default=0.0, help="memory allowed per point; 0: most of the free memory")
    arg("--max-batch-budget-gb", type=float, default=0.0, help="also time the largest batch that fits; 0: off")
    arg("--timeout", type=float, default=900, help="seconds allowed per point")
    arg("--out-dir", type=Path, default=Path("benchmark-results"), help="where the outputs go")
    arg("--resume", action="store_true", help="keep the finished points of --out-dir/benchmark.json")
    arg("--worker", help=argparse.SUPPRESS)  # one point, as JSON: how the parent runs it in a fresh process
    return p


# ---------------------------------------------------------------- one point, in its own process
def build_point_model(spec):
    dropout = 0.1 if spec["mode"] == "training" else 0.0  # the pretraining recipe's
    n, sizes = spec["n"], ("encoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_attention_heads")
    flags = " ".join(f"--{key.replace('_', '-')} {spec[key]}" for key in sizes)
    flags += f" --max-positions {n} --tokens-per-sample {n} --dropout {dropout} --attention-dropout {dropout}"
    user_dir, arch = models.PLUGIN_DIR, "linformer_roberta_base" if spec["k"] else "roberta_base"
    if spec["model"] == "linformer":
        flags += (
            f" --compressed-dim {spec['k']} --compress-sharing {spec['compress_sharing']} "
            f"--compress-type {spec['compress_type']} --ffn-chunk-size {spec['ffn_chunk']} "
            f"--local-window {spec['local_window']}"
        )
        flags += " --local-count-once" if spec.get("local_count_once") else ""
    elif spec["model"] == "original":  # its flags: k = n // compressed; sharing by two switches
        user_dir = spec["baseline_user_dir"]
        flags += f" --compressed {spec['n'] // spec['k']}"
        flags += {"kv": " --shared-kv-compressed 1", "layerwise": " --shared-layer-kv-compressed 1"}.get(
            spec["compress_sharing"], ""
        )
    if spec["checkpoint_activations"]:
        flags += " --checkpoint-activations"
    with tempfile.TemporaryDirectory() as data_dir:
        models.write_dict(data_dir, [f"w{i}" for i in range(VOCAB_SIZE - models.FIRST_WORD_ID - 1)])  # + <mask>
        model, _ = models.build_model(arch, flags.split(), data_dir, user_dir)
    if spec["model"] == "roberta-explicit" and models.force_explicit_attention(model) != spec["encoder_layers"]:
        raise RuntimeError("could not switch every layer to the explicit attention path")
    return model.to(device=spec["device"], dtype=DTYPES[spec["dtype"]])


def inference_step(model, spec, batch):
    """One forward of the encoder alone (the masked-LM head is the same in every model) on random tokens."""
    model.eval()
    tokens = torch.randint(models.FIRST_WORD_ID, VOCAB_SIZE, (batch, spec["n"]), device=spec["device"])
    return torch.inference_mode()(lambda: model(tokens, features_only=True))


def masked_batch(spec, batch):
    """Random tokens with MASKED_SHARE of them masked: the input, the targets and the mask."""
    targets = torch.randint(models.FIRST_WORD_ID, VOCAB_SIZE - 1, (batch, spec["n"]), device=spec["device"])
    masked = torch.rand(targets.shape, device=spec["device"]) < MASKED_SHARE
    return targets.masked_fill(masked, VOCAB_SIZE - 1), targets, masked  # the dictionary's last symbol is <mask>


def training_step(model, spec, batch):
    """One update as fairseq-train makes it on a masked random batch (linformer_tools.measure)."""
    return measure.training_step(model, *masked_batch(spec, batch))


# mode -> maker of its timed step for a batch size
STEPS = {"inference": inference_step, "training": training_step}


def profile(step):
    """Where one step's time goes, by operator: the matmuls (mm, addmm, bmm, attention kernels) and the rest."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def max_batch(model, step_for, spec):
    """The largest batch whose weights + peak fit the budget: the peak is linear in the batch, so predict it from
    two batches, then step down until a measured one fits (on CUDA also without running out of memory)."""
    budget, batch, device = spec["max_batch_budget_gb"] * GIB, spec["batch_size"], spec["device"]
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    p1, p2 = (measure.peak_bytes(step_for(b), device) for b in (batch, 2 * batch))
    slope = max((p2 - p1) / batch, 1.0)
    best = int((budget - weights - (p1 - slope * batch)) // slope)
    while best > 0:
        try:
            if weights + measure.peak_bytes(step_for(best), device) <= budget:
                return best
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
        best = min(best - 1, int(best * 0.9))
    return 0


def run_worker(spec):
    models.import_fairseq()
    torch.set_num_threads(spec["threads"] or torch.get_num_threads())
    limit = int(spec["memory_limit_gb"] * GIB)  # past it an allocation fails at once, instead of swapping
    if spec["device"] == "cuda":
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / torch.cuda.get_device_properties(0).total_memory))
    else:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.manual_seed(0)
    try:
        model = build_point_model(spec)
        step_for = functools.partial(STEPS[spec["mode"]], model, spec)
        step = step_for(spec["batch_size"])
        result = {
            "seconds": measure.seconds_per_step(step, spec["min_run_time"]),
            "peak_bytes": measure.peak_bytes(step, spec["device"]),
        }
        if spec["profile"]:
            result["profile"] = profile(step)
        if spec["max_batch_budget_gb"] and (best := max_batch(model, step_for, spec)):
            result |= {
                "max_batch": best,
                "max_batch_seconds": measure.seconds_per_step(step_for(best), spec["min_run_time"]),
            }
    except (MemoryError, RuntimeError) as e:  # CPU: RuntimeError "... can't allocate memory", CUDA: OutOfMemoryError
        if not isinstance(e, MemoryError) and "memory" not in str(e):
            raise
        result = {"status": "skipped", "note": f"needs more than --memory-limit-gb {spec['memory_limit_gb']:.1f}"}
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the grid
# flags that shape the grid or its running, not the points: every other flag is a setting all points share
GRID_FLAGS = set(
    "lengths ks ffn_chunk_size local_windows local_count_once baselines".split()
    + "memory_limit_gb timeout out_dir resume worker".split()
    + "config override data batches warmup profile_steps profile_rows vocab_size pretrain_log".split()  # update's
)


def make_grid(args):
    common = {key: value for key, value in vars(args).items() if key not in GRID_FLAGS}
    specs = []
    for n in sorted(set(args.lengths)):
        for b in args.baselines.split(","):
            specs.append(
                dict(common, model=f"roberta-{b}", label=f"roberta-{b}", n=n, k=None, ffn_chunk=0, local_window=0)
            )
        ks = [k for k in sorted(set(args.ks)) if k < n]
        for k, w, c in itertools.product(ks, sorted(set(args.local_windows)), args.ffn_chunk_size):
            name = f"linformer-k{k}" + (f"-w{w}" if w else "") + (f"-chunk{c}" if c else "")
            specs.append(dict(common, model="linformer", label=name, n=n, k=k, ffn_chunk=c, local_window=w))
            if w and args.local_count_once:
                specs.append(dict(specs[-1], label=f"{name}-once", local_count_once=True))
        for k in ks if args.baseline_user_dir else []:
            specs.append(dict(common, model="original", label=f"original-k{k}", n=n, k=k, ffn_chunk=0, local_window=0))
    return specs


def check_update_args(args):
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if args.device == "cpu" and args.dtype == "fp16":
        fail("--mode update --dtype fp16 needs --device cuda: fairseq's fp16 runs on GPUs (on a CPU: fp32 or bf16)")
    if args.data is not None and not (args.data / "dict.txt").is_file():
        fail(f"--data {args.data}: not a fairseq data-bin (no dict.txt)")
    if bad := [o for o in args.override if "=" not in o]:
        fail(f"--override takes KEY=VALUE, got {bad}")
    if bad := [e for e in args.pretrain_log if e.split("=", 1)[0] not in args.config or "=" not in e]:
        fail(f"--pretrain-log takes CONFIG=LOG for a CONFIG of --config {','.join(args.config)}, got {bad}")
    if (d := args.encoder_embed_dim) and (heads := args.encoder_attention_heads) and d % heads:
        fail(f"--encoder-embed-dim {d} is not divisible by --encoder-attention-heads {heads}")


def check_args(args):
    args.lengths = args.lengths or DEFAULT_LENGTHS
    for name, default in ENCODER_DEFAULTS.items():
        if getattr(args, f"encoder_{name}") is None:
            setattr(args, f"encoder_{name}", default)
    if args.baseline_user_dir:
        if not (args.baseline_user_dir / "models" / "linformer_roberta.py").is_file():
            fail(
                f"--baseline-user-dir {args.baseline_user_dir}: no models/linformer_roberta.py (fairseq's "
                "examples/linformer/linformer_src)"
            )
        if args.compress_sharing == "none" or args.compress_type != "linear":
            fail("--baseline-user-dir: the original example has linear projections shared headwise, kv or layerwise")
        if bad := [(n, k) for n in args.lengths for k in args.ks if k < n and n % k]:
            fail(f"--baseline-user-dir: the original example needs n divisible by k (k = n // compressed), got {bad}")
        args.baseline_user_dir = str(args.baseline_user_dir.resolve())
    if bad := [w for w in args.local_windows if w % 2]:
        fail(f"--local-windows: a band is W/2 neighbours on each side, so W must be even, got {bad}")
    if bad := set(args.baselines.split(",")) - set(BASELINES):
        fail(f"--baselines: unknown {sorted(bad)}; choose from {sorted(BASELINES)}")
    if (d := args.encoder_embed_dim) % (heads := args.encoder_attention_heads):
        fail(f"--encoder-embed-dim {d} is not divisible by --encoder-attention-heads {heads}")
    for n in args.lengths if args.compress_type != "linear" else []:
        if bad := [k for k in args.ks if k < n and n % k]:
            fail(f"--compress-type {args.compress_type} needs n divisible by k: n={n}, k={bad}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if not args.memory_limit_gb and args.device == "cuda":
        args.memory_limit_gb = 0.9 * torch.cuda.get_device_properties(0).total_memory / GIB
    elif not args.memory_limit_gb:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        args.memory_limit_gb = 0.8 * int(meminfo["MemAvailable"].split()[0]) * 1024 / GIB
    if args.max_batch_budget_gb > args.memory_limit_gb:
        fail(f"--max-batch-budget-gb {args.max_batch_budget_gb} exceeds --memory-limit-gb {args.memory_limit_gb:.1f}")


def run_point(spec, timeout, memory_limit_gb):
    """One point in a fresh interpreter, so that none inherits another's allocator state or caches. The memory
    limit is not part of the point's settings: its default follows the free memory, and --resume compares them."""
    worker = json.dumps(dict(spec, memory_limit_gb=memory_limit_gb))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", worker]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "note": f"did not finish in {timeout:.0f} s"}
    result = [line.removeprefix("RESULT ") for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not result:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"status": "error", "note": f"exit {proc.returncode}: {tail}"}
    return {"status": "ok", **json.loads(result[-1])}


def run_grid(args, argv):
    specs, out, key = make_grid(args), args.out_dir / "benchmark.json", functools.partial(json.dumps, sort_keys=True)
    done = {}
    if args.resume and out.exists():
        points = json.loads(out.read_text())["points"]
        done = {key(p["spec"]): p for p in points if p["status"] == "ok"}
    command = " ".join([Path(__file__).name, *argv])
    environment = dict(command=command, **machine(args.device), threads=args.threads or torch.get_num_threads())
    report = {"environment": environment, "points": []}
    given_up = {}  # label -> why its longer lengths are skipped
    for i, spec in enumerate(specs, 1):
        name = spec["label"]
        if key(spec) in done:
            record = done[key(spec)]
        elif name in given_up:
            record = {"spec": spec, "status": "skipped", "note": given_up[name]}
        else:
            record = {"spec": spec, **run_point(spec, args.timeout, args.memory_limit_gb)}
            if "profile" in record:
                write_text(args.out_dir / f"profile-{name}-n{spec['n']}.txt", record.pop("profile"))
            if record["status"] != "ok":
                given_up[name] = f"{record['status']} at n={spec['n']}"
        report["points"].append(record)
        shown = {h: v for h, v in row(record).items() if h in ("ms_per_seq", "peak_mib", "max_batch", "status", "note")}
        print(f"[{i}/{len(specs)}] {name} n={spec['n']}: " + ", ".join(f"{h} {cell(v)}" for h, v in shown.items() if v))
        write_text(out, json.dumps(report, indent=1))  # after every point: an interrupted run keeps what finished
    return report


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.worker:
        return run_worker(json.loads(args.worker))
    if args.mode == "update":
        check_update_args(args)
        results = update.run(args)
        environment = dict(command=" ".join([Path(__file__).name, *argv]), **machine(args.device))
        write_text(args.out_dir / "update.json", json.dumps({"environment": environment, "results": results}, indent=1))
        return results
    check_args(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = run_grid(args, argv)
    table = write_reports(report, args.out_dir)
    print(f"\n{table}\nWrote {args.out_dir}/benchmark.{{md,csv,json}} and time_vs_length.png")


if __name__ == "__main__":
    main()
