#!/usr/bin/env python3
"""Export a fairseq Linformer (or RoBERTa) checkpoint to a Hugging Face transformers folder.

    python scripts/export_hf.py CHECKPOINT --out DIR [--spm-model spm.model] [--dict dict.txt]

DIR then loads without fairseq (``pip install ".[hf]"`` or transformers, tokenizers,
safetensors and torch), with ``trust_remote_code=True``:

    AutoModel / AutoModelForMaskedLM / AutoModelForSequenceClassification.from_pretrained(DIR, trust_remote_code=True)
    AutoTokenizer.from_pretrained(DIR)

It holds:

  config.json              model_type "linformer_fairseq": sizes, dropouts, n, k per layer,
                           sharing, projection kind, length norm, frozen projections, init;
                           the classification head's labels (id2label, or regression); auto_map
  model.safetensors        the encoder (linformer.*), the masked-LM head (lm_head.*) and the
                           classification head (classifier.*, with --head or the checkpoint's only head)
  configuration_linformer.py, modeling_linformer.py
                           the transformers classes (torch and transformers only)
  linformer_attention.py, linformer_projection.py, linformer_band.py, linformer_band_flex.py
                           the plugin's attention (linformer_fairseq/modules/), copied byte for
                           byte: the exported model runs the attention code the plugin runs
  tokenizer.json, tokenizer_config.json
                           with --spm-model: the sentencepiece model (unigram) as a tokenizers
                           Unigram model whose ids are the fairseq dictionary's (<s> <pad> </s> <unk>,
                           then dict.txt in order, then <mask>): the ids RobertaHubInterface.encode
                           gives, "<s> " + spm pieces + " </s>" (pairs: <s> A </s> </s> B </s>).
                           Without --dict the dictionary is the spm pieces in spm order (what
                           data-prep/spm.sh train writes). With --dict only: whitespace-split words
                           (fairseq without --bpe).
                           With --tokenizer-json (a model imported by import_hf.py: its tokenizer.json,
                           already in the fairseq ids): that tokenizer, reading pairs as the hub does.

Literal "<s>", "</s>", "<pad>" and "<mask>" in the text are read as those tokens (transformers'
convention; <mask> is how the fill-mask pipeline marks the blank, as the hub's fill_mask does);
fairseq's encode would cut them into pieces. Every other text encodes to fairseq's ids exactly,
characters unknown to the spm model included (<unk>, one per run of them, as spm fuses them).

The export is checked before it is written: the transformers model and the fairseq model give
the same features, masked-LM logits and classification logits on a padded random batch.
Checkpoints of fairseq's original Linformer example and fairseq RoBERTa checkpoints export too.
"""

import logging

# before fairseq's import, whose modules configure the root logger at DEBUG and log at import
logging.basicConfig(level=logging.WARNING, format="%(levelname)s | %(name)s | %(message)s")

import argparse  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from linformer_tools.common import PLUGIN_DIR, atomic, fail  # noqa: E402

ATTENTION_FILES = ("linformer_attention.py", "linformer_projection.py", "linformer_band.py", "linformer_band_flex.py")
CODE_FILES = {  # exported name: the plugin's file
    "configuration_linformer.py": PLUGIN_DIR / "hf" / "configuration_linformer.py",
    "modeling_linformer.py": PLUGIN_DIR / "hf" / "modeling_linformer.py",
    # the attention and the files it imports (relative imports, which transformers follows in a folder)
    **{name: PLUGIN_DIR / "modules" / name for name in ATTENTION_FILES},
}
AUTO_MAP = {
    "AutoConfig": "configuration_linformer.LinformerConfig",
    "AutoModel": "modeling_linformer.LinformerModel",
    "AutoModelForMaskedLM": "modeling_linformer.LinformerForMaskedLM",
    "AutoModelForSequenceClassification": "modeling_linformer.LinformerForSequenceClassification",
}
ENCODER, LM_HEAD, HEADS = "encoder.sentence_encoder.", "encoder.lm_head.", "classification_heads."
# sentencepiece piece types (sentencepiece_model.proto)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# the model vocabulary's name for fairseq's <unk> (id 3): it holds a space, which the normalizer
# turns into "▁", so the Unigram model can never match it in text: spm cuts a literal "<unk>" into
# pieces, and so must the tokenizer. Unknown characters still get id 3 (the model's unk_id).
UNK_PIECE = " <unk>"


# ---------------------------------------------------------------- the model


def load_fairseq_model(path):
    """(fairseq model in eval mode, 'linformer' or 'roberta', its built config Namespace)."""
    from linformer_tools import checkpoints  # imports fairseq and the plugin

    state = checkpoints.read_checkpoint(path)
    kind = checkpoints.model_kind(state, path)
    model = checkpoints.build_model(checkpoints.model_namespace(state), checkpoints.vocab_size(state))
    missing = checkpoints.load_weights(model, state["model"])
    if missing:
        fail(f"{path}: weights missing for {', '.join(missing[:5])}")
    return model.eval(), kind, model.encoder.args


def choose_head(model, name, path):
    """The classification head to export: --head, or the checkpoint's only one (None without heads)."""
    heads = sorted(model.classification_heads.keys())
    if name is not None:
        if name not in heads:
            fail(f"{path}: no classification head {name!r} (heads: {', '.join(heads) or 'none'})")
        return name
    if len(heads) > 1:
        fail(f"{path}: has classification heads {', '.join(heads)}: choose one with --head")
    return heads[0] if heads else None


def length_norm(model, flag: str) -> str:
    """The compress length norm the loaded linear projections use: the checkpoint's, which loading
    restores whatever the flag says (the flag's for pooling and conv, which have none)."""
    from linformer_fairseq.modules.linformer_attention import LENGTH_NORM_POWERS, SequenceProjection

    powers = {m.length_power for m in model.modules() if isinstance(m, SequenceProjection) and m.kind == "linear"}
    if not powers:
        return flag
    names = {v: k for k, v in LENGTH_NORM_POWERS.items()}
    if len(powers) > 1 or next(iter(powers)) not in names:
        fail(f"the checkpoint's projections mix length norms {sorted(powers)}; the export needs one")
    return names[powers.pop()]


def hf_config(model, kind, args, head_name, labels, mask_token_id):
    """The LinformerConfig of the fairseq model (its built, architecture-filled arguments)."""
    from linformer_fairseq.hf.configuration_linformer import LinformerConfig

    encoder = model.encoder.sentence_encoder
    layers = encoder.layers
    n = args.max_positions
    positions = encoder.embed_positions.weight.size(0)
    if positions != n + encoder.padding_idx + 1:
        fail(f"the positional embedding has {positions} rows for max_positions {n}: expected n + pad + 1")
    if head_name and getattr(args, "chunk_length", 0):  # the exported model reads at most n tokens, unchunked
        fail(f"its head reads documents in chunks (--chunk-length {args.chunk_length}), which the export cannot")
    fields = dict(
        vocab_size=encoder.embed_tokens.weight.size(0),
        hidden_size=args.encoder_embed_dim,
        num_hidden_layers=len(layers),
        num_attention_heads=args.encoder_attention_heads,
        intermediate_size=args.encoder_ffn_embed_dim,
        hidden_act=str(args.activation_fn),
        hidden_dropout_prob=float(args.dropout),
        attention_probs_dropout_prob=float(args.attention_dropout),
        activation_dropout=float(getattr(args, "activation_dropout", 0.0) or 0.0),
        classifier_dropout=float(getattr(args, "pooler_dropout", 0.0) or 0.0),
        classifier_activation=str(args.pooler_activation_fn),
        classifier_pooling=str(getattr(args, "pooler_tokens", None) or "first"),
        max_positions=n,
        layer_norm_eps=layers[0].self_attn_layer_norm.eps,
        normalize_before=bool(args.encoder_normalize_before),
        layernorm_embedding=encoder.layernorm_embedding is not None,
        embed_scale=float(encoder.embed_scale),
        untie_weights_roberta=bool(getattr(args, "untie_weights_roberta", False)),
        pad_token_id=encoder.padding_idx,
        mask_token_id=mask_token_id,
        architectures=["LinformerForMaskedLM"],
    )
    if kind == "linformer":
        s = encoder.linformer  # the settings the model was built with (legacy flags folded in)
        fields.update(
            attention="linformer",
            compressed_dims=list(s.compressed_dims),
            compress_sharing=s.sharing,
            compress_type=s.kind,
            compress_length_norm=length_norm(model, s.length_norm),
            compress_init=s.init,
            freeze_compress=s.freeze,
            local_window=s.local_window,
            local_count_once=s.local_count_once,
            local_kernel=s.local_kernel,
            ffn_chunk_size=s.ffn_chunk_size,
        )
    else:
        fields.update(attention="full", compressed_dims=[n] * len(layers), compress_type="linear")
    if head_name is not None:
        head = model.classification_heads[head_name]
        num = head.out_proj.out_features
        fields.update(classifier_inner_dim=head.dense.out_features, num_labels=num)
        fields["architectures"] = ["LinformerForMaskedLM", "LinformerForSequenceClassification"]
        if num == 1:
            fields["problem_type"] = "regression"
        else:
            fields["problem_type"] = "single_label_classification"
            names = labels or [f"LABEL_{i}" for i in range(num)]
            fields["id2label"] = dict(enumerate(names))
            fields["label2id"] = {name: i for i, name in enumerate(names)}
    config = LinformerConfig(**fields)
    config.auto_map = dict(AUTO_MAP)
    return config


def hf_weights(model, kind, head_name, config) -> dict:
    """The fairseq weights under the transformers models' names: linformer.* (the encoder),
    lm_head.* and classifier.*; the layerwise projection once, as linformer.compress_layer."""
    out = {}
    layerwise = kind == "linformer" and config.compress_sharing == "layerwise"
    for key, value in model.state_dict().items():
        if key.endswith(".version") or key.startswith(HEADS):
            continue
        if key.startswith(ENCODER):
            name = key[len(ENCODER) :]
            if layerwise and ".self_attn.compress_k." in name:
                continue  # every layer's reference to compress_layer
            out[f"linformer.{name}"] = value
        elif key.startswith(LM_HEAD):
            name = key[len(LM_HEAD) :]
            if name == "weight" and not config.untie_weights_roberta:
                continue  # the token embedding
            out[f"lm_head.{name}"] = value
        else:
            fail(f"the checkpoint has a weight the export does not know: {key}")
    if head_name is not None:
        for key, value in model.classification_heads[head_name].state_dict().items():
            out[f"classifier.{key}"] = value
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def hf_models(config, weights):
    """The exported models (masked LM, and classification when there is a head), in eval mode,
    holding exactly ``weights``: every weight is used, every parameter given."""
    from linformer_fairseq.hf import modeling_linformer as modeling

    built = {"mlm": modeling.LinformerForMaskedLM(config)}
    if any(k.startswith("classifier.") for k in weights):
        built["cls"] = modeling.LinformerForSequenceClassification(config)
    used = set()
    for model in built.values():
        expected = model.state_dict().keys()
        model.load_state_dict({k: weights[k] for k in expected if k in weights}, strict=False)
        missing = [k for k in expected if k not in weights]
        if missing:
            fail(f"no weights for the transformers model's {', '.join(missing[:5])}")
        used.update(expected)
        model.eval()
    unused = sorted(set(weights) - used)
    if unused:
        fail(f"weights the transformers models do not use: {', '.join(unused[:5])}")
    return built


def check(model, built, head_name, config):
    """The exported models compute what the fairseq model computes, on a right-padded batch of
    random tokens (a full block and shorter sentences). Returns the largest difference."""
    n, V, pad = config.max_positions, config.vocab_size, config.pad_token_id
    g = torch.Generator().manual_seed(0)
    lengths = [n, max(2, n // 2), min(n, 3)]
    tokens = torch.full((len(lengths), n), pad)
    for row, length in enumerate(lengths):
        tokens[row, :length] = torch.randint(4, V, (length,), generator=g)
        tokens[row, 0] = config.bos_token_id
    real = tokens.ne(pad)
    with torch.no_grad():
        features, _ = model(tokens, features_only=True)
        pairs = [(features, built["mlm"].linformer(tokens).last_hidden_state)]
        pairs.append((model(tokens)[0], built["mlm"](tokens).logits))
        if head_name is not None:
            pairs.append((model(tokens, classification_head_name=head_name)[0], built["cls"](tokens).logits))
    worst = 0.0
    for ref, got in pairs:
        if ref.dim() == 3:  # pad positions hold whatever the layers made of zeros: compare the real ones
            ref, got = ref[real], got[real]
        diff = (ref - got).abs().max().item()
        if diff > 1e-4 * max(1.0, ref.abs().max().item()):
            sys.exit(f"error: the exported model differs from the fairseq model by {diff:.3g}: please report")
        worst = max(worst, diff)
    return worst


# ---------------------------------------------------------------- the tokenizer


def read_spm(path):
    """The sentencepiece ModelProto of PATH (exit 2 if it is missing or not a sentencepiece model)."""
    from sentencepiece import sentencepiece_model_pb2

    path = Path(path)
    if not path.is_file():
        fail(f"{path}: no such sentencepiece model")
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf's DecodeError, or anything a non-model file triggers
        fail(f"{path}: not a sentencepiece model ({type(e).__name__})")
    if not proto.pieces:
        fail(f"{path}: not a sentencepiece model (no pieces)")
    return proto


def dictionary_symbols(dict_path, proto, vocab_size):
    """fairseq's ids: (symbols in id order with <mask> when the model has it, mask id or None).
    The dictionary is --dict as fairseq's Dictionary loads it, or the spm pieces in spm order
    (data-prep/spm.sh train's dict.txt) when only --spm-model is given."""
    from fairseq.data import Dictionary

    d = Dictionary()
    if dict_path is not None:
        dict_path = Path(dict_path)
        if not dict_path.is_file():
            fail(f"{dict_path}: no such dictionary")
        try:
            d = Dictionary.load(str(dict_path))
        except Exception as e:
            fail(f"{dict_path}: not a fairseq dictionary ({(str(e).splitlines() or [''])[0][:200]})")
        source = str(dict_path)
    else:
        for piece in proto.pieces:
            if piece.type not in (CONTROL, UNKNOWN):
                d.add_symbol(piece.piece)
        source = "the sentencepiece model's pieces"
    symbols = list(d.symbols)
    if vocab_size == len(symbols) + 1:  # masked_lm and sentence_prediction add <mask> last
        return symbols + ["<mask>"], vocab_size - 1
    if vocab_size == len(symbols):
        return symbols, None
    fail(
        f"{dict_path or source}: {len(symbols)} symbols ({len(symbols) + 1} with <mask>), but the checkpoint's "
        f"token embedding has {vocab_size} rows: give the dictionary the model was trained with"
    )


def unigram_tokenizer(proto, symbols, spm_path, dict_path):
    """The sentencepiece unigram model as a tokenizers Unigram model over fairseq's ids: pieces
    keep their spm scores; the normalizer and the dummy prefix follow the spm model's own spec."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    if proto.trainer_spec.model_type != 1:
        kind = {2: "bpe", 3: "word", 4: "char"}.get(proto.trainer_spec.model_type, "?")
        fail(f"{spm_path}: a sentencepiece {kind} model; the export reproduces unigram models (spm.sh's default)")
    spec = proto.normalizer_spec
    if not spec.escape_whitespaces:
        fail(f"{spm_path}: the export needs a sentencepiece model that escapes whitespace (the default)")
    pieces = {p.piece: p for p in proto.pieces}
    segmenting = [p for p in proto.pieces if p.type in (NORMAL, USER_DEFINED, BYTE)]
    known = set(symbols)
    absent = [p.piece for p in segmenting if p.piece not in known]
    if absent:
        fail(
            f"{dict_path}: {len(absent)} of the sentencepiece model's pieces are not in this dictionary (first: "
            f"{absent[0]!r}); fairseq encodes them as <unk>, which a tokenizers Unigram model cannot: give the "
            f"dict.txt written with {spm_path} (data-prep/spm.sh train), or --no-tokenizer"
        )
    if any(p.type == USER_DEFINED for p in segmenting):
        fail(f"{spm_path}: user-defined pieces are not supported by the export")
    lowest = min(p.score for p in segmenting)
    vocab = []
    for i, symbol in enumerate(symbols):
        piece = pieces.get(symbol)
        if i == 3:  # fairseq's <unk>
            vocab.append((UNK_PIECE, 0.0))
        elif i < 4 or symbol == "<mask>":  # read as special tokens, before the model sees the text
            vocab.append((symbol, 0.0))
        elif piece is not None and piece.type in (NORMAL, BYTE):
            vocab.append((symbol, piece.score))
        else:  # a dictionary word spm does not have (e.g. an unknown character it emitted): least likely
            vocab.append((symbol, lowest))
    tokenizer = Tokenizer(Unigram(vocab, unk_id=3, byte_fallback=proto.trainer_spec.byte_fallback))
    steps = []  # sentencepiece's normalizer, in its order
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", "▁"))
    if spec.add_dummy_prefix:  # spm prefixes "▁" even when the text starts with one; Metaspace would not
        steps.append(normalizers.Replace(Regex(r"\A▁"), "▁▁"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=False)
    tokenizer.normalizer = normalizers.Sequence(steps)
    return tokenizer


def imported_symbols(path, vocab_size):
    """(symbols in id order, the Tokenizer) of import_hf.py's tokenizer.json, whose ids are the
    model's: its own tokens name the specials ([CLS] for <s>, ...), the mask token last."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:
        fail(f"{path}: not a tokenizers tokenizer.json ({(str(e).splitlines() or [''])[0][:200]})")
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        fail(f"{path}: {tokenizer.get_vocab_size()} tokens, but the checkpoint's token embedding has {vocab_size} rows")
    return [tokenizer.id_to_token(i) for i in range(vocab_size)], tokenizer


def word_tokenizer(symbols):
    """fairseq without --bpe: whitespace-separated words, looked up in the dictionary."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def write_tokenizer(out, tokenizer, symbols, mask_id, config, sentencepiece: bool):
    """tokenizer.json and tokenizer_config.json: <s> A </s> (pairs <s> A </s> </s> B </s>), right padding."""
    from tokenizers import AddedToken, decoders, processors
    from transformers import PreTrainedTokenizerFast

    bos, eos = symbols[config.bos_token_id], symbols[config.eos_token_id]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, config.bos_token_id), (eos, config.eos_token_id)],
    )
    if sentencepiece:
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    specials = dict(bos_token=bos, eos_token=eos, pad_token=symbols[config.pad_token_id])
    if not sentencepiece:  # a literal <unk> word is fairseq's <unk> too
        specials["unk_token"] = symbols[3]
    if mask_id is not None:  # lstrip: "a <mask> b" leaves "a" and " b", as the hub's fill_mask splits it
        specials["mask_token"] = AddedToken(symbols[mask_id], lstrip=True, normalized=False, special=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        model_max_length=config.max_positions,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
        **specials,
    )
    fast.save_pretrained(str(out))
    return fast


# ---------------------------------------------------------------- main


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="fairseq Linformer or RoBERTa checkpoint (.pt)")
    parser.add_argument("--out", required=True, help="folder to write (must not exist, or be empty)")
    parser.add_argument("--spm-model", help="the sentencepiece model the data was encoded with (spm.model)")
    parser.add_argument(
        "--dict", help="the fairseq dictionary the model was trained with (dict.txt; the data-bin's or input0/'s)"
    )
    parser.add_argument(
        "--label-dict", help="a classification head's label dictionary (the finetuning data-bin's label/dict.txt)"
    )
    parser.add_argument("--head", help="the classification head to export (default: the checkpoint's only one)")
    parser.add_argument(
        "--tokenizer-json", help="the tokenizer.json of a model imported by import_hf.py (in the fairseq ids)"
    )
    parser.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer")
    parser.add_argument("--no-check", action="store_true", help="skip comparing the exported model with fairseq's")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if Path(args.checkpoint).resolve() == Path(args.out).resolve():
        parser.error("--out would overwrite the checkpoint")
    if args.tokenizer_json and (args.spm_model or args.dict):
        parser.error("--tokenizer-json is the whole tokenizer: give it without --spm-model and --dict")
    if args.tokenizer_json and not Path(args.tokenizer_json).is_file():
        parser.error(f"{args.tokenizer_json}: no such tokenizer.json")
    return args


def label_names(path, head_name, config_labels):
    """The names of a head's classes: the label dictionary's symbols in order (fairseq's class i
    is its i-th entry after the 4 specials)."""
    from fairseq.data import Dictionary

    path = Path(path)
    if not path.is_file():
        fail(f"{path}: no such label dictionary")
    if head_name is None:
        fail(f"{path}: the checkpoint has no classification head to name the labels of")
    names = Dictionary.load(str(path)).symbols[4:]
    if config_labels == 1:
        fail(f"{path}: head {head_name!r} is a regression head (one output): it has no labels")
    if len(names) != config_labels:
        fail(f"{path}: {len(names)} labels, but head {head_name!r} has {config_labels} outputs")
    return names


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.overwrite and (not out.is_dir() or any(out.iterdir())):
        fail(f"{out}: exists; choose another --out, or --overwrite")
    proto = None
    if args.spm_model and not args.no_tokenizer:
        proto = read_spm(args.spm_model)  # before the checkpoint: a missing file fails at once
    model, kind, fs_args = load_fairseq_model(args.checkpoint)
    head_name = choose_head(model, args.head, args.checkpoint)
    labels = None
    if args.label_dict:
        outputs = model.classification_heads[head_name].out_proj.out_features if head_name else 0
        labels = label_names(args.label_dict, head_name, outputs)
    vocab_size = model.encoder.sentence_encoder.embed_tokens.weight.size(0)

    symbols, mask_id = None, vocab_size - 1  # masked_lm's layout when no dictionary says otherwise
    want_tokenizer = not args.no_tokenizer and (proto is not None or args.dict or args.tokenizer_json)
    if want_tokenizer and args.tokenizer_json:
        symbols, imported = imported_symbols(args.tokenizer_json, vocab_size)
    elif want_tokenizer:
        symbols, mask_id = dictionary_symbols(args.dict, proto, vocab_size)
    config = hf_config(model, kind, fs_args, head_name, labels, mask_id)
    weights = hf_weights(model, kind, head_name, config)
    built = hf_models(config, weights)
    worst = None if args.no_check else check(model, built, head_name, config)
    tokenizer = None
    if want_tokenizer and args.tokenizer_json:
        tokenizer = imported
    elif want_tokenizer and proto is not None:
        tokenizer = unigram_tokenizer(proto, symbols, args.spm_model, args.dict)
    elif want_tokenizer:
        tokenizer = word_tokenizer(symbols)

    from safetensors.torch import save_file

    if out.exists() and args.overwrite:
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    with atomic(out) as tmp:
        tmp.mkdir()
        config.save_pretrained(str(tmp))
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        for name, source in CODE_FILES.items():
            shutil.copyfile(source, tmp / name)
        if tokenizer is not None:
            write_tokenizer(tmp, tokenizer, symbols, mask_id, config, sentencepiece=proto is not None)

    what = f"{kind}, n={config.max_positions}"
    if kind == "linformer":
        ks = config.compressed_dims
        k = ks[0] if len(set(ks)) == 1 else ",".join(map(str, ks))
        what += f", k={k}, {config.compress_sharing}, {config.compress_type}, length norm {config.compress_length_norm}"
    print(f"wrote {out}: {what}; vocabulary {vocab_size}")
    if head_name is not None:
        kind_of_head = "regression" if config.num_labels == 1 else f"labels {', '.join(config.id2label.values())}"
        print(f"  classification head {head_name!r}: {kind_of_head}")
    if tokenizer is None:
        print("  no tokenizer (give --spm-model and/or --dict)" if not args.no_tokenizer else "  no tokenizer")
    else:
        source = f"{args.spm_model} + " if proto is not None else "words + "
        print(f"  tokenizer: {args.tokenizer_json or source + (args.dict or 'the spm pieces')}")
    if worst is not None:
        print(f"  checked against fairseq: largest difference {worst:.2g}")


if __name__ == "__main__":
    main()
