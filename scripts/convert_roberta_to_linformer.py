#!/usr/bin/env python3
"""Warm-start a Linformer from a fairseq RoBERTa checkpoint.

Writes a ``linformer_roberta`` checkpoint with the RoBERTa's embeddings, layers, masked-LM head
and classification heads unchanged, and new sequence projections E/F (k x n) chosen to keep
attention close to the RoBERTa's on real inputs. How a linear E starts (--init):

  avg        (default) row j averages the window of n/k positions [j n/k, (j+1) n/k): keys
             and values become the means of their windows' keys and values (the maps are
             affine), and attention runs over k windows instead of n tokens. At k = n it is the
             identity: the Linformer computes exactly the RoBERTa.
  subsample  row j picks the middle token of window j: attention over k of the n tokens.
  normal, xavier
             the plugin's random inits (what a Linformer trained from scratch starts with).

Averaging flattens attention, so the keys' E (not the values' F) is scaled (--key-scale): by
n/k by default, which makes each key the sum of its window's keys, or per layer by the factor
closest to the RoBERTa's attention on real text (auto). --compress-type mean|max|conv pools
instead (conv starts as mean pooling). docs/warm_start.md compares them on the bundled sample.

With --data (a fairseq data-bin binarized with the RoBERTa's dictionary) the script reports the
masked-LM loss in bits per masked token, on the same blocks and masks for every model: the
RoBERTa's, the converted model's, and with --continue-updates N the loss after N updates of
fairseq-train --restore-file OUTPUT (which it runs; without the flag it prints the command).
"""

import logging

# before fairseq's import, whose modules configure the root logger at DEBUG and log at import
logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fairseq import checkpoint_utils, options  # noqa: E402
from fairseq.data import Dictionary  # noqa: E402
from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY, MODEL_REGISTRY  # noqa: E402
from fairseq.models import build_model as fairseq_build_model  # noqa: E402
from fairseq.models.roberta import RobertaModel  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402

import linformer_fairseq  # noqa: E402  (registers the Linformer and allow-lists its checkpoints' types)
from linformer_fairseq.models.linformer_roberta import LinformerRobertaConfig  # noqa: E402
from linformer_fairseq.modules import COMPRESS_SHARING, COMPRESS_TYPES, SequenceProjection  # noqa: E402
from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS  # noqa: E402
from linformer_tools.common import PLUGIN_DIR, fail  # noqa: E402

LINFORMER_ARCH = "linformer_roberta_base"
INITS = ("avg", "subsample", "normal", "xavier")
KEY_SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)  # what --key-scale auto chooses from
# fairseq's data loaders ask for pinned memory, which a run without an accelerator cannot give
warnings.filterwarnings("ignore", message=".*pin_memory.*")
# fairseq's block dataset ('complete' mode) hands numpy 2 a tensor through np.array(copy=False)
warnings.filterwarnings("ignore", message="__array__ implementation doesn't accept a copy keyword")
POSITIONS_KEY = "encoder.sentence_encoder.embed_positions.weight"
TOKENS_KEY = "encoder.sentence_encoder.embed_tokens.weight"


# ---------------------------------------------------------------- checkpoints (shared with extend_max_positions.py)


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
        "model": model.state_dict(),
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
        sys.executable, "-m", "fairseq_cli.train", data, "--user-dir", str(PLUGIN_DIR),
        *fairseq_train_model_flags(ns),
        "--task", "masked_lm", "--criterion", "masked_lm",
        "--tokens-per-sample", str(ns.max_positions), "--sample-break-mode", sample_break_mode,
        "--restore-file", str(checkpoint),
        "--reset-optimizer", "--reset-lr-scheduler", "--reset-meters", "--reset-dataloader",
        "--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--adam-eps", "1e-6", "--weight-decay", "0.01",
        "--lr", str(lr), "--lr-scheduler", "polynomial_decay", "--warmup-updates", str(max(1, updates // 10)),
        "--total-num-update", str(updates), "--max-update", str(updates),
        "--batch-size", str(batch_size), "--seed", str(seed), "--num-workers", "0",
        # no prefetch thread: fairseq's, still running at interpreter exit, can abort the process
        "--data-buffer-size", "0",
        "--disable-validation", "--no-epoch-checkpoints", "--save-dir", str(save_dir),
        "--log-format", "simple", "--log-interval", "10",
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


# ---------------------------------------------------------------- conversion


def initial_projection(kind: str, shape) -> torch.Tensor:
    """A k x n (or heads x k x n) matrix E that starts the projection as ``kind``."""
    k, n = shape[-2:]
    if kind == "avg":  # windows [j n/k, (j+1) n/k), rounded down (uneven when k does not divide n)
        window = (torch.arange(n) * k) // n
        E = F.one_hot(window, k).t().float()
        E = E / E.sum(1, keepdim=True)
    elif kind == "subsample":
        middle = (torch.arange(k) * n + n // 2) // k  # the middle position of each window
        E = F.one_hot(middle, n).float()
    elif kind == "normal":  # the plugin's default: N(0, 0.02), as fairseq's BERT init
        return torch.randn(shape) * 0.02
    else:  # xavier, as the plugin's --compress-init xavier
        bound = math.sqrt(6.0 / (n + k)) / math.sqrt(2.0)
        return torch.empty(shape).uniform_(-bound, bound)
    return E.expand(shape).clone()


def linformer_namespace(roberta_ns, args) -> argparse.Namespace:
    """The RoBERTa's model config, as the Linformer arch with the requested projections."""
    ns = copy.deepcopy(roberta_ns)
    ns._name = ns.arch = LINFORMER_ARCH
    for f in dataclasses.fields(LinformerRobertaConfig):  # the Linformer fields, at their defaults
        if not hasattr(ns, f.name):
            setattr(ns, f.name, f.default)
    ns.compressed_dim = args.compressed_dim
    ns.layer_compressed_dims = args.layer_compressed_dims or ""
    ns.compress_sharing, ns.compress_type = args.compress_sharing, args.compress_type
    ns.compress_length_norm = args.compress_length_norm
    ns.compress_init = {"avg": "mean", "normal": "normal", "xavier": "xavier"}.get(args.init, "normal")
    ns.shared_kv_compressed = ns.shared_layer_kv_compressed = 0
    return ns  # build_model checks it


def convert(state, args):
    """(Linformer model, its namespace, names of the new projection weights)."""
    ns = linformer_namespace(model_namespace(state), args)
    model = build_model(ns, vocab_size(state))
    missing = load_weights(model, state["model"])
    new = [key for key in missing if ".compress_" in key]
    if len(new) != len(missing):
        lacking = sorted(set(missing) - set(new))[:5]
        fail(f"the RoBERTa checkpoint lacks weights the Linformer needs: {', '.join(lacking)}")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, SequenceProjection) and module.kind == "linear":
                module.weight.copy_(initial_projection(args.init, module.weight.shape))
    return model, ns, new


def key_projections(model):
    """(layer index, E) for every layer whose keys have a projection of their own with weights
    (linear or conv, sharing none or headwise): scaling it scales the keys only."""
    for i, layer in enumerate(model.encoder.sentence_encoder.layers):
        attn = layer.self_attn
        if attn.compress_v is not None and attn.compress_k.weight is not None:
            yield i, attn.compress_k


def scale_keys(model, scales):
    with torch.no_grad():
        for i, projection in key_projections(model):
            projection.weight.mul_(scales[i])


def attention_io(model, tokens):
    """Each layer's self-attention input (query) and output, in one forward of ``model``."""
    seen = []

    def hook(module, args, kwargs, output):
        seen.append((kwargs["query"], output[0]))

    layers = model.encoder.sentence_encoder.layers
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(tokens, features_only=True)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def train_blocks(data: str, n: int, count: int) -> torch.Tensor:
    """``count`` blocks of n tokens (<s> + n - 1 tokens) from the start of --data's train split."""
    from fairseq.data import data_utils

    first = data.split(":")[0]
    dataset = data_utils.load_indexed_dataset(f"{first}/train", None)
    if dataset is None:
        fail(f"{first}: no 'train' split to calibrate the key scales on")
    pieces, total, i = [], 0, 0
    while total < count * (n - 1) and i < len(dataset):
        pieces.append(dataset[i])
        total, i = total + len(dataset[i]), i + 1
    tokens = torch.cat(pieces)[: count * (n - 1)]
    rows = tokens.view(-1, n - 1) if len(tokens) >= n - 1 else tokens.view(1, -1)
    return torch.cat([torch.zeros(rows.size(0), 1, dtype=rows.dtype), rows], dim=1)  # 0: <s>


def calibrate_key_scales(model, roberta, data: str, n: int, blocks: int = 16):
    """Per layer, the key scale from KEY_SCALES whose attention outputs, given the RoBERTa's own
    layer inputs, are closest (relative L2) to the RoBERTa's attention outputs, on ``blocks``
    blocks of --data's train split."""
    reference = attention_io(roberta.eval(), train_blocks(data, n, blocks))
    scales = [1.0] * len(reference)
    model.eval()
    with torch.no_grad():
        for i, projection in key_projections(model):
            query, target = reference[i]
            attn, start = model.encoder.sentence_encoder.layers[i].self_attn, projection.weight.clone()
            errors = {}
            for scale in KEY_SCALES:
                projection.weight.copy_(start * scale)
                errors[scale] = float((attn(query=query)[0] - target).norm() / target.norm())
            scales[i] = min(errors, key=errors.get)
            projection.weight.copy_(start)
    return scales


def key_scales(model, roberta, args):
    """The factor of each layer's key projection, as --key-scale asks."""
    own = dict(key_projections(model))
    layers = len(model.encoder.sentence_encoder.layers)
    if not own:
        if args.key_scale not in ("window", 1.0):
            fail(f"--key-scale needs separate key and value projections with weights; --compress-sharing "
                 f"{args.compress_sharing} --compress-type {args.compress_type} has none")  # fmt: skip
        return [1.0] * layers
    if args.key_scale == "auto":
        return calibrate_key_scales(model, roberta, args.data, roberta.max_positions())
    averaging = args.compress_type == "conv" or args.init == "avg"
    if args.key_scale == "window":  # only an averaging start has window means to sharpen
        return [own[i].max_positions / own[i].k if i in own and averaging else 1.0 for i in range(layers)]
    return [args.key_scale if i in own else 1.0 for i in range(layers)]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roberta", help="fairseq RoBERTa checkpoint (.pt)")
    parser.add_argument("output", help="Linformer checkpoint to write (.pt)")
    parser.add_argument("--compressed-dim", type=int, default=0, help="k, the projected length (default: n/4)")
    parser.add_argument("--layer-compressed-dims", help='k per layer, e.g. "64,64,32,32" (wins over --compressed-dim)')
    parser.add_argument(
        "--compress-sharing",
        choices=COMPRESS_SHARING,
        default="headwise",
        help="projection sharing (default: headwise)",
    )
    parser.add_argument(
        "--compress-type", choices=COMPRESS_TYPES, default="linear", help="projection kind (default: linear)"
    )
    parser.add_argument("--compress-length-norm", choices=tuple(LENGTH_NORM_POWERS), default="none",
                        help="linear projections on inputs shorter than n: scale rows by (n/T)^p (default: none, "
                             "since the avg init's rows are already means)")  # fmt: skip
    parser.add_argument("--init", choices=INITS, default=None, help="how linear projections start (default: avg)")
    parser.add_argument(
        "--key-scale",
        default="window",
        help="multiply the key projections (not the values') by this: a number, 'window' (n/k: window sums of "
        "the keys, a sharper attention over the windows), or 'auto' (per layer, the scale in "
        f"{'/'.join(f'{s:g}' for s in KEY_SCALES)} closest to the RoBERTa's attention on --data's train split). "
        "Needs separate key and value projections with weights (sharing none or headwise, linear or conv); "
        "default: window",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the normal and xavier inits (default: 1)")
    parser.add_argument("--report-json", help="also write the losses and the continuation command to this JSON file")
    add_continuation_args(parser)
    args = parser.parse_args(argv)
    if args.init is not None and args.compress_type != "linear":
        parser.error(f"--init applies to linear projections, not to --compress-type {args.compress_type}")
    args.init = args.init or "avg"
    if args.key_scale not in ("window", "auto"):
        try:
            args.key_scale = float(args.key_scale)
        except ValueError:
            parser.error(f"--key-scale must be a number, 'window' or 'auto', got {args.key_scale!r}")
        if args.key_scale <= 0:
            parser.error("--key-scale must be > 0")
    if args.key_scale == "auto" and not args.data:
        parser.error("--key-scale auto calibrates on --data's train split: give --data")
    if args.compressed_dim < 0:
        parser.error("--compressed-dim must be >= 1")
    check_continuation_args(parser, args)
    if Path(args.output).resolve() == Path(args.roberta).resolve():
        parser.error("the output would overwrite the input checkpoint")
    return args


def main(argv=None):
    args = parse_args(argv)
    state = read_checkpoint(args.roberta)
    if model_kind(state, args.roberta) != "roberta":
        fail(f"{args.roberta} is already a Linformer checkpoint ({arch_name(model_namespace(state))})")
    roberta_ns, vocab = model_namespace(state), vocab_size(state)
    if not args.compressed_dim and not args.layer_compressed_dims:
        args.compressed_dim = max(1, roberta_ns.max_positions // 4)
    args.sample_break_mode = args.sample_break_mode or break_mode(state)
    roberta = None
    if args.data:
        check_data(args.data, args.split, vocab)
        roberta = build_model(roberta_ns, vocab)
        load_weights(roberta, state["model"])

    torch.manual_seed(args.seed)
    model, ns, new = convert(state, args)
    scales = key_scales(model, roberta, args)
    scale_keys(model, scales)
    note = {"from": str(args.roberta), "init": args.init, "key_scales": scales, "new_weights": new}
    write_checkpoint(state, ns, model, args.output, note)
    start = args.init if ns.compress_type == "linear" else {"conv": "mean pooling"}.get(ns.compress_type, "no weights")
    print(f"wrote {args.output}: {ns.encoder_layers} layers, n={ns.max_positions}, "
          f"k={ns.layer_compressed_dims or ns.compressed_dim}, {ns.compress_sharing} {ns.compress_type} projections "
          f"({start}, key scales {', '.join(f'{s:g}' for s in scales)}); every RoBERTa weight copied")  # fmt: skip

    rows = {}
    if args.data:
        n, batching = roberta_ns.max_positions, (args.eval_batch_size, args.max_eval_batches, args.eval_seeds)
        ev = (args.data, args.split, n, *batching, args.sample_break_mode)
        rows["RoBERTa (before conversion)"] = masked_lm_loss(roberta, *ev)
        rows["Linformer (right after)"] = masked_lm_loss(model, *ev)
    report_and_continue(args, ns, Path(args.output), rows)


if __name__ == "__main__":
    main()
