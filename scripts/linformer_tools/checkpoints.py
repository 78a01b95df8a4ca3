"""What scripts/convert_roberta_to_linformer.py and scripts/extend_max_positions.py share:
reading a fairseq RoBERTa or Linformer checkpoint and rebuilding its model, writing the new
model as a checkpoint fairseq loads, the masked-LM loss report, and the continued pretraining
(fairseq-train --restore-file) they run or print.

It imports fairseq: a script that wants fairseq's import-time logging quiet configures logging
before importing this module."""

import argparse
import copy
import json
import math
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils, options
from fairseq.data import Dictionary
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY, MODEL_REGISTRY
from fairseq.models import build_model as fairseq_build_model
from fairseq.models.roberta import RobertaModel
from omegaconf import OmegaConf
from torch import nn

import linformer_fairseq  # registers the Linformer and allow-lists its checkpoints' types

from . import fairseq_train
from .common import PLUGIN_DIR, fail

# fairseq's data loaders ask for pinned memory, which a run without an accelerator cannot give
warnings.filterwarnings("ignore", message=".*pin_memory.*")
# fairseq's block dataset ('complete' mode) hands numpy 2 a tensor through np.array(copy=False)
warnings.filterwarnings("ignore", message="__array__ implementation doesn't accept a copy keyword")
POSITIONS_KEY = "encoder.sentence_encoder.embed_positions.weight"
TOKENS_KEY = "encoder.sentence_encoder.embed_tokens.weight"


# ---------------------------------------------------------------- checkpoints


def read_checkpoint(path):
    """fairseq's own loader (it upgrades old ``args``-only checkpoints to a cfg), on the safe
    unpickler: the plugin's import allow-lists what fairseq checkpoints hold."""
    path = Path(path)
    if not path.is_file():
        fail(f"{path}: no such checkpoint file")
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    except Exception as e:  # not a torch file, or not a fairseq checkpoint
        reason = (str(e).splitlines() or [""])[0][:200]
        fail(f"{path}: not a readable fairseq checkpoint ({type(e).__name__}: {reason})")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or state.get("cfg") is None:
        fail(f"{path}: not a fairseq checkpoint (no model weights or config)")
    return state


def model_namespace(state) -> argparse.Namespace:
    """The checkpoint's model config as a Namespace (fairseq-train stores one; hydra runs a dict)."""
    model = state["cfg"]["model"]
    if isinstance(model, argparse.Namespace):
        return copy.deepcopy(model)
    if OmegaConf.is_config(model):
        model = OmegaConf.to_container(model, resolve=True, enum_to_str=True)
    if isinstance(model, dict):
        return argparse.Namespace(**model)
    fail(f"the checkpoint's model config is a {type(model).__name__}, not a fairseq model config")


def arch_name(ns) -> str:
    """The model's name: fairseq-train stores it as ``arch``, fairseq-hydra-train as ``_name``."""
    return getattr(ns, "_name", None) or getattr(ns, "arch", None) or "?"


def model_kind(state, path) -> str:
    """'roberta' or 'linformer'; fails on any other model."""
    ns = model_namespace(state)
    cls = ARCH_MODEL_REGISTRY.get(arch_name(ns)) or MODEL_REGISTRY.get(arch_name(ns))
    kind = None
    if cls is not None and issubclass(cls, linformer_fairseq.LinformerRobertaModel):
        kind = "linformer"
    elif cls is not None and issubclass(cls, RobertaModel):
        kind = "roberta"
    if kind is None or TOKENS_KEY not in state["model"]:
        fail(f"{path}: not a RoBERTa or Linformer checkpoint (model {arch_name(ns)!r})")
    if POSITIONS_KEY not in state["model"]:
        fail(f"{path}: the model has no learned positional embeddings ({POSITIONS_KEY})")
    return kind


def vocab_size(state) -> int:
    """The dictionary size the model was built with (masked_lm's <mask> included): the rows of
    its token embedding, since the checkpoint does not hold the dictionary."""
    return state["model"][TOKENS_KEY].size(0)


def build_model(ns, vocab: int):
    """The model ``ns`` describes, with fresh weights, as fairseq builds it from a checkpoint.
    Only the dictionary's size and pad index matter to a RoBERTa, so a stand-in of the right
    size replaces the data the checkpoint was trained on."""
    dictionary = Dictionary()
    while len(dictionary) < vocab:
        dictionary.add_symbol(f"<w{len(dictionary)}>")
    ns = copy.deepcopy(ns)
    ns.load_checkpoint_heads = True  # register the checkpoint's classification heads on load
    try:
        return fairseq_build_model(ns, SimpleNamespace(source_dictionary=dictionary))
    except ValueError as e:  # the plugin's checks of k, sharing, ...
        fail(str(e))


def load_weights(model, weights):
    """Load ``weights`` (after fairseq's upgrade, which also registers classification heads)
    and return the model's keys that they did not provide."""
    weights = dict(weights)
    model.upgrade_state_dict(weights)
    missing, unexpected = nn.Module.load_state_dict(model, weights, strict=False)
    if unexpected:
        fail(f"the checkpoint has weights the new model lacks: {', '.join(unexpected[:5])}")
    return missing


def write_checkpoint(state, ns, model, path, note: dict, max_positions=None):
    """A checkpoint fairseq-train --restore-file, --finetune-from-model and the hub load: the
    original's config with the new model config, no optimizer, scheduler, meter or data
    iterator state (none of them would fit the new parameters), 0 updates. ``max_positions``
    (n, n'): the stored task's block or truncation length n becomes n'."""
    cfg = (
        OmegaConf.to_container(state["cfg"], resolve=True, enum_to_str=True)
        if OmegaConf.is_config(state["cfg"])
        else dict(state["cfg"])
    )
    cfg["model"] = ns
    task = cfg.get("task")
    if max_positions and isinstance(task, dict):
        for key in ("tokens_per_sample", "max_positions"):
            if task.get(key) == max_positions[0]:
                task[key] = max_positions[1]
    history = (state.get("optimizer_history") or [{}])[-1]
    out = {
        "args": None,
        "cfg": cfg,
        "model": {name: tensor.cpu() for name, tensor in model.state_dict().items()},  # loads on any machine
        "optimizer_history": [
            {
                "criterion_name": history.get("criterion_name", "MaskedLmLoss"),
                "optimizer_name": history.get("optimizer_name", "FairseqAdam"),
                "lr_scheduler_state": {},
                "num_updates": 0,
            }
        ],
        "task_state": state.get("task_state", {}),
        # a data iterator at the start of epoch 1: what a fresh run has
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 0, "shuffle": True, "version": 2}},
        "last_optimizer_state": None,
        "warm_start": note,  # where it came from; fairseq ignores unknown keys
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    torch.save(out, tmp)
    os.replace(tmp, path)  # a killed run never leaves a truncated checkpoint under the name


# ---------------------------------------------------------------- masked-LM loss


def check_data(data: str, split: str, vocab: int):
    """Fail before anything is built or written if --data cannot give the loss: no data-bin, no
    such split, or a dictionary other than the model's (the ids would mean other words)."""
    first = Path(data.split(":")[0])
    if not (first / "dict.txt").is_file():
        fail(f"{first}: no dict.txt (--data takes a fairseq data-bin folder)")
    if not (first / f"{split}.idx").is_file():
        fail(f"{first}: no '{split}' split ({split}.bin/.idx); choose another with --split")
    size = len(Dictionary.load(str(first / "dict.txt"))) + 1  # masked_lm adds <mask>
    if size != vocab:
        fail(
            f"{first}/dict.txt has {size} symbols with <mask>, the model {vocab}: binarize with the model's dictionary"
        )


def break_mode(state) -> str:
    """How the checkpoint's masked-LM pretraining cut its blocks (none for other tasks): a
    model trained on blocks of whole sentences ('complete') never saw its last positions filled."""
    task = state["cfg"].get("task") or {}
    return str(task.get("sample_break_mode", "none")) if task.get("_name") == "masked_lm" else "none"


def masked_lm_loss(model, data, split, n, batch_size=16, max_batches=0, seeds=1, sample_break_mode="none"):
    """Masked-LM loss in bits per masked token on blocks of at most n tokens of ``split`` cut
    as ``sample_break_mode`` says, as fairseq-train's validation computes it (fairseq's
    masked_lm task: 15% of the tokens, 80/10/10 mask/random/keep), pooled over the masks of
    ``seeds`` seeds. A block's mask depends only on the seed and the block's index, so models
    at the same n see the same masks. Returns (bits, masked tokens, blocks)."""
    from fairseq.tasks.masked_lm import MaskedLMConfig, MaskedLMTask

    total, count, blocks = 0.0, 0, 0
    model.eval()
    for seed in range(1, seeds + 1):
        task = MaskedLMTask.setup_task(
            MaskedLMConfig(data=data, tokens_per_sample=n, sample_break_mode=sample_break_mode, seed=seed)
        )
        task.load_dataset(split, combine=False, epoch=1)
        batches = task.get_batch_iterator(
            dataset=task.dataset(split),
            max_sentences=batch_size,
            max_positions=n,
            ignore_invalid_inputs=True,
            seed=seed,
            num_workers=0,
        ).next_epoch_itr(shuffle=False)
        pad = task.source_dictionary.pad()
        with torch.no_grad():
            for i, sample in enumerate(batches):
                if max_batches and i >= max_batches:
                    break
                target = sample["target"]
                masked = target.ne(pad)
                logits = model(**sample["net_input"], masked_tokens=masked)[0]
                total += F.cross_entropy(logits.float(), target[masked], reduction="sum").item()
                count += int(masked.sum())
                blocks += target.size(0) if seed == 1 else 0
    return total / max(count, 1) / math.log(2), count, blocks


def evaluate_checkpoint(path, data, split, batch_size, max_batches, seeds, sample_break_mode=None):
    """masked_lm_loss of the checkpoint at PATH (the continuation's last), at its own n."""
    state = read_checkpoint(path)
    ns = model_namespace(state)
    model = build_model(ns, vocab_size(state))
    missing = load_weights(model, state["model"])
    if missing:
        fail(f"{path}: weights missing for {', '.join(missing[:5])}")
    mode = sample_break_mode or break_mode(state)
    return masked_lm_loss(model, data, split, ns.max_positions, batch_size, max_batches, seeds, mode)


# ---------------------------------------------------------------- continued pretraining


def fairseq_train_model_flags(ns) -> list:
    """The fairseq-train flags (--arch and the model options) that rebuild the model ``ns``
    describes: fairseq-train --restore-file builds the model from its command line, not from
    the checkpoint. Verified by parsing them back."""
    arch = arch_name(ns)
    config = MODEL_DATACLASS_REGISTRY.get(arch)

    def parse(flags):
        """The model options as fairseq-train would build the model from ``flags``."""
        parser = options.get_training_parser()
        argv = ["DATA", "--task", "masked_lm", "--user-dir", str(PLUGIN_DIR), "--arch", arch, *flags]
        args = options.parse_args_and_arch(parser, argv)
        group = next(g for g in parser._action_groups if g.title == "Model-specific configuration")
        built = {}
        for action in group._group_actions:
            if hasattr(args, action.dest):
                built[action.dest] = getattr(args, action.dest)
            elif config is not None and action.dest in config.__dataclass_fields__:
                # a config-driven model (hydra's model._name) fills what is not given from its dataclass
                built[action.dest] = config.__dataclass_fields__[action.dest].default
        return built, group._group_actions

    defaults, actions = parse([])
    flags = []
    for action in actions:
        want = getattr(ns, action.dest, None)
        if want is None or want == defaults.get(action.dest):
            continue
        option = max(action.option_strings, key=len)
        if action.nargs == 0:  # store_true / store_false: the flag toggles the default
            flags.append(option)
        else:
            flags += [option, str(want)]
    built, _ = parse(flags)
    wrong = [
        a.dest for a in actions if getattr(ns, a.dest, None) is not None and built.get(a.dest) != getattr(ns, a.dest)
    ]
    if wrong:
        fail(f"cannot express the model's {', '.join(wrong)} as fairseq-train flags")
    return ["--arch", arch, *flags]


def continuation_command(ns, checkpoint, data, save_dir, updates, lr, batch_size, sample_break_mode="none", seed=1):
    """fairseq-train from ``checkpoint``: its weights, a new optimizer, lr schedule (warmup
    over the first 10%), meters and data iterator (the --reset-* flags)."""
    return [
        sys.executable, "-m", "fairseq_cli.train", data, *fairseq_train.shared_flags(),
        *fairseq_train_model_flags(ns),
        "--task", "masked_lm", "--criterion", "masked_lm",
        "--tokens-per-sample", str(ns.max_positions), "--sample-break-mode", sample_break_mode,
        "--restore-file", str(checkpoint),
        "--reset-optimizer", "--reset-lr-scheduler", "--reset-meters", "--reset-dataloader",
        "--lr", str(lr), "--warmup-updates", str(max(1, updates // 10)),
        "--total-num-update", str(updates), "--max-update", str(updates),
        "--batch-size", str(batch_size), "--seed", str(seed),
        "--disable-validation", "--no-epoch-checkpoints", "--save-dir", str(save_dir), "--log-interval", "10",
    ]  # fmt: skip


def run_continuation(command, save_dir) -> Path:
    """Run it, logging to SAVE_DIR/train.log; returns the last checkpoint."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    log = save_dir / "train.log"
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["(empty log)"]
        fail(f"fairseq-train exited {done.returncode}; see {log} ({tail[0][:200]})")
    return save_dir / "checkpoint_last.pt"


def add_continuation_args(parser):
    """The loss-report and continuation options, the same in both scripts."""
    group = parser.add_argument_group("loss report and continued pretraining")
    group.add_argument(
        "--data",
        help="fairseq data-bin (colon-separated shards allowed) to report the masked-LM loss on, and to continue on",
    )
    group.add_argument(
        "--sample-break-mode",
        choices=("none", "complete", "complete_doc", "eos"),
        help="how the text is cut into blocks for the loss and the continuation (default: as the checkpoint's "
        "pretraining did)",
    )
    group.add_argument(
        "--split", default="valid", help="split of the first --data folder the loss is reported on (default: valid)"
    )
    group.add_argument("--eval-batch-size", type=int, default=16, help="blocks per evaluation batch (default: 16)")
    group.add_argument(
        "--max-eval-batches", type=int, default=0, help="evaluate on at most this many batches (default: 0, all)"
    )
    group.add_argument(
        "--eval-seeds", type=int, default=1, help="pool the loss over the masks of this many seeds (default: 1)"
    )
    group.add_argument(
        "--continue-updates",
        type=int,
        default=0,
        help="run fairseq-train --restore-file OUT for this many masked-LM updates on --data's train split and "
        "report the loss after them (default: 0: print the command)",
    )
    group.add_argument("--continue-dir", help="save dir of that run (default: OUT without .pt, + '-continued')")
    group.add_argument(
        "--lr",
        type=float,
        default=5e-4,
        help="peak lr of the continuation, after a warmup of 10%% of its updates, then linear decay (default: 5e-4)",
    )
    group.add_argument("--batch-size", type=int, default=16, help="blocks per update in the continuation (default: 16)")


def check_continuation_args(parser, args):
    """Reject bad loss-report and continuation options before any checkpoint is read."""
    for name in ("eval_batch_size", "batch_size", "eval_seeds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.continue_updates < 0 or args.max_eval_batches < 0:
        parser.error("--continue-updates and --max-eval-batches must be >= 0")
    if args.continue_updates and not args.data:
        parser.error("--continue-updates needs --data")
    if args.lr <= 0:
        parser.error("--lr must be > 0")


def report_and_continue(args, ns, out_path, rows):
    """Print the losses (``rows``: name -> (bits, tokens, blocks)), run or print the
    continuation, write --report-json."""
    save_dir = Path(args.continue_dir or str(out_path).removesuffix(".pt") + "-continued")
    updates = args.continue_updates or 100
    data = args.data or "DATA"
    command = continuation_command(
        ns, out_path, data, save_dir, updates, args.lr, args.batch_size, args.sample_break_mode, args.seed
    )
    if args.continue_updates:
        last = run_continuation(command, save_dir)
        batching = (args.eval_batch_size, args.max_eval_batches, args.eval_seeds, args.sample_break_mode)
        rows[f"after {updates} updates"] = evaluate_checkpoint(last, args.data, args.split, *batching)
    if rows:
        print(f"masked-LM loss on {args.data.split(':')[0]} '{args.split}', bits per masked token:")
        for name, (bits, tokens, blocks) in rows.items():
            print(f"  {name:<32} {bits:.3f}   ({blocks} blocks, {tokens} masked tokens)")
    if not args.continue_updates:
        print("continue pretraining with:\n  " + shlex.join(command))
    if args.report_json:
        report = {
            name: {"loss_bits": bits, "masked_tokens": tokens, "blocks": blocks}
            for name, (bits, tokens, blocks) in rows.items()
        }
        Path(args.report_json).write_text(
            json.dumps({"checkpoint": str(out_path), "losses": report, "continuation": shlex.join(command)}, indent=2)
            + "\n"
        )
