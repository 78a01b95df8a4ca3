"""What the training launchers (scripts/pretrain.sh, scripts/finetune.sh, scripts/slurm/*.sbatch)
work out before fairseq starts, in one process: each Python that imports fairseq spends seconds
on it, so a launch plans in one and trains in another.

  python -m linformer_tools.launch plan CONFIG_DIR CONFIG [OVERRIDE ...] --world-size W
         --save-dir DIR [--from CHECKPOINT [--blocks-of-model-length] [--lp-ft POOLING --probed PATH]]
         [--batch-size B] [--global-batch G] [--dry-run]

prints one "KEY VALUE" line each:
  resume PATH      the checkpoint a relaunch resumes from: DIR/checkpoint_last.pt if it loads,
                   else the newest complete checkpoint in DIR (fairseq writes checkpoint_last.pt
                   by a plain copy, which a kill can cut short); no line for a fresh start
  resume_note TEXT why it is not DIR/checkpoint_last.pt
  override X       every hydra override of the run, in order: what --from implies (the model
                   CHECKPOINT holds: architecture, k, sharing, max_positions; where training
                   starts), then the caller's
  batch B U G      per-GPU batch, update_freq and global batch that keep the config's global
                   batch (dataset.batch_size x update_freq x distributed_world_size, e.g.
                   16 x 2 x 64 = 2048 for pretraining) at W GPUs
  note TEXT        what dataset.max_tokens leaves of that batch; max_update from max_epoch (a
                   config that leaves max_update 0: its override lines follow)
  probe T H        --lp-ft: PATH (the checkpoint with a probe's head that training starts from,
                   in place of CHECKPOINT's weights) is still to be fitted, reading documents as
                   the run does: truncation T, head_tail's head tokens H
"""

import argparse
import logging
import re
import sys
import warnings
from pathlib import Path

from .common import fail
from .models import import_plugin

# Keys the launchers set from their own flags: an override of them would undo the arithmetic.
LAUNCHER_KEYS = {
    "dataset.batch_size": "--batch-size",
    "optimization.update_freq": "--global-batch",
    "distributed_training.distributed_world_size": "--gpus/--nodes",
}
# Model fields that a finetuning config chooses for itself instead of inheriting them.
FINETUNING_CHOICES = {
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "pooler_dropout",
    "encoder_layerdrop",
    "encoder_layers_to_keep",
    "load_checkpoint_heads",
    "spectral_norm_classification_head",
    "checkpoint_activations",
    "offload_activations",
    "min_params_to_wrap",
    "compress_resample_prob",
    "freeze_compress",
    "pooler_tokens",
    "chunk_length",
}


def config_file(config_dir: Path, name: str) -> Path:
    path = config_dir / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in config_dir.glob("*.yaml") if p.stem != "recipe")
        fail(f"no config {path}; choose one of: {' '.join(choices)}")
    return path


def compose(config_dir: Path, name: str, overrides, return_hydra_config=False):
    """The config as fairseq-hydra-train composes it (validated against FairseqConfig)."""
    config_file(config_dir, name)
    from fairseq.dataclass.initialize import hydra_init
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    # fairseq's own hydra setup; its schema matching warns that Hydra deprecates it
    warnings.filterwarnings("ignore", message=r"(?s).*automatic_schema_matching")
    hydra_init(name)
    try:
        # "1.1" is what fairseq-hydra-train runs under; a newer base would also stay set for the
        # process and make fairseq's own hydra.experimental calls raise ImportError
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base="1.1"):
            return hydra_compose(name, list(overrides), return_hydra_config=return_hydra_config)
    except HydraException as e:
        fail(f"{config_dir / name}.yaml with overrides {' '.join(overrides)}: {e}")


def batch_plan(args, cfg):
    """The "batch" line of the composed CFG, "note" lines (what dataset.max_tokens leaves of the
    batch; max_update from max_epoch) and the "override" lines of that schedule."""
    batch, update_freq = cfg.dataset.batch_size, list(cfg.optimization.update_freq)
    if batch is None or len(update_freq) != 1:
        fail(f"{args.config}: needs dataset.batch_size and a single optimization.update_freq")
    global_batch = args.global_batch or batch * update_freq[0] * cfg.distributed_training.distributed_world_size
    batch = args.batch_size or batch
    per_step = batch * args.world_size
    if global_batch % per_step:
        fail(
            f"a global batch of {global_batch} sequences does not split into steps of {batch} "
            f"sequences per GPU x {args.world_size} GPUs = {per_step}: choose a GPU count and "
            f"--batch-size whose product divides {global_batch}"
        )
    lines = [f"batch {batch} {global_batch // per_step} {global_batch}"]
    schedule_note, schedule = epoch_schedule(cfg, global_batch, args.dry_run)
    notes = [note for note in (token_cap_note(cfg, batch, global_batch), schedule_note) if note]
    return lines + [f"note {note}" for note in notes] + [f"override {o}" for o in schedule]


WARMUP_SHARE = 0.06  # RoBERTa's finetuning recipe (imdb.yaml: 469 of 7,812 updates)


def epoch_schedule(cfg, global_batch, dry_run):
    """A config that gives max_epoch and leaves max_update 0 (configs/finetuning/long_documents.yaml,
    for data of any size) gets polynomial_decay's end from its data: max_epoch x the training
    inputs / the global batch, and 6% of it as warmup unless it sets one; as "override" lines and
    a note. A step of fewer inputs than the batch (dataset.max_tokens) makes epochs longer."""
    opt = cfg.optimization
    if opt.max_update or not opt.max_epoch or cfg.lr_scheduler.get("_name") != "polynomial_decay":
        return "", []
    train = Path(str(cfg.task.data)) / "input0" / "train"
    if not train.with_suffix(".idx").is_file():
        if dry_run:
            return f"max_update: {opt.max_epoch} epochs of {train}'s inputs, counted when it exists", []
        fail(f"{train}.idx does not exist: max_update (0 in the config) comes from the training inputs")
    from fairseq.data import data_utils

    inputs = len(data_utils.load_indexed_dataset(str(train), None))
    per_epoch = -(-inputs // global_batch)
    total = per_epoch * opt.max_epoch
    warmup = cfg.lr_scheduler.warmup_updates or max(1, round(WARMUP_SHARE * total))
    note = f"max_update: {opt.max_epoch} epochs x {per_epoch} updates ({inputs} training inputs / {global_batch})"
    note += f" = {total}, warmup {warmup}"
    return note, [f"optimization.max_update={total}", f"lr_scheduler.warmup_updates={warmup}"]


def token_cap_note(cfg, batch, global_batch):
    """What dataset.max_tokens leaves of the batch when inputs are as long as the model reads
    (an extended model finetuned with recipe.yaml's cap reads fewer whole reviews per step)."""
    from omegaconf.errors import OmegaConfBaseException

    try:  # a finetuning task's max_positions is the model's, which a dry run may not know
        length = cfg.task.get("tokens_per_sample") or cfg.task.get("max_positions")
    except OmegaConfBaseException:
        return ""
    cap = cfg.dataset.max_tokens
    if not cap or not length or cap >= batch * length:
        return ""
    if cap < length:
        fail(f"dataset.max_tokens {cap} is less than one input of {length} tokens: raise it to at least {length}")
    fit = cap // length
    return (
        f"dataset.max_tokens {cap}: a step holds {fit} input(s) of {length} tokens (shorter ones, up to {batch}), "
        f"so an update of inputs that long holds {fit * global_batch // batch}, not the global batch of {global_batch}"
    )


def hydra_value(value) -> str:
    """A python value as a hydra override value (strings quoted: '128,128' is not a list)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


def model_overrides(checkpoint: Path, pooler_tokens=None):
    """(the overrides that rebuild CHECKPOINT's model, the model's max_positions, the model's name
    if its head reads <s> only); with POOLER_TOKENS, its classification head reads those states
    (--lp-ft's probe)."""
    import torch
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY, MODEL_DATACLASS_REGISTRY, MODEL_REGISTRY

    try:  # mmap: only the config is read, not gigabytes of weights
        state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
        model_cfg = (state.get("cfg") or {}).get("model") or state["args"]
    except Exception as e:
        fail(f"{checkpoint} is not a fairseq checkpoint with a model config: {e}")
    fields = model_cfg if isinstance(model_cfg, dict) else vars(model_cfg)
    arch = fields.get("_name") or fields.get("arch")
    name = ARCH_MODEL_NAME_REGISTRY.get(arch, arch)
    if name not in MODEL_REGISTRY:
        fail(f"{checkpoint}: unknown model {arch!r}")
    if name in MODEL_DATACLASS_REGISTRY:
        keys = set(MODEL_DATACLASS_REGISTRY[name].__dataclass_fields__)
    else:  # an argparse-only model (RoBERTa): its fields are its flags
        parser = argparse.ArgumentParser(add_help=False)
        MODEL_REGISTRY[name].add_args(parser)
        keys = {action.dest for action in parser._actions}
    kept = sorted((keys - FINETUNING_CHOICES - {"_name"}) & set(fields))
    if pooler_tokens and "pooler_tokens" in keys:
        fields, kept = dict(fields, pooler_tokens=pooler_tokens), sorted(set(kept) | {"pooler_tokens"})
    overrides = [f"++model._name={hydra_value(name)}"] + [f"++model.{key}={hydra_value(fields[key])}" for key in kept]
    return overrides, fields.get("max_positions"), None if "pooler_tokens" in keys else name


def block_overrides(config_dir: Path, config: str, length):
    """Pretraining blocks of the model's own length, with the per-GPU batch of that length's
    seq_len config when the config is built on recipe.yaml and one exists (seq_len/n2048.yaml:
    4 x 2048 tokens)."""
    on_recipe = re.search(r"^ *- (recipe|seq_len)", config_file(config_dir, config).read_text(), re.M)
    seq_len = [f"seq_len=n{length}"] if on_recipe and (config_dir / "seq_len" / f"n{length}.yaml").is_file() else []
    return seq_len + [f"task.tokens_per_sample={length}"]


def checkpoint_updates(path: Path):
    """The number of updates in a complete checkpoint; raises if it does not load."""
    import torch

    try:  # mmap: reads the zip directory (at the end of the file) and the pickle, no weights
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        state = torch.load(path, map_location="cpu", weights_only=True)  # an old, non-zip file
    return int(state["optimizer_history"][-1]["num_updates"])


def first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def resume_point(save_dir: Path, dry_run: bool):
    """(checkpoint a relaunch resumes from or None, why it is not checkpoint_last.pt or None)."""
    last = save_dir / "checkpoint_last.pt"
    if not last.exists():
        return None, None
    try:
        checkpoint_updates(last)
        return last, None
    except Exception as e:
        problem = f"{last} does not load ({first_line(e)}), e.g. a run killed while fairseq copied it"
    complete = []
    for path in save_dir.glob("checkpoint*.pt"):
        if path.name == last.name:
            continue
        try:
            complete.append((checkpoint_updates(path), path.stat().st_mtime, path))
        except Exception:
            continue  # another incomplete copy (checkpoint_best.pt is one too)
    if complete:
        updates, _, newest = max(complete)
        return (
            newest,
            f"resume: {problem}: resuming from the newest complete checkpoint, {newest.name} ({updates} updates)",
        )
    aside = last.with_name(last.name + ".incomplete")
    if not dry_run:
        try:  # every rank of a Slurm job may get here: the first one moves it
            last.rename(aside)
        except FileNotFoundError:
            pass
    return None, (
        f"resume: {problem}, and {save_dir} holds no complete checkpoint: starting from scratch "
        f"({'would move' if dry_run else 'moved'} it to {aside.name})"
    )


def start_overrides(start: Path, save_dir: Path, resume):
    """Where training starts: START's weights with the fresh optimizer, schedule and data order
    that the config's checkpoint.reset_* ask for, or a relaunch's own run with its optimizer."""
    if resume is None:
        return [f"checkpoint.restore_file={hydra_value(str(start))}"]
    restore = "checkpoint_last.pt" if resume == save_dir / "checkpoint_last.pt" else hydra_value(str(resume))
    keep = ("optimizer", "lr_scheduler", "dataloader", "meters")
    return [f"checkpoint.restore_file={restore}"] + [f"checkpoint.reset_{k}=false" for k in keep]


def choice_override(override: str) -> str:
    """model.freeze_compress=1 as ++model.freeze_compress=1: a finetuning choice is set in some
    configs and absent from others (not copied from the checkpoint), where hydra refuses a plain
    override of it."""
    key = override.split("=", 1)[0]
    return f"++{override}" if key.startswith("model.") and key[len("model.") :] in FINETUNING_CHOICES else override


def plan(args):
    for override in args.overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in LAUNCHER_KEYS:
            fail(f"set {key} with the launcher's {LAUNCHER_KEYS[key]}, not as an override")
    config_file(args.config_dir, args.config)  # bad input fails before fairseq's seconds of import
    import_plugin()  # the models' registry and the safe loader
    resume, note = resume_point(args.save_dir, args.dry_run)
    lines = [f"resume {resume}"] if resume else []
    lines += [f"resume_note {note}"] if note else []
    derived, first_only = [], None
    if args.start:
        derived, length, first_only = model_overrides(args.start, args.lp_ft)
        derived += start_overrides(args.probed or args.start, args.save_dir, resume)
        if args.blocks_of_model_length:
            if not length:
                fail(f"{args.start}: its model has no max_positions to take the blocks' length from")
            derived += block_overrides(args.config_dir, args.config, length)
    elif resume and resume != args.save_dir / "checkpoint_last.pt":  # fairseq's default is the last
        derived = [f"checkpoint.restore_file={hydra_value(str(resume))}"]
    overrides = derived + [choice_override(o) for o in args.overrides]
    cfg = compose(args.config_dir, args.config, overrides)
    if first_only and "mean" in (args.lp_ft, cfg.model.get("pooler_tokens")):
        asks = "--lp-ft mean" if args.lp_ft == "mean" else "pooler_tokens: mean; model.pooler_tokens=first overrides it"
        fail(f"{args.start}: its model ({first_only}) reads <s> only; a head on the mean ({asks}) needs "
             "linformer_roberta or roberta_imported")  # fmt: skip
    lines += [f"override {o}" for o in overrides] + batch_plan(args, cfg)
    if args.lp_ft and not resume and not args.probed.is_file():
        cut = f"{cfg.task.get('truncation') or 'none'} {cfg.task.get('truncation_head_tokens') or 128}"
        reads = f"{cfg.model.get('chunk_length') or 0} {cfg.task.get('max_positions') or 0}"  # as finetuning reads
        lines.append(f"probe {cut} {reads}")
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("plan", help="resume point, overrides and batch of a launch")
    b.add_argument("config_dir", type=Path)
    b.add_argument("config")
    b.add_argument("overrides", nargs="*", help="hydra overrides the run will also get")
    b.add_argument("--world-size", type=int, required=True, help="GPUs (processes) in the run")
    b.add_argument("--save-dir", type=Path, required=True, help="the run's folder (resumes from its checkpoints)")
    b.add_argument("--from", dest="start", type=Path, help="a checkpoint: its model, and its weights to start from")
    b.add_argument("--blocks-of-model-length", action="store_true", help="pretrain on blocks of --from's max_positions")
    b.add_argument("--lp-ft", choices=["first", "mean"], help="start from --probed, CHECKPOINT with a probe's head "
                   "on these states (scripts/probe_head.py; the model reads them too)")  # fmt: skip
    b.add_argument("--probed", type=Path, help="--lp-ft: where the probed checkpoint is (or is to be written)")
    b.add_argument("--batch-size", type=int, help="sequences per GPU per step (default: the config's)")
    b.add_argument("--global-batch", type=int, help="sequences per update (default: the config's)")
    b.add_argument("--dry-run", action="store_true", help="change nothing in --save-dir")
    args = p.parse_args()
    if bool(args.lp_ft) != bool(args.probed) or (args.lp_ft and not args.start):
        p.error("--lp-ft and --probed go together, with --from")
    for flag in ("world_size", "batch_size", "global_batch"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    logging.disable(logging.WARNING)  # fairseq's import-time notices would bury the answer
    plan(args)


if __name__ == "__main__":
    sys.exit(main())
