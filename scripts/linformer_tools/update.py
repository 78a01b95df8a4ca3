"""fairseq's own update against the model's bare training step (scripts/benchmark.py --mode update).

The update is ``fairseq.trainer.Trainer.train_step`` as fairseq-hydra-train builds it from a
pretraining config (configs/pretraining/NAME.yaml composed with hydra, as the launchers do):
the masked_lm task and criterion, the config's optimizer and polynomial_decay schedule, and
fp16 / bf16 through fairseq's FP16Optimizer. The bare step is the same model, from the same
initial weights, stepped as linformer_tools.measure.training_step does: forward, masked-LM
loss, backward, torch.optim.Adam. Both take the same masked batch. Their ratio says what
fairseq's update adds to the model's step; a torch.profiler pass counts where it goes. Each
carries its model FLOPs utilization on a GPU of linformer_tools.mfu's table. With
``--pretrain-log CONFIG=LOG``, scripts/pretrain.sh's steady-state updates/s from LOG (its
hydra_train.log) go beside the update of the same config and batch (``pretrain_table``).
"""

import itertools
import math
import os
import statistics
import tempfile
from itertools import islice
from pathlib import Path

import torch

from . import logs, measure, mfu, models
from .common import CONFIGS, PLUGIN_DIR, fail

PRETRAINING = CONFIGS / "pretraining"
DTYPE_OVERRIDES = {
    "fp32": ["common.fp16=false", "common.bf16=false"],
    "fp16": ["common.fp16=true", "common.bf16=false"],
    "bf16": ["common.fp16=false", "common.bf16=true"],
}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# what the profiler counts per step: (label, operator names, what it means)
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COUNTED = [
    ("host syncs (cuda*Synchronize)", HOST_SYNCS),
    ("aten::item", ("aten::item",)),
    ("aten::_local_scalar_dense", ("aten::_local_scalar_dense",)),
    ("aten::nonzero", ("aten::nonzero",)),
    ("aten::copy_", ("aten::copy_",)),
    ("cudaLaunchKernel", ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")),
]
# fairseq's record_function blocks of Trainer.train_step, and the optimizers' own
REGIONS = ["multiply-grads", "clip-grads", "optimizer"]


def config_overrides(args, n, data_dir, save_dir):
    """The hydra overrides that make NAME.yaml's run the benchmark's: one process, this device
    and precision, the benchmark's batch and length (and the encoder's size when given)."""
    overrides = [
        f"task.data={data_dir}",
        f"common.user_dir={PLUGIN_DIR}",
        f"common.cpu={str(args.device == 'cpu').lower()}",
        *DTYPE_OVERRIDES[args.dtype],
        f"dataset.batch_size={args.batch_size}",
        "dataset.num_workers=0",
        "optimization.update_freq=[1]",
        "distributed_training.distributed_world_size=1",
        f"checkpoint.save_dir={save_dir}",
        "common.log_format=none",
    ]
    if n:
        overrides.append(f"task.tokens_per_sample={n}")
    for name in ("layers", "embed_dim", "ffn_embed_dim", "attention_heads"):
        if (value := getattr(args, f"encoder_{name}")) is not None:
            overrides.append(f"model.encoder_{name}={value}")
    return overrides + list(args.override)


def build(args, name, n, data_dir, save_dir):
    """(cfg, task, trainer) as fairseq_cli.train.main builds them from the composed config."""
    from fairseq import tasks, utils
    from fairseq.dataclass.initialize import add_defaults
    from fairseq.trainer import Trainer
    from omegaconf import OmegaConf

    from .launch import compose

    cfg = compose(PRETRAINING, name, config_overrides(args, n, data_dir, save_dir))
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))  # as hydra_train
    utils.import_user_module(cfg.common)
    add_defaults(cfg)
    OmegaConf.set_struct(cfg, True)
    torch.manual_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return cfg, task, Trainer(cfg, task, model, criterion)


def synthetic_batch(task, batch, n, mask_prob=0.15, seed=0):
    """A masked_lm sample as fairseq's task makes it: <s> then random words, ``mask_prob`` of the
    positions chosen (80% <mask>, 10% a random word, 10% kept), the target the pad elsewhere."""
    g = torch.Generator().manual_seed(seed)
    d = task.source_dictionary
    words = torch.randint(d.nspecial, task.mask_idx, (batch, n), generator=g)
    words[:, 0] = d.bos()
    chosen = torch.rand(batch, n, generator=g) < mask_prob
    chosen[:, 0] = False
    chosen[0, 1] = True  # never an empty set
    how = torch.rand(batch, n, generator=g)
    src = words.clone()
    src[chosen & (how < 0.8)] = task.mask_idx
    swap = chosen & (how >= 0.9)
    src[swap] = torch.randint(d.nspecial, task.mask_idx, (int(swap.sum()),), generator=g)
    return {
        "id": torch.arange(batch),
        "nsentences": batch,
        "ntokens": batch * n,
        "net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), n)},
        "target": words.masked_fill(~chosen, d.pad()),
    }


def bare_model(task, trainer, cfg, dtype, device):
    """A second copy of the model with the trainer's initial weights, for the bare step."""
    model = task.build_model(cfg.model)
    model.load_state_dict({k: v.float() for k, v in trainer.model.state_dict().items()})
    return model.to(device=device, dtype=TORCH_DTYPES[dtype])


def bare_step(model, sample, pad, device):
    src = sample["net_input"]["src_tokens"].to(device)
    target = sample["target"].to(device)
    return measure.training_step(model, src, target, target.ne(pad))


def update_step(trainer, samples):
    """One Trainer.train_step as fairseq_cli.train runs it, each update's batch in turn."""
    from fairseq.logging import metrics

    batches = itertools.cycle(samples)

    def step():
        with metrics.aggregate("train_inner"), torch.autograd.profiler.record_function("train_step"):
            return trainer.train_step([next(batches)])

    return step


def profile_steps(step, device, steps):
    """torch.profiler over ``steps`` steps (after one untimed): the events and the wall seconds."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    return prof


def summarize(prof, steps, device):
    """Per step: counts of the sync-making and copying operators, ms in fairseq's regions and in
    all CPU operators (the CPU's own work; on a GPU, what the GPU waits for when it exceeds the
    GPU's time)."""
    averages = {e.key: e for e in prof.key_averages()}
    out = {}
    for label, names in COUNTED:
        out[label] = sum(averages[n].count for n in names if n in averages) / steps
    for region in REGIONS + ["Optimizer.step"]:
        events = [e for key, e in averages.items() if key == region or key.startswith(f"{region}#")]
        out[f"{region} CPU ms"] = sum(e.cpu_time_total for e in events) / steps / 1000
    aten = [e for key, e in averages.items() if key.startswith("aten::")]
    out["aten ops"] = sum(e.count for e in aten) / steps
    out["CPU ms in ops (self)"] = sum(e.self_cpu_time_total for e in averages.values()) / steps / 1000
    if device == "cuda":
        out["GPU ms (kernels)"] = sum(getattr(e, "self_device_time_total", 0) for e in aten) / steps / 1000
    return out


def top_table(prof, device, rows):
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def threads_line():
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    omp = os.environ.get("OMP_NUM_THREADS", "unset")
    return (
        f"CPU threads: torch {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op; "
        f"OMP_NUM_THREADS {omp}; {affinity} of {os.cpu_count()} cores usable"
    )


def model_shape(cfg, task):
    """What mfu.matmul_flops reads, from the composed config (fairseq's defaults added) and the
    task's dictionary: widths, layers, V, the masked share, and a Linformer's k per layer,
    sharing, projection kind and band."""
    m = cfg.model
    shape = dict(d=m.encoder_embed_dim, f=m.encoder_ffn_embed_dim, layers=m.encoder_layers)
    shape |= dict(vocab=len(task.source_dictionary), masked_share=float(cfg.task.mask_prob))
    if "compressed_dim" in m:  # linformer_roberta
        from linformer_fairseq.modules.linformer_attention import LinformerSettings

        s = LinformerSettings.from_args(m)
        shape |= dict(k=list(s.compressed_dims), sharing=s.sharing, kind=s.kind, window=s.local_window)
    return shape


def update_flops(shape, sentences, tokens):
    """Model FLOPs of one training update of ``sentences`` sequences holding ``tokens`` real tokens
    in all (each counted at their mean length)."""
    return sentences * mfu.matmul_flops(tokens / sentences, **shape)


def real_batches(trainer, count):
    """The first ``count`` batches of the data-bin's train split in the order fairseq-train's first
    epoch takes them (shuffled with the config's seed: unshuffled, masked_lm's batches run from
    the shortest sequences up), so the batches of its first updates."""
    itr = trainer.get_train_iterator(epoch=1, load_dataset=True).next_epoch_itr(shuffle=True)
    return list(islice(itr, count))


def measure_config(args, name, n):
    """Time fairseq's update and the bare step of config ``name`` at length ``n`` (None: the
    config's); returns the result dict (times in ms, profiler counts)."""
    device = args.device
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data
        if data_dir is None:  # a dictionary of RoBERTa's size: the masked-LM head's work is real
            data_dir = Path(tmp) / "dict"
            data_dir.mkdir()
            models.write_dict(data_dir, [f"w{i}" for i in range(args.vocab_size - models.FIRST_WORD_ID - 1)])
        cfg, task, trainer = build(args, name, n, data_dir, Path(tmp) / "save")
        n = cfg.task.tokens_per_sample
        if args.data is None:
            samples = [synthetic_batch(task, args.batch_size, n, seed=i) for i in range(args.batches)]
        else:
            samples = real_batches(trainer, args.batches)
            if not samples:
                fail(f"--data {args.data}: its train split gave no batch")
        model = bare_model(task, trainer, cfg, args.dtype, device)
        bare = bare_step(model, samples[0], task.source_dictionary.pad(), device)
        update = update_step(trainer, samples)
        optimizer = type(trainer.optimizer).__name__
        inner = getattr(trainer.optimizer, "fp32_optimizer", trainer.optimizer)
        optimizer += f"({type(inner.optimizer).__module__}.{type(inner.optimizer).__name__})"

        losses = [float(update()["loss"]) for _ in range(args.warmup)]  # also the first update's allocations
        bare()
        result = {
            "config": name,
            "n": n,
            "batch_size": args.batch_size,
            "tokens": sum(int(s["net_input"]["src_tokens"].numel()) for s in samples) // len(samples),
            "optimizer": optimizer,
            "update_ms": 1000 * statistics.median(measure.seconds_per_step(update, args.min_run_time)),
            "step_ms": 1000 * statistics.median(measure.seconds_per_step(bare, args.min_run_time)),
            "losses": losses,
        }
        result["speed"] = result["step_ms"] / result["update_ms"]
        # model FLOPs at the batches' mean sentences and real (unpadded) tokens
        result["shape"] = shape = model_shape(cfg, task)
        result["sentences"] = statistics.mean(int(s["nsentences"]) for s in samples)
        result["real_tokens"] = statistics.mean(int(s["ntokens"]) for s in samples)
        result["flops_per_update"] = flops = update_flops(shape, result["sentences"], result["real_tokens"])
        result["peak"], peak = mfu.cuda_peak(device, args.dtype)
        result["mfu"] = {k: mfu.utilization(flops, result[f"{k}_ms"] / 1000, peak) for k in ("update", "step")}
        steps = args.profile_steps
        profiles = {"update": profile_steps(update, device, steps), "step": profile_steps(bare, device, steps)}
        result["profile"] = {k: summarize(p, steps, device) for k, p in profiles.items()}
        if args.profile:
            result["tables"] = {k: top_table(p, device, args.profile_rows) for k, p in profiles.items()}
        del trainer, model
        if device == "cuda":
            torch.cuda.empty_cache()
    return result


def report(result, dtype, device, profile):
    """The lines printed for one config."""
    lines = [
        f"{result['config']} n={result['n']} batch {result['batch_size']} ({result['tokens']:,} tokens), "
        f"{dtype} on {device}, {result['optimizer']}",
        f"  update {result['update_ms']:.1f} ms, bare step {result['step_ms']:.1f} ms, "
        f"update/step speed {result['speed']:.2f}",
        f"  model FLOPs {result['flops_per_update'] / 1e12:.3g} TFLOP an update: MFU update "
        f"{mfu.percent(result['mfu']['update'])}, bare step {mfu.percent(result['mfu']['step'])} ({result['peak']})",
        f"  {'per step':<32}{'update':>10}{'bare step':>12}",
    ]
    update, step = result["profile"]["update"], result["profile"]["step"]
    for key in update:
        if any(math.isfinite(v) and v for v in (update[key], step.get(key, 0))):
            lines.append(f"  {key:<32}{update[key]:>10.1f}{step.get(key, 0):>12.1f}")
    for which, table in result.get("tables", {}).items() if profile else []:
        lines += [f"  profiler, {which}, all steps together (top operators):", table]
    return "\n".join(lines)


SKIP = 50  # pretrain.sh's first updates, left out of its steady state (warmup: allocations, cudnn, the loader)


def pretrain_steady(log, skip=SKIP):
    """pretrain.sh's updates after the first ``skip``, from its log's train_inner records. fairseq's
    ``ups`` of a record is the updates since the previous record over the seconds since that one
    was logged (its train_inner meters are reset at every log), so with common.log_interval
    dividing ``skip`` the records after update ``skip`` time exactly the later updates:
    updates/s = their count over the sum of (a record's updates / its ups). None without a record
    at update ``skip`` and one after it; else the updates counted (from, to), ups, the mean
    sentences and real tokens an update (bsz, wpb), each record's ups (windows) and the epochs the
    records span (more than one: an epoch's end, its validation and new data loader, is counted)."""
    records = [r for r in logs.records(log, "train_inner") if "num_updates" in r]
    restarts = [i for i in range(1, len(records)) if records[i]["num_updates"] <= records[i - 1]["num_updates"]]
    records = records[max(restarts, default=0) :]  # a rerun in the same save dir appends to the log
    first = [r for r in records if int(r["num_updates"]) == skip]
    later = [r for r in records if int(r["num_updates"]) > skip]
    if not first or not later or any("ups" not in r for r in later):  # no ups: no finite gradient in a record
        return None
    counted, seconds, sentences, tokens, previous = 0, 0.0, 0.0, 0.0, skip
    for r in later:
        updates = int(r["num_updates"]) - previous
        counted, seconds, previous = counted + updates, seconds + updates / r["ups"], int(r["num_updates"])
        sentences, tokens = sentences + updates * r["bsz"], tokens + updates * r["wpb"]
    return {
        "from": skip + 1,
        "to": previous,
        "ups": counted / seconds,
        "bsz": sentences / counted,
        "wpb": tokens / counted,
        "windows": [r["ups"] for r in later],
        "epochs": sorted({int(r["epoch"]) for r in first + later if "epoch" in r}),
    }


def pretrain_table(results, pretrain_logs, dtype, device):
    """pretrain.sh's steady updates/s beside the update (Trainer.train_step) and the bare step of
    the same config and batch, as ratios, each with its MFU (pretrain.sh's at its log's mean
    sentences and tokens an update)."""
    why, peak = mfu.cuda_peak(device, dtype)
    head = "| config | n x batch | pretrain.sh updates/s | update/s | pretrain/update | bare step/s | pretrain/step "
    lines = [head + "| MFU pretrain | MFU update | MFU step |", "| --- | --- |" + " ---: |" * 8]
    notes = []
    for r in results:
        if r["config"] not in pretrain_logs:
            continue
        log, steady = pretrain_logs[r["config"]], pretrain_steady(pretrain_logs[r["config"]])
        update_ups, step_ups = 1000 / r["update_ms"], 1000 / r["step_ms"]
        cells = [f"`{r['config']}`", f"{r['n']:,} x {r['batch_size']}"]
        if steady is None:
            cells += [f"no record at update {SKIP} and after in {log}", f"{update_ups:.2f}", "-", f"{step_ups:.2f}"]
            cells += ["-", "-", mfu.percent(r["mfu"]["update"]), mfu.percent(r["mfu"]["step"])]
        else:
            flops = update_flops(r["shape"], steady["bsz"], steady["wpb"])
            cells += [f"{steady['ups']:.2f} ({steady['from']}-{steady['to']})", f"{update_ups:.2f}"]
            cells += [f"**{steady['ups'] / update_ups:.2f}**", f"{step_ups:.2f}", f"{steady['ups'] / step_ups:.2f}"]
            cells += [mfu.percent(mfu.utilization(flops, 1 / steady["ups"], peak))]
            cells += [mfu.percent(r["mfu"]["update"]), mfu.percent(r["mfu"]["step"])]
            windows = ", ".join(f"{w:g}" for w in steady["windows"])
            notes.append(
                f"{r['config']}: pretrain.sh's records after update {SKIP}: {windows} updates/s; "
                f"{steady['bsz']:.1f} sentences, {steady['wpb']:,.0f} tokens an update (the update: "
                f"{r['sentences']:.1f}, {r['real_tokens']:,.0f})"
            )
            if len(steady["epochs"]) > 1:
                notes.append(f"{r['config']}: epochs {steady['epochs']} ended inside: their ends are counted")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, *(f"- {note}" for note in notes), f"- MFU: {why}" if peak is None else f"- peak: {why}"])


def run(args):
    """--mode update: each config in turn, then the summary line (and with --pretrain-log, the
    table of pretrain.sh against the update)."""
    models.import_fairseq()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(threads_line(), flush=True)
    lengths = args.lengths or [None]
    results = []
    for name in args.config:
        for n in lengths:
            result = measure_config(args, name, n)
            results.append(result)
            print(report(result, args.dtype, args.device, args.profile), flush=True)
    worst = min(results, key=lambda r: r["speed"])
    each = ", ".join(f"{r['config']} n={r['n']} {r['speed']:.2f}" for r in results)
    print(f"update/step speed: {worst['speed']:.2f}" + (f" (the lowest; {each})" if len(results) > 1 else ""))
    if args.pretrain_log:
        pretrain_logs = dict(entry.split("=", 1) for entry in args.pretrain_log)
        print(f"\npretrain.sh against the update, {args.dtype} on {args.device}:", flush=True)
        print(pretrain_table(results, pretrain_logs, args.dtype, args.device), flush=True)
    return results
