#!/usr/bin/env python3
"""Make a Linformer of a pretrained transformers encoder, trained to compute what it computes.

    python scripts/linearize.py HF_DIR --text FILE [FILE ...] --max-positions N --k K --out DIR

Steps, each written to DIR and skipped when a rerun finds it done (a killed run resumes):

  teacher/          scripts/import_hf.py HF_DIR (checked against transformers)
  teacher-nN.pt     the teacher at N positions when N is not its own n (extend_max_positions.py:
                    shorter keeps the first N positions; longer copies them periodically)
  converted.pt      scripts/convert_roberta_to_linformer.py: the teacher's weights, projections E/F
                    (k x N) started by --init (avg: window means; subsample; or --compress-type
                    mean / conv pooling)
  transfer.pt       attention transfer: layer by layer, only E and F train, so that the layer's
                    Linformer attention reproduces the teacher's softmax attention on the inputs the
                    layer sees (the student's own, layers below already fitted)
  checkpoint.pt     end-to-end distillation: every weight free, the teacher frozen; the loss is the
                    relative squared error of every layer's hidden states. Blocks of N tokens of
                    --text, a share of them (--short-fraction) cut to a random shorter length so
                    that short inputs are trained too. distill-state.pt holds the run in progress
  hf/               the export to transformers (export_hf.py, with the teacher's tokenizer)
  report.json       fidelity before and after each stage, and what each stage cost

Fidelity, on held-out blocks of N tokens (--valid-text, or the last --valid-blocks blocks of
--text): per layer, the relative error ||student - teacher|| / ||teacher|| of the attention
output and of the hidden states (each model on its own inputs, so errors carry upwards), and the
mean cosine of the final hidden states, token by token.
"""

import logging

# before fairseq's import, whose modules configure the root logger at DEBUG and log at import
logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from linformer_fairseq.modules import COMPRESS_SHARING, COMPRESS_TYPES  # noqa: E402
from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS  # noqa: E402
from linformer_tools import checkpoints  # noqa: E402
from linformer_tools.common import SCRIPTS_DIR as SCRIPTS  # noqa: E402
from linformer_tools.common import fail, write_text  # noqa: E402
from linformer_tools.fidelity import (  # noqa: E402
    BOS,
    EOS,
    PAD,
    device_of,
    fidelity,
    layers,
    load,
    run,
    sts_pairs,
    sts_spearman,
    trimmed,
)

# ---------------------------------------------------------------- text


def read_blocks(tokenizer_json, files, n):
    """Blocks of n tokens: <s> (the teacher's [CLS]), n - 2 tokens of running text, </s>."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    ids = []
    for path in files:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        for encoding in tokenizer.encode_batch(lines, add_special_tokens=False):
            ids.extend(encoding.ids)
    body = n - 2
    count = len(ids) // body
    if count == 0:
        fail(f"{', '.join(map(str, files))}: {len(ids)} tokens, fewer than one block of {n}")
    rows = torch.tensor(ids[: count * body]).view(count, body)
    return torch.cat([torch.full((count, 1), BOS), rows, torch.full((count, 1), EOS)], dim=1)


def read_documents(tokenizer_json, files, n):
    """One row a line (a document): <s> its first n - 2 tokens </s>, right-padded to the longest;
    int32, half the memory of a corpus padded to its longest document (trimmed() makes batches long)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    lines = [line for path in files for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        fail(f"{', '.join(map(str, files))}: no documents (non-empty lines)")
    rows = [[BOS, *e.ids[: n - 2], EOS] for e in tokenizer.encode_batch(lines, add_special_tokens=False)]
    documents = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.int32)
    for i, row in enumerate(rows):
        documents[i, : len(row)] = torch.tensor(row)
    return documents


def long_enough(documents, min_tokens, what):
    """The rows of at least MIN_TOKENS tokens (all of them when it is 0)."""
    if not min_tokens:
        return documents
    kept = documents[documents.ne(PAD).sum(1) >= min_tokens]
    print(f"{what}: {len(kept)} of {len(documents)} documents have at least {min_tokens} tokens", flush=True)
    if not len(kept):
        fail(f"{what}: no document has {min_tokens} tokens or more; lower --min-tokens")
    return kept


def shortened(blocks, fraction, generator):
    """A share of the blocks cut to a random length in [4, n) and right-padded (</s> at the end)."""
    blocks = blocks.clone()
    n = blocks.size(1)
    for row in range(blocks.size(0)):
        if torch.rand((), generator=generator) < fraction:
            length = int(torch.randint(4, n, (), generator=generator))
            blocks[row, length - 1], blocks[row, length:] = EOS, PAD
    return blocks


# ---------------------------------------------------------------- models


def teacher_attention(layer, x, padding):
    return layer.self_attn(query=x, key=x, value=x, key_padding_mask=padding, need_weights=False)[0]


def show(name, fid):
    sts = f" | STS-B Spearman {fid['sts']:.4f}" if "sts" in fid else ""
    print(
        f"  {name:<22} cosine {fid['cosine']:.4f}{sts} | attention error by layer "
        + " ".join(f"{e:.2f}" for e in fid["attention"])
        + " | hidden "
        + " ".join(f"{e:.2f}" for e in fid["hidden"]),
        flush=True,
    )


def far_field_offsets(module):
    return [p for name, p in module.named_parameters() if name.endswith("local_far_bias")]


def projection_parameters(module, far_offsets=True):
    """E/F, and with a local band the far field's per-head offsets (unless not ``far_offsets``):
    what the transfer fits."""
    compress = [p for name, p in module.named_parameters() if ".compress_" in f".{name}"]
    return compress + far_field_offsets(module) if far_offsets else compress


def head_outputs(attention, **kwargs):
    """(the heads' outputs before out_proj, ``T x B x C``, the heads' attention weights or None)."""
    seen = []
    handle = attention.out_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            _, weights = attention(**kwargs)
    finally:
        handle.remove()
    return seen[0], weights


def head_analysis(student, teacher, blocks, batch=4, near=2):
    """Per layer and head, on the student's own layer inputs: the relative error of the
    student's head output against the teacher's softmax attention on the same inputs, and how
    local the teacher's head is (the share of its attention within ``near`` positions)."""
    from linformer_tools.models import force_explicit_attention

    force_explicit_attention(teacher)  # per-head weights
    L, H = len(layers(teacher)), layers(teacher)[0].self_attn.num_heads
    sums, local, queries = torch.zeros(L, H, 2), torch.zeros(L, H), 0
    for start in range(0, blocks.size(0), batch):
        x = trimmed(blocks[start : start + batch]).to(device_of(student))
        padding, real = x.eq(PAD), x.ne(PAD).t()
        _, inputs = run(student, x)
        positions = torch.arange(x.size(1), device=x.device)
        band = (positions.view(-1, 1) - positions.view(1, -1)).abs() <= near
        for i, (ours, theirs) in enumerate(zip(layers(student), layers(teacher))):
            q = inputs[i][0]
            mine, _ = head_outputs(ours.self_attn, query=q, key_padding_mask=padding)
            target, weights = head_outputs(
                theirs.self_attn, query=q, key=q, value=q, key_padding_mask=padding,
                need_weights=True, need_head_weights=True,
            )  # fmt: skip
            diff = (mine - target)[real].view(-1, H, target.size(-1) // H)
            sums[i, :, 0] += diff.pow(2).sum((0, 2)).cpu()
            sums[i, :, 1] += target[real].view(-1, H, target.size(-1) // H).pow(2).sum((0, 2)).cpu()
            local[i] += (weights * band).sum(-1).permute(0, 2, 1)[:, real].sum(-1).cpu()  # H x T x B -> H
        queries += int(real.sum())
    return {"error": (sums[..., 0] / sums[..., 1]).sqrt().tolist(), "local": (local / queries).tolist(), "near": near}


# ---------------------------------------------------------------- stage 1: attention transfer


def transfer(student, teacher, blocks, steps, lr, batch, generator, fit_far_offsets=True):
    """Fit each layer's E/F (nothing else; with a band, its far-field offsets too unless not
    ``fit_far_offsets``) to the teacher's attention on the student's layer inputs."""
    blocks = trimmed(blocks).to(device_of(student))
    for p in student.parameters():
        p.requires_grad_(False)
    shared = getattr(student.encoder.sentence_encoder, "compress_layer", None)
    for i, (ours, theirs) in enumerate(zip(layers(student), layers(teacher))):
        params = projection_parameters(ours.self_attn, fit_far_offsets)
        if shared is not None:  # layerwise: the one projection is fitted at the first layer only
            params = list(shared.parameters()) if i == 0 else []
        if not params:
            continue
        with torch.no_grad():
            inputs = torch.cat([run(student, blocks[s : s + batch])[1][i][0] for s in range(0, len(blocks), batch)], 1)
        padding = blocks.eq(PAD)
        with torch.no_grad():
            targets = torch.cat(
                [
                    teacher_attention(theirs, inputs[:, s : s + batch], padding[s : s + batch])
                    for s in range(0, len(blocks), batch)
                ],
                1,
            )
        for p in params:
            p.requires_grad_(True)
        optimizer = torch.optim.Adam(params, lr=lr)
        for _ in range(steps):
            pick = torch.randint(0, len(blocks), (batch,), generator=generator).to(blocks.device)
            x, target = inputs[:, pick], targets[:, pick]
            out = ours.self_attn(query=x, key_padding_mask=padding[pick])[0]
            loss = (out - target).pow(2).sum() / target.pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        for p in params:
            p.requires_grad_(False)
        print(f"  layer {i}: attention error {math.sqrt(loss.item()):.3f} after {steps} steps", flush=True)
    for p in student.parameters():
        p.requires_grad_(True)


# ---------------------------------------------------------------- stage 2: distillation


def distill(student, teacher, blocks, args, state_path, generator):
    """End-to-end: all weights free (with a band, its far-field offsets fixed under --far-offset
    count), relative squared error of every layer's hidden states."""
    projections = {id(p) for p in projection_parameters(student)}
    fixed = {id(p) for p in far_field_offsets(student)} if args.far_offset == "count" else set()
    free = [p for p in student.parameters() if id(p) not in fixed]
    groups = [
        {"params": [p for p in free if id(p) not in projections], "lr": args.lr},
        {"params": [p for p in free if id(p) in projections], "lr": args.projection_lr},
    ]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    peaks = [g["lr"] for g in optimizer.param_groups]
    warmup = max(1, args.distill_steps // 20)
    step = 0
    if state_path.is_file():  # resume: weights, optimizer, step and the random stream
        saved = torch.load(state_path, weights_only=True, map_location="cpu")  # load_state_dict places it
        student.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        generator.set_state(saved["generator"])
        print(f"  resuming at step {step} of {args.distill_steps}", flush=True)
    for p in teacher.parameters():
        p.requires_grad_(False)
    started, window = time.time(), []
    while step < args.distill_steps:
        scale = min(1.0, (step + 1) / warmup) * (1 - step / args.distill_steps)  # warmup, then linear decay
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = peak * scale
        pick = torch.randint(0, len(blocks), (args.batch_blocks,), generator=generator)
        x = trimmed(blocks[pick] if args.documents else shortened(blocks[pick], args.short_fraction, generator))
        x = x.to(device_of(student))
        real = x.ne(PAD).t()
        with torch.no_grad():
            theirs, _ = run(teacher, x)
        ours, _ = run(student, x, grad=True)
        loss = sum((a - b)[real].pow(2).sum() / b[real].pow(2).sum() for a, b in zip(ours, theirs)) / len(ours)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(free, 1.0)  # fixed offsets' gradients must not scale the rest
        optimizer.step()
        step += 1
        window.append(loss.item())
        if step % args.log_interval == 0 or step == args.distill_steps:
            rate, recent = (time.time() - started) / len(window), window[-args.log_interval :]
            left = rate * (args.distill_steps - step) / 60
            print(f"  step {step}/{args.distill_steps}: loss {sum(recent) / len(recent):.4f} "
                  f"({rate:.2f} s/step, {left:.1f} min left)", flush=True)  # fmt: skip
        if step % args.save_interval == 0 or step == args.distill_steps:
            save = {"model": student.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save({**save, "generator": generator.get_state()}, f"{state_path}.partial")
            os.replace(f"{state_path}.partial", state_path)
    return step


# ---------------------------------------------------------------- main


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, help="transformers encoder folder (BERT or RoBERTa family)")
    parser.add_argument(
        "--text", type=Path, nargs="+", required=True, help="unlabeled text files (one paragraph a line)"
    )
    parser.add_argument("--valid-text", type=Path, nargs="+", help="held-out text for the fidelity report (default: "
                        "the last --valid-blocks blocks of --text, left out of training)")  # fmt: skip
    parser.add_argument("--valid-blocks", type=int, default=16, help="held-out blocks (default: 16)")
    parser.add_argument("--sts", type=Path, help="a GLUE STS-B tsv (dev.tsv): report zero-shot Spearman (mean pooling)")
    parser.add_argument("--max-positions", type=int, required=True, help="N, the Linformer's sequence length")
    parser.add_argument("--k", type=int, required=True, help="the projected length k (E/F: k x N)")
    parser.add_argument("--layer-compressed-dims", help='k per layer, e.g. "256,192,128,128,96,64" (wins over --k)')
    parser.add_argument("--compress-sharing", choices=COMPRESS_SHARING, default="headwise", help="default: headwise")
    parser.add_argument("--compress-type", choices=COMPRESS_TYPES, default="linear", help="default: linear")
    parser.add_argument("--init", choices=("avg", "subsample"), default="avg", help="linear E/F's start (default: avg)")
    parser.add_argument("--key-scale", default="1",
                        help="the converter's factor on the keys' E: a number (default 1: window means, the best "
                             "in docs/linearize.md), or window (n/k: window sums)")  # fmt: skip
    parser.add_argument("--compress-length-norm", choices=tuple(LENGTH_NORM_POWERS), default="exact",
                        help="linear projections on inputs shorter than N (default: exact, the best finetuned in "
                             "docs/linearize.md: at most K tokens are read with softmax attention)")  # fmt: skip
    parser.add_argument("--local-window", type=int, default=0,
                        help="W: an exact local band of W neighbours beside the projection in every layer; the "
                             "transfer and distillation then fit E/F to what the band leaves (default: 0)")  # fmt: skip
    parser.add_argument("--far-offset", choices=("learned", "count"), default="learned",
                        help="with --local-window: each projected row's logit gets log(tokens it stands for) "
                             "plus a per-head offset that the transfer and distillation fit (learned), or the "
                             "log count alone, the offsets kept at 0 (count) (default: learned)")  # fmt: skip
    parser.add_argument("--local-count-once", action="store_true",
                        help="with --local-window: each row stands only for the tokens of its window outside the "
                             "query's band, so the band's tokens are not counted again in the rows")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="folder of the run (a rerun resumes it)")
    g = parser.add_argument_group("attention transfer (stage 1)")
    g.add_argument("--transfer-steps", type=int, default=100, help="Adam steps per layer (default: 100; 0 skips)")
    g.add_argument("--transfer-lr", type=float, help="default: 1e-3 x min(1, 512/N), as --projection-lr")
    g.add_argument(
        "--transfer-blocks", type=int, default=32, help="blocks the layer inputs are taken from (default: 32)"
    )
    g.add_argument("--transfer-batch", type=int,
                   help="blocks a transfer step (default: --batch-blocks, at least 4: on one block of 2048 the "
                        "transfer's steps were too noisy to help)")  # fmt: skip
    g = parser.add_argument_group("end-to-end distillation (stage 2)")
    g.add_argument("--distill-steps", type=int, default=500, help="steps (default: 500; 0 skips)")
    g.add_argument("--batch-blocks", type=int, default=4, help="blocks a step (default: 4)")
    g.add_argument("--lr", type=float, default=1e-4, help="peak lr of the Transformer weights (default: 1e-4)")
    g.add_argument(
        "--projection-lr",
        type=float,
        help="peak lr of E/F (default: 1e-3 x min(1, 512/N): a row of E reaches all N positions; 1e-3 suits "
        "N <= 512 at every k tried and broke the transfer at N = 2048, k = 128 and 512, docs/linearize.md)",
    )
    g.add_argument("--short-fraction", type=float, default=0.25,
                   help="share of training blocks cut to a random shorter length (default: 0.25)")  # fmt: skip
    parser.add_argument("--documents", action="store_true",
                        help="each line of the text is one input (cut to N tokens), as a task reads documents, "
                        "instead of blocks of N tokens of running text (--*-blocks then count documents; "
                        "no --short-fraction cuts: documents come with their own lengths)")  # fmt: skip
    parser.add_argument("--min-tokens", type=int, default=0,
                        help="with --documents: train on and hold out only documents of at least this many tokens "
                        "(<s> and </s> included). Under exact length handling a document of at most K tokens is "
                        "read as the teacher reads it, so it teaches the projections nothing")  # fmt: skip
    g.add_argument("--log-interval", type=int, default=10, help="default: 10")
    g.add_argument("--save-interval", type=int, default=50, help="steps between resumable saves (default: 50)")
    parser.add_argument("--seed", type=int, default=1, help="default: 1")
    parser.add_argument("--device", help="where the models run, e.g. cuda:1 (default: cuda when a GPU is visible, "
                        "else cpu)")  # fmt: skip
    parser.add_argument("--no-export", action="store_true", help="do not write OUT/hf")
    parser.add_argument(
        "--heads",
        action="store_true",
        help="after distillation, report per head its attention error (on the student's inputs) and how local "
        "the teacher's head is (its attention's share within 2 positions)",
    )
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in [*args.text, *(args.valid_text or []), *([args.sts] if args.sts else [])]:
        if not path.is_file():
            parser.error(f"{path}: no such text file")
    if not args.hf_dir.is_dir():
        parser.error(f"{args.hf_dir}: no such folder")
    if not 0 < args.k <= args.max_positions:
        parser.error(f"--k {args.k} must be in 1..--max-positions ({args.max_positions})")
    if args.local_window < 0 or args.local_window % 2:
        parser.error(f"--local-window must be an even number >= 0, got {args.local_window}")
    if args.far_offset != "learned" and not args.local_window:
        parser.error("--far-offset sets the band's far-field offsets: add --local-window")
    if args.local_count_once and not args.local_window:
        parser.error("--local-count-once recounts the projected rows beside a band: add --local-window")
    if args.min_tokens and not args.documents:
        parser.error("--min-tokens needs --documents (blocks of running text are all N tokens long)")
    if not 0 <= args.min_tokens <= args.max_positions:
        parser.error(f"--min-tokens {args.min_tokens} must be in 0..--max-positions ({args.max_positions})")
    if not 0 <= args.short_fraction <= 1:
        parser.error("--short-fraction must be in [0, 1]")
    args.transfer_batch = max(4, args.batch_blocks) if args.transfer_batch is None else args.transfer_batch
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as error:  # a typo, or cuda on a machine without one
        parser.error(f"--device {args.device}: {str(error).splitlines()[0]}")
    for name in ("valid_blocks", "batch_blocks", "transfer_blocks", "transfer_batch", "log_interval", "save_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.layer_compressed_dims and not all(d.strip().isdigit() for d in args.layer_compressed_dims.split(",")):
        parser.error(f"--layer-compressed-dims {args.layer_compressed_dims}: expected numbers, comma-separated")
    # Adam moves every entry of a row of E by about the lr, and the row reaches all N positions: one
    # step can move a projected key by about lr x N times what the keys have in common
    scaled = 1e-3 * min(1.0, 512 / args.max_positions)
    args.transfer_lr = scaled if args.transfer_lr is None else args.transfer_lr
    args.projection_lr = scaled if args.projection_lr is None else args.projection_lr
    return args


def step(command, done: Path, what: str):
    """Run a script unless its output exists."""
    if done.exists():
        print(f"{what}: {done} (done)", flush=True)
        return
    print(f"{what}: {' '.join(map(str, command[1:3]))} ...", flush=True)
    quiet = dict(os.environ, PYTHONWARNINGS="ignore")  # hydra's deprecations, inside fairseq's config code
    finished = subprocess.run([sys.executable, *map(str, command)], env=quiet)
    if finished.returncode != 0:
        fail(f"{what} failed (exit {finished.returncode})")


def main(argv=None):
    args = parse_args(argv)
    out, n = args.out, args.max_positions
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"stages": {}}
    report["args"] = vars(args)

    step([SCRIPTS / "import_hf.py", args.hf_dir, "--out", out / "teacher"], out / "teacher" / "model.pt", "import")
    teacher_path = out / "teacher" / "model.pt"
    if checkpoints.model_namespace(checkpoints.read_checkpoint(teacher_path)).max_positions != n:
        command = [SCRIPTS / "extend_max_positions.py", teacher_path, out / f"teacher-n{n}.pt", "--max-positions", n]
        step(command, out / f"teacher-n{n}.pt", f"teacher at n={n}")
        teacher_path = out / f"teacher-n{n}.pt"
    convert = [SCRIPTS / "convert_roberta_to_linformer.py", teacher_path, out / "converted.pt",
               "--compressed-dim", args.k, "--compress-sharing", args.compress_sharing,
               "--compress-type", args.compress_type, "--compress-length-norm", args.compress_length_norm]  # fmt: skip
    if args.compress_type == "linear":
        convert += ["--init", args.init]
    convert += ["--key-scale", args.key_scale, "--local-window", args.local_window]
    convert += ["--local-count-once"] if args.local_count_once else []
    if args.layer_compressed_dims:
        convert += ["--layer-compressed-dims", args.layer_compressed_dims]
    step(convert, out / "converted.pt", "conversion")

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokenizer = out / "teacher" / "tokenizer.json"
    read = read_documents if args.documents else read_blocks
    blocks = long_enough(read(tokenizer, args.text, n), args.min_tokens, "--text")
    if args.valid_text:
        valid = long_enough(read(tokenizer, args.valid_text, n), args.min_tokens, "--valid-text")[: args.valid_blocks]
    else:
        if len(blocks) <= args.valid_blocks:
            what = "documents" if args.documents else f"blocks of {n}"
            fail(f"--text has {len(blocks)} {what}: too few to hold out {args.valid_blocks}; give --valid-text")
        blocks, valid = blocks[: -args.valid_blocks], blocks[-args.valid_blocks :]
    if args.documents:
        lengths = blocks.ne(PAD).sum(1).float()
        print(f"text: {len(blocks)} training documents (mean {lengths.mean():.0f} tokens, "
              f"{int(lengths.eq(n).sum())} cut to {n}), {len(valid)} held out", flush=True)  # fmt: skip
    else:
        print(f"text: {len(blocks)} training blocks of {n} tokens, {len(valid)} held out", flush=True)
    print(f"lr of E/F: {args.transfer_lr:g} in the transfer, {args.projection_lr:g} in distillation", flush=True)
    teacher, _, _ = load(teacher_path, args.device)
    student, ns, state = load(out / "converted.pt", args.device)
    sts = sts_pairs(args.sts, tokenizer, n) if args.sts else None
    if sts and "teacher_sts" not in report:
        report["teacher_sts"] = sts_spearman(teacher, sts)
    if sts:
        print(f"  teacher                STS-B Spearman {report['teacher_sts']:.4f}", flush=True)
    stages = report["stages"]
    if "converted" not in stages:
        stages["converted"] = {"fidelity": fidelity(student, teacher, valid, sts)}
    show("converted", stages["converted"]["fidelity"])

    if (out / "transfer.pt").is_file():
        student, _, _ = load(out / "transfer.pt", args.device)
    elif args.transfer_steps:
        started = time.time()
        transfer(student, teacher, blocks[: args.transfer_blocks], args.transfer_steps, args.transfer_lr,
                 args.transfer_batch, generator, args.far_offset == "learned")  # fmt: skip
        stages["transfer"] = {"fidelity": fidelity(student, teacher, valid, sts), "seconds": time.time() - started}
        checkpoints.write_checkpoint(state, ns, student, out / "transfer.pt", {"stage": "attention transfer"})
        write_text(report_path, json.dumps(report, indent=2, default=str) + "\n")
    if "transfer" in stages:
        show("attention transfer", stages["transfer"]["fidelity"])

    if not (out / "checkpoint.pt").is_file():
        started = time.time()
        if args.distill_steps:
            distill(student, teacher, blocks, args, out / "distill-state.pt", generator)
            student.eval()
            stages["distillation"] = {
                "fidelity": fidelity(student, teacher, valid, sts),
                "seconds": time.time() - started,
            }
        note = {"stage": "distillation", "from": str(args.hf_dir), "steps": args.distill_steps}
        checkpoints.write_checkpoint(state, ns, student, out / "checkpoint.pt", note)
        write_text(report_path, json.dumps(report, indent=2, default=str) + "\n")
        (out / "distill-state.pt").unlink(missing_ok=True)  # the optimizer's state: 3x the model, no longer needed
    if "distillation" in stages:
        show("distillation", stages["distillation"]["fidelity"])
    if args.heads and "heads" not in report:
        student, _, _ = load(out / "checkpoint.pt", args.device)
        report["heads"] = head_analysis(student, teacher, valid)
        write_text(report_path, json.dumps(report, indent=2, default=str) + "\n")
    if args.heads:
        for i, (errors, local) in enumerate(zip(report["heads"]["error"], report["heads"]["local"])):
            pairs = " ".join(f"{e:.2f}/{share:.2f}" for e, share in zip(errors, local))
            print(f"  layer {i} heads, error/local share: {pairs}", flush=True)
    if not args.no_export:
        export = [SCRIPTS / "export_hf.py", out / "checkpoint.pt", "--out", out / "hf", "--tokenizer-json", tokenizer]
        step(export, out / "hf", "export")
    print(f"wrote {out / 'checkpoint.pt'}" + ("" if args.no_export else f" and {out / 'hf'}"))


if __name__ == "__main__":
    main()
