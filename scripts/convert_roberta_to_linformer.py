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

The keys' E (not the values' F) can be scaled (--key-scale): by n/k (window), which makes each
key the sum of its window's keys and sharpens attention over the windows, or per layer by the
factor closest to the RoBERTa's attention on real text (auto). The default is 1 (window means):
on a real encoder (all-MiniLM-L6-v2, docs/linearize.md) the n/k scale over-sharpened attention
and cost fidelity at n = 128 and 512; on the tiny plateau RoBERTa of docs/warm_start.md it helped.
--compress-type mean|max|conv pools instead (conv starts as mean pooling). docs/warm_start.md
compares them on the bundled sample.

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
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from linformer_fairseq.models.linformer_roberta import LinformerRobertaConfig  # noqa: E402
from linformer_fairseq.modules import COMPRESS_SHARING, COMPRESS_TYPES, SequenceProjection  # noqa: E402
from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS  # noqa: E402
from linformer_tools import checkpoints  # noqa: E402
from linformer_tools.common import fail  # noqa: E402

LINFORMER_ARCH = "linformer_roberta_base"
INITS = ("avg", "subsample", "normal", "xavier")
KEY_SCALES = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)  # what --key-scale auto chooses from


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
    ns.local_window, ns.local_count_once = args.local_window, args.local_count_once
    ns.compress_init = {"avg": "mean", "normal": "normal", "xavier": "xavier"}.get(args.init, "normal")
    ns.shared_kv_compressed = ns.shared_layer_kv_compressed = 0
    return ns  # build_model checks it


def convert(state, args):
    """(Linformer model, its namespace, names of the new projection weights)."""
    ns = linformer_namespace(checkpoints.model_namespace(state), args)
    model = checkpoints.build_model(ns, checkpoints.vocab_size(state))
    # the new projections' length handling is the one asked for: a RoBERTa's weights have none to
    # restore, and a projection loads a missing one as the original example's ("none")
    own = {key: value for key, value in model.state_dict().items() if key.endswith(".length_norm_power")}
    missing = checkpoints.load_weights(model, {**state["model"], **own})
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


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
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
    parser.add_argument("--compress-length-norm", choices=tuple(LENGTH_NORM_POWERS), default="exact",
                        help="linear projections on inputs shorter than n: an input of at most k tokens read with "
                             "softmax attention, longer ones with E stretched over their T tokens (exact, the "
                             "default: docs/linearize.md finds it best finetuned on a real encoder); E stretched "
                             "always (resample); or E's first T columns scaled by (n/T)^p")  # fmt: skip
    parser.add_argument("--local-window", type=int, default=0,
                        help="W: each query also reads the exact keys and values of its W nearest positions (W/2 "
                             "each side), beside the k projected rows (default: 0, none)")  # fmt: skip
    parser.add_argument("--local-count-once", action="store_true",
                        help="with --local-window: each row stands only for the tokens of its window outside the "
                             "query's band (linformer_roberta.py --help)")  # fmt: skip
    parser.add_argument("--init", choices=INITS, default=None, help="how linear projections start (default: avg)")
    parser.add_argument(
        "--key-scale",
        default="1",
        help="multiply the key projections (not the values') by this: a number, 'window' (n/k: window sums of "
        "the keys, a sharper attention over the windows), or 'auto' (per layer, the scale in "
        f"{'/'.join(f'{s:g}' for s in KEY_SCALES)} closest to the RoBERTa's attention on --data's train split). "
        "Needs separate key and value projections with weights (sharing none or headwise, linear or conv); "
        "default: 1 (window means; docs/linearize.md)",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the normal and xavier inits (default: 1)")
    parser.add_argument("--report-json", help="also write the losses and the continuation command to this JSON file")
    checkpoints.add_continuation_args(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
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
    if args.local_window < 0 or args.local_window % 2:
        parser.error(f"--local-window must be an even number >= 0, got {args.local_window}")
    if args.local_count_once and not args.local_window:
        parser.error("--local-count-once recounts the projected rows beside a band: add --local-window")
    checkpoints.check_continuation_args(parser, args)
    if Path(args.output).resolve() == Path(args.roberta).resolve():
        parser.error("the output would overwrite the input checkpoint")
    return args


def main(argv=None):
    args = parse_args(argv)
    state = checkpoints.read_checkpoint(args.roberta)
    kind = checkpoints.model_kind(state, args.roberta)
    roberta_ns, vocab = checkpoints.model_namespace(state), checkpoints.vocab_size(state)
    if kind != "roberta":
        fail(f"{args.roberta} is already a Linformer checkpoint ({checkpoints.arch_name(roberta_ns)})")
    if not args.compressed_dim and not args.layer_compressed_dims:
        args.compressed_dim = max(1, roberta_ns.max_positions // 4)
    args.sample_break_mode = args.sample_break_mode or checkpoints.break_mode(state)
    roberta = None
    if args.data:
        checkpoints.check_data(args.data, args.split, vocab)
        roberta = checkpoints.build_model(roberta_ns, vocab)
        checkpoints.load_weights(roberta, state["model"])

    torch.manual_seed(args.seed)
    model, ns, new = convert(state, args)
    scales = key_scales(model, roberta, args)
    scale_keys(model, scales)
    note = {"from": str(args.roberta), "init": args.init, "key_scales": scales, "new_weights": new}
    checkpoints.write_checkpoint(state, ns, model, args.output, note)
    start = args.init if ns.compress_type == "linear" else {"conv": "mean pooling"}.get(ns.compress_type, "no weights")
    print(f"wrote {args.output}: {ns.encoder_layers} layers, n={ns.max_positions}, "
          f"k={ns.layer_compressed_dims or ns.compressed_dim}, {ns.compress_sharing} {ns.compress_type} projections "
          f"({start}, key scales {', '.join(f'{s:g}' for s in scales)}), local window {ns.local_window}"
          f"{' (counted once)' if ns.local_count_once else ''}; "
          "every RoBERTa weight copied")  # fmt: skip

    rows = {}
    if args.data:
        n, batching = roberta_ns.max_positions, (args.eval_batch_size, args.max_eval_batches, args.eval_seeds)
        ev = (args.data, args.split, n, *batching, args.sample_break_mode)
        rows["RoBERTa (before conversion)"] = checkpoints.masked_lm_loss(roberta, *ev)
        rows["Linformer (right after)"] = checkpoints.masked_lm_loss(model, *ev)
    checkpoints.report_and_continue(args, ns, Path(args.output), rows)


if __name__ == "__main__":
    main()
