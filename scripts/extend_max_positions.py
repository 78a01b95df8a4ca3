#!/usr/bin/env python3
"""Extend a trained Linformer (or RoBERTa) checkpoint from n to n' > n positions (or shorten a
RoBERTa to n' < n: it keeps its first n' positions, exact on inputs of at most n' tokens).

Positions: fairseq's learned positional embedding has n + padding_idx + 1 rows (real positions
start at row padding_idx + 1 = 2); the n trained rows are copied periodically, so position p of
the new model starts as position p mod n (as Longformer did for RoBERTa). The rows before the
offset are copied as they are.

Projections (Linformer only), by ``--projections``:

  periodic  (default) the sequence is read as n'/n copies of the trained length, like the
            positions. Linear E (k x n): tiled along the length axis to k x n' and scaled by
            (n/n')^p, p being the checkpoint's length_norm_power: the projection of a T-token
            input, (n'/T)^p E'[:, :T] X, is then the original (n/T)^p E[:, :T] X for every
            T <= n, and for p = 1 (--compress-length-norm linear) a full n'-token block projects
            to the average of its n-token periods' projections, at the trained magnitude (for
            p = 0 the rows sum n'/n periods, so they grow by n'/n on full blocks). Pooling and
            conv keep their window of n/k positions, so k grows to k n'/n. Either way the
            model computes exactly what it computed before on every input of at most n tokens.
  stretch   k stays (or --compressed-dim for pooling/conv): new position t' takes the role of
            old position floor(t' n/n') and an even share of its weight, so every row of a
            linear E keeps its sum (an averaging row still averages, over a window n'/n times
            wider); pooling windows widen to n'/k; a conv kernel is resampled to the new width
            the same way. Outputs on short inputs change.

``--local-window W`` gives a Linformer an exact local band of W neighbours beside its projections
(its far-field offsets start at 0, or keep the checkpoint's), at n or at n'. ``--local-count-once``
makes its projected rows leave out the tokens the band reads (``--no-local-count-once``: count them
again, as before; neither keeps the checkpoint's).

``--compress-length-norm MODE`` also switches a Linformer's linear projections to another
length handling (what an input shorter than n' does with E) before any extension; without
``--max-positions`` that is all it does: ``exact`` on a model distilled under ``resample``
reads every input of at most k tokens with softmax attention over its tokens, the weights
unchanged.

With ``--data`` the script reports the masked-LM loss of the original at n and of the extended
model at n' (blocks of n' tokens), and with ``--continue-updates N`` after N updates of
continued pretraining at n' (fairseq-train --restore-file OUT, which it runs). See
docs/warm_start.md for measurements.
"""

import logging

# before fairseq's import, whose modules configure the root logger at DEBUG and log at import
logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")

import argparse  # noqa: E402
import copy  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from linformer_fairseq.modules import SequenceProjection  # noqa: E402
from linformer_fairseq.modules.linformer_attention import EXACT, LENGTH_NORM_POWERS, RESAMPLE  # noqa: E402
from linformer_tools import checkpoints  # noqa: E402
from linformer_tools.common import fail  # noqa: E402


def periodic_positions(weight: torch.Tensor, offset: int, new_positions: int) -> torch.Tensor:
    """Rows [0, offset) as they are, then row offset + p = old row offset + (p mod n)."""
    n = weight.size(0) - offset
    rows = torch.arange(new_positions) % n + offset
    return torch.cat([weight[:offset], weight[rows]])


def stretch(W: torch.Tensor, new_n: int) -> torch.Tensor:
    """Resample the last axis of W (length n) to new_n: new position t' takes the role of old
    position floor(t' n / n') and an even share of its weight, so every old position's total
    weight, and every row's sum, is kept."""
    n = W.size(-1)
    old = torch.arange(new_n) * n // new_n
    shares = torch.bincount(old, minlength=n).to(W.dtype)
    return W[..., old] / shares[old]


def extend_projection(old: SequenceProjection, new: SequenceProjection, method: str) -> torch.Tensor:
    """The new projection weight (linear E, or a conv kernel) built from the old one."""
    W = old.weight.detach()
    n, new_n = old.max_positions, new.max_positions
    if old.kind == "linear":
        # (n'/T)^p (n/n')^p = (n/T)^p: unchanged on T <= n
        if method == "periodic" and old.length_power not in (RESAMPLE, EXACT):
            return W[..., torch.arange(new_n) % n] * (n / new_n) ** old.length_power
        return stretch(W, new_n)
    # conv: a kernel as wide as its window n/k; periodic keeps the window, stretch widens it
    return W.clone() if new.stride == old.stride else stretch(W, new.stride)


def new_compressed_dims(old_model, n: int, new_n: int, method: str, compressed_dim: int):
    """k of every layer of the extended model."""
    dims = []
    for layer in old_model.encoder.sentence_encoder.layers:
        proj = layer.self_attn.compress_k
        k = proj.k
        if compressed_dim:
            if proj.kind == "linear" and compressed_dim != k:
                fail(f"a linear E keeps its k={k} rows (it is resampled along the length only); "
                     "--compressed-dim applies to pooling and conv projections")  # fmt: skip
            if method == "periodic" and proj.kind != "linear":
                fail("--compressed-dim goes with --projections stretch (periodic keeps the window n/k: k grows)")
            k = compressed_dim
        elif method == "periodic" and proj.kind != "linear":
            window = n // k
            if new_n % window:
                fail(f"--projections periodic keeps the pooling window of n/k = {window}: n'={new_n} is no multiple")
            k = new_n // window
        if k > new_n:
            fail(f"projected length k={k} is larger than n'={new_n}")
        if proj.kind != "linear" and new_n % k:
            fail(f"--compress-type {proj.kind} needs n'={new_n} divisible by k={k}")
        dims.append(k)
    return dims


def extended_namespace(ns, kind: str, new_n: int, dims):
    ns = copy.deepcopy(ns)
    ns.max_positions = ns.max_source_positions = new_n
    if kind == "linformer":
        # k written out, so that the legacy ratio --compressed cannot rescale it with n
        uniform = len(set(dims)) == 1
        ns.compressed_dim = dims[0] if uniform else 0
        ns.layer_compressed_dims = "" if uniform else ",".join(map(str, dims))
    return ns


def switch_length_norm(model, ns, mode: str):
    """Set every linear projection of ``model`` to length handling ``mode`` (in its buffer,
    which the checkpoint keeps) and ``ns`` to match."""
    linear = [m for m in model.modules() if isinstance(m, SequenceProjection) and m.kind == "linear"]
    if not linear:
        fail(f"--compress-length-norm {mode}: the checkpoint has no linear projections (only E has a length handling)")
    for projection in linear:
        projection.length_power = LENGTH_NORM_POWERS[mode]
        projection.length_norm_power.fill_(projection.length_power)
    ns.compress_length_norm = mode


def with_local_window(model, ns, window: int | None, count_once: bool | None, vocab: int):
    """``model`` rebuilt with a local band of ``window`` and its rows counted once or not
    (``count_once``; None: as it is), ``ns`` set to match."""
    if window is None and count_once is None:
        return model
    set_local_band(ns, window, count_once)
    banded = checkpoints.build_model(ns, vocab)
    weights = model.state_dict()
    if window == 0:  # the band's far-field offsets go with it
        weights = {key: value for key, value in weights.items() if not key.endswith(".local_far_bias")}
    missing = checkpoints.load_weights(banded, weights)
    if missing:
        fail(f"cannot map the weights onto the model with a band: missing {', '.join(missing[:5])}")
    return banded


def set_local_band(ns, window: int | None, count_once: bool | None):
    """The namespace's band set to ``window`` and ``count_once`` where given (a removed band is not recounted)."""
    if window is not None:
        ns.local_window = window
    if count_once is not None:
        ns.local_count_once = count_once
    if not getattr(ns, "local_window", 0):
        ns.local_count_once = False


def extend(state, kind: str, args):
    """(new model, its namespace, original model, n): the original with --compress-length-norm's
    length handling, extended to --max-positions when that is not n."""
    ns = copy.deepcopy(checkpoints.model_namespace(state))
    n = ns.max_positions
    args.max_positions = args.max_positions or n
    if args.compress_length_norm and kind != "linformer":
        fail(f"--compress-length-norm applies to Linformer checkpoints, not a {kind}")
    band = args.local_window is not None or args.local_count_once is not None
    if band and kind != "linformer":
        flag = "--local-window" if args.local_window is not None else "--local-count-once"
        fail(f"{flag} applies to Linformer checkpoints, not a {kind}")
    if args.local_count_once and not (
        getattr(ns, "local_window", 0) if args.local_window is None else args.local_window
    ):
        fail("--local-count-once recounts the projected rows beside a band: the model has none, add --local-window")
    switches = args.compress_length_norm or band
    if args.max_positions == n and not switches or args.max_positions < n and kind != "roberta":
        longer = "larger than" if kind != "roberta" else "other than"
        fail(f"--max-positions {args.max_positions} must be {longer} the checkpoint's n={n}")
    if kind == "roberta" and args.compressed_dim:
        fail("--compressed-dim applies to Linformer checkpoints; a RoBERTa has no projections")
    vocab = checkpoints.vocab_size(state)
    old = checkpoints.build_model(ns, vocab)
    missing = checkpoints.load_weights(old, state["model"])
    if missing:
        fail(f"the checkpoint lacks weights of its own model: {', '.join(missing[:5])}")
    source = old
    if args.compress_length_norm:  # before extending: E is extended as the new handling reads it
        source = copy.deepcopy(old)
        switch_length_norm(source, ns, args.compress_length_norm)
    if args.max_positions == n:
        return with_local_window(source, ns, args.local_window, args.local_count_once, vocab), ns, old, n
    dims = None
    if kind == "linformer":
        dims = new_compressed_dims(source, n, args.max_positions, args.projections, args.compressed_dim)
    new_ns = extended_namespace(ns, kind, args.max_positions, dims)
    set_local_band(new_ns, args.local_window, args.local_count_once)
    new = checkpoints.build_model(new_ns, vocab)

    weights = source.state_dict()
    if args.local_window == 0:  # the band's far-field offsets go with it
        weights = {key: value for key, value in weights.items() if not key.endswith(".local_far_bias")}
    positions = source.encoder.sentence_encoder.embed_positions
    weights[checkpoints.POSITIONS_KEY] = periodic_positions(
        positions.weight.detach(), positions.padding_idx + 1, args.max_positions
    )
    new_modules = dict(new.named_modules(remove_duplicate=False))
    for name, module in source.named_modules(remove_duplicate=False):  # a layerwise E under each of its names
        if isinstance(module, SequenceProjection) and module.weight is not None:
            weights[f"{name}.weight"] = extend_projection(module, new_modules[name], args.projections)
    missing = checkpoints.load_weights(new, weights)  # registers the classification heads too
    if missing:  # a layout this script does not know
        fail(f"cannot map the weights onto the extended model: missing {', '.join(missing[:5])}")
    return new, new_ns, old, n


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="fairseq Linformer or RoBERTa checkpoint at n positions (.pt)")
    parser.add_argument("output", help="checkpoint to write, at n' positions (.pt)")
    parser.add_argument(
        "--max-positions",
        type=int,
        help="n', larger than the checkpoint's n (a RoBERTa: or smaller); default: n (with --compress-length-norm)",
    )
    parser.add_argument(
        "--compress-length-norm",
        choices=tuple(LENGTH_NORM_POWERS),
        help="switch the Linformer's linear projections to this length handling (linformer_roberta.py --help)",
    )
    parser.add_argument(
        "--local-window",
        type=int,
        help="give the Linformer an exact local band of this many neighbours (even; 0 removes one; "
        "linformer_roberta.py --help)",
    )
    parser.add_argument(
        "--local-count-once",
        action=argparse.BooleanOptionalAction,
        help="the band's tokens are left out of the projected rows' counts; --no-local-count-once: counted in "
        "them again, as before (default: the checkpoint's; linformer_roberta.py --help)",
    )
    parser.add_argument(
        "--projections",
        choices=("periodic", "stretch"),
        default="periodic",
        help="how Linformer projections are extended (default: periodic, exact on inputs of at most n tokens)",
    )
    parser.add_argument(
        "--compressed-dim",
        type=int,
        default=0,
        help="with --projections stretch: the new k of pooling/conv projections (default: keep k)",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed of the continuation (default: 1)")
    parser.add_argument("--report-json", help="also write the losses and the continuation command to this JSON file")
    checkpoints.add_continuation_args(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.max_positions, args.compress_length_norm, args.local_window, args.local_count_once) == (None,) * 4:
        parser.error(
            "nothing to do: give --max-positions, --compress-length-norm, --local-window, --local-count-once or several"
        )
    if args.local_window is not None and (args.local_window < 0 or args.local_window % 2):
        parser.error(f"--local-window must be an even number >= 0, got {args.local_window}")
    if args.max_positions is not None and args.max_positions < 1 or args.compressed_dim < 0:
        parser.error("--max-positions must be >= 1 and --compressed-dim >= 0")
    checkpoints.check_continuation_args(parser, args)
    if Path(args.output).resolve() == Path(args.checkpoint).resolve():
        parser.error("the output would overwrite the input checkpoint")
    return args


def main(argv=None):
    args = parse_args(argv)
    state = checkpoints.read_checkpoint(args.checkpoint)
    kind = checkpoints.model_kind(state, args.checkpoint)
    if args.data:
        checkpoints.check_data(args.data, args.split, checkpoints.vocab_size(state))
    model, ns, old, n = extend(state, kind, args)
    linformer = kind == "linformer"
    args.sample_break_mode = args.sample_break_mode or checkpoints.break_mode(state)
    note = {"from": str(args.checkpoint), "extended_from": n, "projections": args.projections if linformer else None}
    note["compress_length_norm"] = args.compress_length_norm
    checkpoints.write_checkpoint(state, ns, model, args.output, note, max_positions=(n, args.max_positions))
    switched = f"; compress length norm {args.compress_length_norm}" if args.compress_length_norm else ""
    switched += f"; local window {args.local_window}" if args.local_window is not None else ""
    switched += {True: "; local count once on", False: "; local count once off", None: ""}[args.local_count_once]
    if args.max_positions == n:
        names = {v: k for k, v in LENGTH_NORM_POWERS.items()}
        was = {names[m.length_power] for m in old.modules() if isinstance(m, SequenceProjection) and m.kind == "linear"}
        print(f"wrote {args.output}: {kind} at n={n}{switched} (was {', '.join(sorted(was))}), the same weights")
    else:
        how = (
            f", k={ns.layer_compressed_dims or ns.compressed_dim}; projections {args.projections}" if linformer else ""
        )
        positions = "positions copied periodically" if args.max_positions > n else "its first positions kept"
        print(f"wrote {args.output}: {kind} at n'={args.max_positions} (from n={n}{how}); {positions}{switched}")

    rows = {}
    if args.data:
        rest = (args.max_eval_batches, args.eval_seeds, args.sample_break_mode)
        rows[f"original at n={n}"] = checkpoints.masked_lm_loss(
            old, args.data, args.split, n, args.eval_batch_size, *rest
        )
        # the same text in blocks n'/n times longer: fewer blocks a batch, the same tokens
        batch = max(1, math.ceil(args.eval_batch_size * n / args.max_positions))
        new = f"compress length norm {args.compress_length_norm} at n={n}" if args.max_positions == n else None
        rows[new or f"extended at n'={args.max_positions}"] = checkpoints.masked_lm_loss(
            model, args.data, args.split, args.max_positions, batch, *rest
        )
    checkpoints.report_and_continue(args, ns, Path(args.output), rows)


if __name__ == "__main__":
    main()
