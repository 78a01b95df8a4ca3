#!/usr/bin/env python
"""Spectrum of the context-mapping matrix of a fairseq RoBERTa or Linformer checkpoint
(paper Figure 1): per layer and head, the normalised cumulative singular values of
P = softmax(Q K^T / sqrt(d)) (RoBERTa, n x n) or of P-bar (Linformer, n x k), averaged over
sequences of real text."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from linformer_tools.common import fail, write_text
from linformer_tools.models import force_explicit_attention, import_fairseq, import_plugin, pyplot, save_figure

DESCRIPTION = (
    __doc__
    + """
Input: --checkpoint (a fairseq-train checkpoint of roberta_* or linformer_roberta_*) and either
--text (a text file already in the units of the checkpoint's dict.txt: each line is split on
whitespace and looked up in it, as fairseq-preprocess does; apply your BPE first if the dictionary
is BPE) or --data-bin (a fairseq binarized folder; --split picks the split). The token stream is
cut into sequences of --seq-len tokens, each <s> + (seq-len - 1) tokens, as the masked_lm task
builds its blocks, and the first --max-sentences of them are used.

Method: fairseq's encoder layers call self_attn with need_weights=False, so a forward pre-hook
records the exact arguments each layer's self_attn receives during the forward, and after the
forward each self_attn is called again on them with need_weights=True, need_head_weights=True.
fairseq's MultiheadAttention only returns per-head weights on its own bmm + softmax path, so
it is switched there first (MultiheadAttention._set_skip_embed_dim_check()). For every layer,
head and sequence the singular values s_1 >= s_2 >= ... of the matrix give the curve
c(i) = (s_1 + ... + s_i) / (s_1 + ... + s_m), m = min(rows, columns), computed in float64; the
curves are averaged over sequences. c(K) is the share of spectrum mass in the K largest singular
values; for a Linformer it is 1 by construction once K >= k.

Outputs in --out-dir: spectrum.json (curves per layer and head, c(K) per layer and head, and per
layer; rewritten after every batch, so an interrupted run keeps its average so far) and
spectrum.png: curves per layer averaged over heads (left) and the heatmap of c(K) over layers x
heads (right). The per-layer c(K) table is also printed.
"""
)


def build_parser():
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="fairseq checkpoint (.pt)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", type=Path, help="text file in the dictionary's units")
    source.add_argument("--data-bin", type=Path, help="fairseq binarized data folder")
    p.add_argument("--split", default="valid", help="split of --data-bin (default: valid)")
    p.add_argument(
        "--data",
        type=Path,
        help="folder with the checkpoint's dict.txt (default: the checkpoint's training data "
        "folder, else the checkpoint's own folder)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="tokens per sequence, n (default: the model's max positions, at most 512 as in the paper)",
    )
    p.add_argument("--max-sentences", type=int, default=100, help="sequences to average over (default: 100)")
    p.add_argument("--index", type=int, default=128, help="K: report c(K), the mass of the K largest (default: 128)")
    p.add_argument(
        "--mass", type=float, default=0.9, help="also report the K that holds this share of the mass (default: 0.9)"
    )
    p.add_argument("--batch-size", type=int, default=4, help="sequences per forward (default: 4)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out-dir", type=Path, default=Path("spectrum-results"), help="(default: spectrum-results)")
    return p


# ---------------------------------------------------------------- the measurement


def cumulative_spectrum(P):
    """Normalised cumulative singular values of each matrix in P (``... x rows x cols``):
    ``... x min(rows, cols)``, increasing to 1."""
    s = torch.linalg.svdvals(P.double())
    return s.cumsum(-1) / s.sum(-1, keepdim=True)


def attention_modules(model):
    """Each encoder layer's self_attn, in layer order."""
    found = [m for name, m in model.named_modules() if name.endswith(".self_attn")]
    if not found:
        fail(f"{type(model).__name__} has no '*.self_attn' modules; is it a RoBERTa/Linformer encoder?")
    return found


def context_mappings(model, tokens):
    """Per layer, the per-head context-mapping matrices of one forward: ``H x B x T x S``."""
    modules = attention_modules(model)
    calls = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, args, kwargs: calls.__setitem__(m, (args, kwargs)), with_kwargs=True)
        for m in modules
    ]
    try:
        model(tokens, features_only=True)
    finally:
        for h in hooks:
            h.remove()
    maps = []
    for i, m in enumerate(modules):
        args, kwargs = calls[m]
        _, weights = m(*args, **{**kwargs, "need_weights": True, "need_head_weights": True})
        if weights is None or weights.dim() != 4 or weights.size(0) != m.num_heads:
            shape = None if weights is None else tuple(weights.shape)
            fail(
                f"layer {i} ({type(m).__name__}) returned attention weights of shape {shape}, "
                f"expected heads x batch x T x S"
            )
        maps.append(weights)
    return maps


class SpectrumAverage:
    """Running mean over sequences of the curves, per layer and head."""

    def __init__(self):
        self.total, self.count = None, 0

    def add(self, maps):
        curves = [cumulative_spectrum(P).sum(dim=1) for P in maps]  # layer: H x m, summed over the batch
        self.total = curves if self.total is None else [t + c for t, c in zip(self.total, curves)]
        self.count += maps[0].size(1)

    def curves(self):
        return [(t / self.count).cpu() for t in self.total]


def at_index(curve, K):
    """c(K) from curves ``... x m`` (1-based K; K >= m gives the full mass, 1)."""
    return curve[..., min(K, curve.size(-1)) - 1]


def index_of_mass(curve, mass):
    """The smallest K with c(K) >= mass, from curves ``... x m`` (1-based)."""
    return (curve < mass - 1e-9).sum(-1) + 1


# ---------------------------------------------------------------- input


def load_checkpoint(path, data):
    """The model, its cfg and its dictionary, read from ``data``/dict.txt."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name

    if not path.is_file():
        fail(f"--checkpoint {path}: no such file")
    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    cfg_data = Path(str(state["cfg"].task.data).split(":")[0])
    if data is None:
        data = cfg_data if (cfg_data / "dict.txt").exists() else path.parent
    if not (data / "dict.txt").exists():
        fail(f"no dict.txt in {data} (the checkpoint was trained on {cfg_data}); pass --data DIR holding its dict.txt")
    if state.get("args") is not None:  # legacy checkpoints: the cfg is rebuilt from these
        state["args"].data = str(data)
    overwrite_args_by_name(state["cfg"], {"data": str(data)})
    models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], state=state)
    return models[0], cfg, task.source_dictionary


def token_stream(args, dictionary):
    """All token ids of the input, each line/sentence followed by </s>."""
    if args.text is not None:
        if not args.text.is_file():
            fail(f"--text {args.text}: no such file")
        with open(args.text, encoding="utf-8") as f:
            lines = [dictionary.encode_line(line, add_if_not_exist=False) for line in f if line.strip()]
    else:
        from fairseq.data import data_utils

        prefix = args.data_bin / args.split
        dataset = data_utils.load_indexed_dataset(str(prefix), dictionary)
        if dataset is None:
            fail(f"--data-bin: no binarized split {prefix}.bin/.idx")
        lines = [dataset[i] for i in range(len(dataset))]
    stream = torch.cat(lines).long() if lines else torch.empty(0, dtype=torch.long)
    unknown = (stream == dictionary.unk()).float().mean().item() if len(stream) else 0.0
    if unknown > 0.1:
        print(
            f"warning: {unknown:.0%} of the tokens are not in the dictionary (<unk>); "
            f"is the input in the dictionary's units?",
            file=sys.stderr,
        )
    return stream


def sequences(stream, seq_len, count, bos):
    """Up to ``count`` sequences of <s> + (seq_len - 1) consecutive tokens: ``count x seq_len``."""
    body = seq_len - 1
    usable = min(count, len(stream) // body)
    if usable == 0:
        fail(f"the input has {len(stream)} tokens, fewer than one sequence of --seq-len {seq_len} needs ({body})")
    blocks = stream[: usable * body].view(usable, body)
    return torch.cat([torch.full((usable, 1), bos), blocks], dim=1)


# ---------------------------------------------------------------- output


def summary(curves, K, args, cfg, sentences):
    layers = []
    for i, c in enumerate(curves, 1):  # layer 1 is fairseq's layers.0
        heads = at_index(c, K)
        layers.append(
            {
                "layer": i,
                "columns": c.size(-1),
                "share_at_index": heads.mean().item(),
                "heads_at_index": heads.tolist(),
                "index_of_mass": int(index_of_mass(c.mean(0), args.mass)),
                "heads_index_of_mass": index_of_mass(c, args.mass).tolist(),
                "mean_curve": c.mean(0).tolist(),
                "head_curves": c.tolist(),
            }
        )
    return {
        "checkpoint": str(args.checkpoint),
        "arch": cfg.model._name if "_name" in cfg.model else None,
        "input": str(args.text or f"{args.data_bin}/{args.split}"),
        "seq_len": args.seq_len,
        "sentences": sentences,
        "index": K,
        "mass": args.mass,
        "layers": layers,
    }


def plot(result, path):
    import numpy as np

    plt = pyplot()
    K, layers = result["index"], result["layers"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = plt.cm.viridis(np.linspace(0, 1, len(layers)))
    for layer, colour in zip(layers, colours):
        curve = layer["mean_curve"]
        left.plot(range(1, len(curve) + 1), curve, color=colour, label=f"layer {layer['layer']}")
    left.axvline(K, color="grey", linestyle=":", linewidth=1)
    left.set(
        xlabel="singular value index",
        ylabel="normalised cumulative singular value",
        title=f"{result['arch']}, n={result['seq_len']}, {result['sentences']} sequences",
    )
    left.legend(fontsize=6, ncol=2)
    heat = np.array([layer["heads_at_index"] for layer in layers])
    image = right.imshow(heat, aspect="auto", origin="lower", cmap="viridis")
    right.set(xlabel="head", ylabel="layer", title=f"normalised cumulative singular value at index {K}")
    right.set_xticks(range(heat.shape[1]), [str(h + 1) for h in range(heat.shape[1])])
    right.set_yticks(range(heat.shape[0]), [str(layer["layer"]) for layer in layers])
    fig.colorbar(image, ax=right)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def table(result):
    K, mass = result["index"], result.get("mass", 0.9)
    lines = [
        f"c({K}): share of the spectrum mass in the {K} largest singular values, mean over heads (min, max); "
        f"K({mass:g}): the K holding {mass:.0%} of the mass (of the heads' mean curve; the heads' min, max)",
        f"| layer | columns | c(K) mean | min head | max head | K({mass:g}) | min head | max head |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for layer in result["layers"]:
        heads, ks = layer["heads_at_index"], layer.get("heads_index_of_mass", [0])
        lines.append(
            f"| {layer['layer']} | {layer['columns']} | {layer['share_at_index']:.3f} "
            f"| {min(heads):.3f} | {max(heads):.3f} | {layer.get('index_of_mass', '-')} | {min(ks)} | {max(ks)} |"
        )
    if any(layer["columns"] <= K for layer in result["layers"]):
        lines.append(f"(layers with at most {K} columns hold all their mass by index {K}: c(K) = 1 by construction)")
    return "\n".join(lines)


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("max_sentences", "index", "batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.mass <= 1:
        fail(f"--mass must be in (0, 1], got {args.mass}")
    import_fairseq()
    import_plugin()
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: torch sees no CUDA device")
    model, cfg, dictionary = load_checkpoint(args.checkpoint, args.data)
    max_positions = model.max_positions()
    args.seq_len = args.seq_len or min(512, max_positions)
    if not 2 <= args.seq_len <= max_positions:
        fail(f"--seq-len {args.seq_len} must be in 2..{max_positions} (the checkpoint's max positions)")
    force_explicit_attention(model)
    model = model.float().eval().to(args.device)
    data = sequences(token_stream(args, dictionary), args.seq_len, args.max_sentences, dictionary.bos())

    args.out_dir.mkdir(parents=True, exist_ok=True)
    average, start = SpectrumAverage(), time.time()
    with torch.inference_mode():
        for batch in data.split(args.batch_size):
            average.add(context_mappings(model, batch.to(args.device)))
            result = summary(average.curves(), args.index, args, cfg, average.count)
            write_text(args.out_dir / "spectrum.json", json.dumps(result))
            print(f"{average.count}/{len(data)} sequences ({time.time() - start:.0f} s)", flush=True)
    plot(result, args.out_dir / "spectrum.png")
    print(table(result))
    print(f"Wrote {args.out_dir}/spectrum.json and spectrum.png")
    return result


if __name__ == "__main__":
    main()
