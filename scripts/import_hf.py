#!/usr/bin/env python3
"""Import a transformers BERT- or RoBERTa-family encoder as a fairseq RoBERTa checkpoint.

    python scripts/import_hf.py HF_DIR --out DIR

HF_DIR is a transformers folder: config.json, model.safetensors (or pytorch_model.bin) and
tokenizer.json (a fast tokenizer, WordPiece or BPE); sentence-transformers folders are ones.
DIR gets:

  model.pt        a fairseq checkpoint, arch ``roberta_imported`` (fairseq's RoBERTa with the
                  layer norms' epsilon of the original), task masked_lm at n = the original's
                  positions. Everything that takes a fairseq RoBERTa takes it (--user-dir
                  linformer_fairseq): convert_roberta_to_linformer.py, extend_max_positions.py,
                  attention_spectrum.py, the hub, the launchers, export_hf.py
  dict.txt        the fairseq dictionary: fairseq's ids 0-3 are the original's [CLS]/<s>,
                  [PAD]/<pad>, [SEP]/</s> and [UNK]/<unk>, then every other token in the
                  original's id order, and the mask token last (where masked_lm and
                  sentence_prediction put <mask>). A RoBERTa's ids stay as they were
  tokenizer.json  the original tokenizer with its ids renumbered to fairseq's: it encodes text
                  to the ids the model reads (data-prep takes it in place of an spm model)
  import.json     what was mapped where, what was left out, and the check's differences

Mapped exactly: token, position and token-type embeddings (a BERT's positions start at 0,
fairseq's after the pad id; the token-type 0 row is added into every position, which is what the
original computes on one segment), the embedding and layer norms with their epsilon, every
layer, the activation, the masked-LM head when the folder has one (sentence-transformers
folders have none: the head then starts fresh, and the import says so). Left out and named:
the pooler, the next-sentence head, the token-type rows above 0 (fairseq reads pairs as one
segment, <s> A </s></s> B </s>, the RoBERTa way).

Before it writes, the import runs the original (transformers) and the fairseq model on a padded
batch of real text (the bundled WikiText-2 sample) and refuses if the last hidden states (and
masked-LM logits) differ by 1e-4 or more.
"""

import logging

# before fairseq's import, whose modules configure the root logger at DEBUG and log at import
logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from linformer_tools.common import PLUGIN_DIR, SAMPLE, atomic, fail  # noqa: E402

FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert")  # one architecture: BertModel's
ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_accurate", "gelu_pytorch_tanh": "gelu_accurate"}
ROLES = {  # fairseq's special ids, and the tokenizer's names for each role in order of preference
    0: ("cls_token", "bos_token"),
    1: ("pad_token",),
    2: ("sep_token", "eos_token"),
    3: ("unk_token",),
}
FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
TOLERANCE = 1e-4
CHECK_TEXT = SAMPLE / "wikitext-2" / "wiki.valid.tokens"


# ---------------------------------------------------------------- reading the folder


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        fail(f"{path}: not readable JSON ({type(e).__name__}: {str(e)[:120]})")


def read_config(hf_dir):
    """config.json, after refusing what the import cannot reproduce."""
    path = hf_dir / "config.json"
    if not path.is_file():
        fail(f"{hf_dir}: no config.json (expected a transformers model folder)")
    config = read_json(path)
    family = config.get("model_type")
    if family not in FAMILIES:
        fail(f"{path}: model_type {family!r} is not supported; the import takes {', '.join(FAMILIES)}")
    if config.get("is_decoder") or config.get("add_cross_attention"):
        fail(f"{path}: a decoder (is_decoder / add_cross_attention) is not supported: the import takes encoders")
    positions = config.get("position_embedding_type", "absolute")
    if positions != "absolute":
        fail(f"{path}: position_embedding_type {positions!r} (relative positions) is not supported: absolute only")
    if config.get("hidden_act") not in ACTIVATIONS:
        fail(f"{path}: activation {config.get('hidden_act')!r} is not supported ({', '.join(ACTIVATIONS)})")
    return config


def read_weights(hf_dir):
    """The checkpoint's tensors, without the task model's prefix (bert., roberta.)."""
    if (hf_dir / "model.safetensors").is_file():
        from safetensors.torch import load_file

        weights = load_file(str(hf_dir / "model.safetensors"))
    elif (hf_dir / "pytorch_model.bin").is_file():
        weights = torch.load(hf_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        fail(f"{hf_dir}: no model.safetensors or pytorch_model.bin")
    return {re.sub(r"^(bert|roberta)\.", "", key): value for key, value in weights.items()}


def special_tokens(hf_dir, tokenizer):
    """{role: token} from special_tokens_map.json / tokenizer_config.json (transformers writes them)."""
    names = {}
    for file in ("tokenizer_config.json", "special_tokens_map.json"):  # the second wins
        if (hf_dir / file).is_file():
            for key, value in read_json(hf_dir / file).items():
                if key.endswith("_token") and value:
                    names[key] = value["content"] if isinstance(value, dict) else value
    names = {key: value for key, value in names.items() if isinstance(value, str)}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    for key in ("cls_token", "sep_token", "pad_token", "unk_token", "mask_token"):  # the usual names
        if key not in names:
            guess = next((t for t in (f"[{key[:-6].upper()}]", f"<{key[:-6]}>") if t in vocab), None)
            names.update({key: guess} if guess else {})
    return names


def read_tokenizer(hf_dir, vocab_size):
    """(tokenizer.json as a dict, the tokenizers Tokenizer, fairseq order: the original id of each
    fairseq id). Refuses a tokenizer whose tokens the fairseq dictionary cannot hold."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        fail(f"{hf_dir}: no tokenizer.json (save it: AutoTokenizer.from_pretrained(...).save_pretrained)")
    spec = read_json(path)
    kind = spec.get("model", {}).get("type")
    if kind not in ("WordPiece", "BPE"):
        fail(f"{path}: a {kind} tokenizer is not supported: the import takes WordPiece (BERT) and BPE (RoBERTa)")
    tokenizer = Tokenizer.from_file(str(path))
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if len(vocab) != vocab_size:
        fail(f"{path}: {len(vocab)} tokens, but the model's token embedding has {vocab_size} rows")
    spaced = [t for t in vocab if re.search(r"\s", t)]
    if spaced:
        fail(f"{path}: tokens with whitespace ({spaced[0]!r}) cannot be fairseq dictionary entries")
    names = special_tokens(hf_dir, tokenizer)
    order = {}
    for fairseq_id, keys in [*ROLES.items(), (vocab_size - 1, ("mask_token",))]:
        token = next((names[k] for k in keys if names.get(k) in vocab), None)
        if token is None:
            fail(f"{path}: no {' or '.join(keys)} in the tokenizer; fairseq needs one")
        order[fairseq_id] = vocab[token]
    if len(set(order.values())) < len(order):
        fail(f"{path}: one token plays two of the roles cls, pad, sep, unk, mask: {names}")
    roles = set(order.values())
    rest = iter(i for i in range(vocab_size) if i not in roles)
    order = [order[i] if i in order else next(rest) for i in range(vocab_size)]
    clash = [t for t, i in vocab.items() if t in FAIRSEQ_SPECIALS and i not in roles]
    if clash:
        fail(f"{path}: the token {clash[0]!r} is one of fairseq's special symbols but not in that role")
    return spec, tokenizer, order


def renumbered_tokenizer(spec, order):
    """tokenizer.json with every id replaced by its fairseq id, and without the original's
    padding and truncation (sentence-transformers pads and cuts to 128): data-prep and the hub
    encode whole texts, and the tasks' own options pad and truncate."""
    new = {old: i for i, old in enumerate(order)}
    spec = json.loads(json.dumps(spec))
    spec["model"]["vocab"] = {token: new[i] for token, i in spec["model"]["vocab"].items()}
    for token in spec.get("added_tokens") or []:
        token["id"] = new[token["id"]]
    spec["padding"] = spec["truncation"] = None

    def processor(p):
        if p is None:
            return
        if p["type"] == "Sequence":
            for inner in p["processors"]:
                processor(inner)
        elif p["type"] in ("BertProcessing", "RobertaProcessing"):
            for key in ("sep", "cls"):
                p[key][1] = new[p[key][1]]
        elif p["type"] == "TemplateProcessing":
            for token in p["special_tokens"].values():
                token["ids"] = [new[i] for i in token["ids"]]

    processor(spec.get("post_processor"))
    return spec


# ---------------------------------------------------------------- the model


def fairseq_args(config, out, n):
    """fairseq-train's parsed arguments for the imported model (what its checkpoint stores)."""
    from fairseq import options

    hidden = config["hidden_size"]
    argv = [
        str(out.resolve()), "--task", "masked_lm", "--criterion", "masked_lm", "--user-dir", str(PLUGIN_DIR),
        "--arch", "roberta_imported", "--encoder-layers", str(config["num_hidden_layers"]),
        "--encoder-embed-dim", str(hidden), "--encoder-ffn-embed-dim", str(config["intermediate_size"]),
        "--encoder-attention-heads", str(config["num_attention_heads"]),
        "--activation-fn", ACTIVATIONS[config["hidden_act"]], "--max-positions", str(n), "--tokens-per-sample", str(n),
        "--layernorm-eps", repr(float(config.get("layer_norm_eps", 1e-12))),
        "--dropout", str(config.get("hidden_dropout_prob", 0.1)),
        "--attention-dropout", str(config.get("attention_probs_dropout_prob", 0.1)),
    ]  # fmt: skip
    if hidden % config["num_attention_heads"]:
        fail(f"hidden size {hidden} is not a multiple of {config['num_attention_heads']} heads")
    return options.parse_args_and_arch(options.get_training_parser(), argv)


def fairseq_weights(weights, config, order, n):
    """(fairseq state dict of the encoder and masked-LM head, notes: what was left out or is missing)."""
    E, L = "encoder.sentence_encoder.", "encoder.lm_head."
    rows = torch.tensor(order)
    taken, out = set(), {}

    def take(key):
        if key not in weights:
            fail(f"the checkpoint has no {key}")
        taken.add(key)
        return weights[key]

    out[E + "embed_tokens.weight"] = take("embeddings.word_embeddings.weight")[rows]
    positions = take("embeddings.position_embeddings.weight")
    offset = positions.size(0) - n  # a RoBERTa's first position is pad + 1, a BERT's 0
    table = torch.zeros(n + 2, positions.size(1))  # fairseq's: pad row, then positions from pad + 1 = 2
    table[2:] = positions[offset:]
    if "embeddings.token_type_embeddings.weight" in weights:
        table[2:] += take("embeddings.token_type_embeddings.weight")[0]
    out[E + "embed_positions.weight"] = table
    for name in ("weight", "bias"):
        out[f"{E}layernorm_embedding.{name}"] = take(f"embeddings.LayerNorm.{name}")
        for i in range(config["num_hidden_layers"]):
            hf, fs = f"encoder.layer.{i}.", f"{E}layers.{i}."
            for src, dst in (
                ("attention.self.query", "self_attn.q_proj"),
                ("attention.self.key", "self_attn.k_proj"),
                ("attention.self.value", "self_attn.v_proj"),
                ("attention.output.dense", "self_attn.out_proj"),
                ("attention.output.LayerNorm", "self_attn_layer_norm"),
                ("intermediate.dense", "fc1"),
                ("output.dense", "fc2"),
                ("output.LayerNorm", "final_layer_norm"),
            ):
                out[f"{fs}{dst}.{name}"] = take(f"{hf}{src}.{name}")
    head = {  # BERT's names, RoBERTa's names
        "dense": ("cls.predictions.transform.dense", "lm_head.dense"),
        "layer_norm": ("cls.predictions.transform.LayerNorm", "lm_head.layer_norm"),
    }
    notes = {}
    if any(f"{p}.weight" in weights for p, _ in head.values()) or "lm_head.dense.weight" in weights:
        for dst, sources in head.items():
            src = next((s for s in sources if f"{s}.weight" in weights), None) or fail(f"no {sources[0]}")
            for name in ("weight", "bias"):
                out[f"{L}{dst}.{name}"] = take(f"{src}.{name}")
        bias = next(k for k in ("cls.predictions.bias", "lm_head.bias", "lm_head.decoder.bias") if k in weights)
        out[L + "bias"] = take(bias)[rows]
        decoder = next((k for k in ("cls.predictions.decoder.weight", "lm_head.decoder.weight") if k in weights), None)
        if decoder is not None:
            taken.add(decoder)
            if not torch.equal(weights[decoder], weights["embeddings.word_embeddings.weight"]):
                fail(f"{decoder} is not tied to the token embedding; untied masked-LM heads are not supported")
        taken.update(k for k in ("cls.predictions.decoder.bias", "lm_head.decoder.bias") if k in weights)
    else:
        notes["missing"] = "no masked-LM head: encoder.lm_head.{dense,layer_norm,bias} start fresh (features are exact)"
    left = [k for k in sorted(set(weights) - taken) if not k.endswith("position_ids")]  # position_ids: a buffer
    if len(weights.get("embeddings.token_type_embeddings.weight", [])) > 1:
        left.append("embeddings.token_type_embeddings.weight[1:] (segment B)")
    notes["left_out"] = left
    return out, notes


def build(args, state_dict, vocab_size):
    from linformer_tools import checkpoints

    torch.manual_seed(0)  # a missing masked-LM head starts the same way every time
    model = checkpoints.build_model(args, vocab_size)
    missing = checkpoints.load_weights(model, state_dict)
    fresh = {"encoder.lm_head.dense.weight", "encoder.lm_head.dense.bias", "encoder.lm_head.layer_norm.weight"}
    fresh |= {"encoder.lm_head.layer_norm.bias", "encoder.lm_head.bias", "encoder.lm_head.weight"}
    if set(missing) - fresh:
        fail(f"the fairseq model has weights the import did not fill: {', '.join(sorted(set(missing) - fresh)[:5])}")
    return model.eval()


# ---------------------------------------------------------------- the check


def check_text(n_lines=8):
    lines = [line.strip() for line in CHECK_TEXT.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("=")][:n_lines]


def compare(model, hf_dir, tokenizer, renumbered, order, n, has_head):
    """Largest differences {last hidden states, masked-LM logits} between the original and the
    fairseq model on a right-padded batch of real text (at most n tokens a line); fails if the
    renumbered tokenizer does not give the fairseq ids of the original's tokens."""
    import transformers
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer.to_str())
    tokenizer.enable_truncation(n)
    tokenizer.enable_padding(pad_id=order[1], pad_token=tokenizer.id_to_token(order[1]))
    encoded = tokenizer.encode_batch(check_text())
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded])
    fairseq_ids = torch.tensor(order).argsort()[ids]  # order maps fairseq ids to the original's
    renumbered = Tokenizer.from_str(json.dumps(renumbered))
    renumbered.enable_truncation(n)
    for line, row, length in zip(check_text(), fairseq_ids.tolist(), mask.sum(1).tolist()):
        if renumbered.encode(line).ids[:length] != row[:length]:
            fail(f"the renumbered tokenizer encodes {line[:40]!r}... to other ids than the original's: please report")
    real = mask.bool()
    transformers.utils.logging.disable_progress_bar()
    kind = transformers.AutoModelForMaskedLM if has_head else transformers.AutoModel
    original = kind.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        out = original(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        theirs = out.hidden_states[-1]
        ours, _ = model(fairseq_ids, features_only=True)
        diffs = {"hidden": (ours - theirs)[real].abs().max().item()}
        if has_head:
            logits = model(fairseq_ids)[0]
            diffs["mlm_logits"] = (logits - out.logits[:, :, order])[real].abs().max().item()
    return diffs, int(real.sum()), len(encoded)


# ---------------------------------------------------------------- main


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, help="transformers model folder (config.json, weights, tokenizer.json)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (must not exist, or be empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.hf_dir.is_dir():
        parser.error(f"{args.hf_dir}: no such folder")
    if args.out.exists() and not args.overwrite and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"{args.out}: exists; choose another --out, or --overwrite")
    return args


def main(argv=None):
    args = parse_args(argv)
    hf_dir, out = args.hf_dir, args.out
    config = read_config(hf_dir)
    weights = read_weights(hf_dir)
    vocab_size = weights["embeddings.word_embeddings.weight"].size(0)
    spec, tokenizer, order = read_tokenizer(hf_dir, vocab_size)
    offset = config["pad_token_id"] + 1 if config["model_type"] != "bert" else 0
    n = config["max_position_embeddings"] - offset
    state_dict, notes = fairseq_weights(weights, config, order, n)
    fs_args = fairseq_args(config, out, n)
    model = build(fs_args, state_dict, vocab_size)
    has_head = "missing" not in notes
    renumbered = renumbered_tokenizer(spec, order)
    diffs, tokens, lines = compare(model, hf_dir, tokenizer, renumbered, order, n, has_head)
    print(f"checked on {lines} lines of {CHECK_TEXT.name} ({tokens} tokens): largest difference from transformers")
    for name, diff in diffs.items():
        print(f"  {name:<11} {diff:.2g}")
    if max(diffs.values()) >= TOLERANCE:
        worst = max(diffs.values())
        fail(f"the imported model differs from the original by {worst:.3g} (>= {TOLERANCE}); nothing written")

    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from linformer_tools import checkpoints

    if out.exists() and args.overwrite:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    report = {"source": str(hf_dir.resolve()), "model_type": config["model_type"], "max_positions": n}
    report.update(vocab_size=vocab_size, check=diffs, **notes)
    with atomic(out) as tmp:
        tmp.mkdir()
        symbols = [tokenizer.id_to_token(i) for i in order[4:-1]]
        (tmp / "dict.txt").write_text("".join(f"{s} 1\n" for s in symbols), encoding="utf-8")
        (tmp / "tokenizer.json").write_text(json.dumps(renumbered, ensure_ascii=False))
        (tmp / "import.json").write_text(json.dumps(report, indent=2) + "\n")
        with warnings.catch_warnings():  # hydra's deprecations, inside fairseq's config code
            warnings.simplefilter("ignore")
            state = {"cfg": convert_namespace_to_omegaconf(fs_args)}
        checkpoints.write_checkpoint(state, fs_args, model, tmp / "model.pt", {"imported_from": str(hf_dir)})
    print(f"wrote {out}: {config['model_type']}, {config['num_hidden_layers']} layers x {config['hidden_size']}, "
          f"n={n}, vocabulary {vocab_size}")  # fmt: skip
    for name in notes.get("left_out", []):
        print(f"  left out: {name}")
    if "missing" in notes:
        print(f"  {notes['missing']}")


if __name__ == "__main__":
    main()
