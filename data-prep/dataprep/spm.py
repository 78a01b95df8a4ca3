"""SentencePiece: train a model on the corpus, encode text with it, write the fairseq dict.txt.

train:  OUT/spm.model, OUT/spm.vocab and OUT/dict.txt (the spm pieces in spm id order, so
        fairseq id = spm id + 1: fairseq puts <s> <pad> </s> <unk> first, spm <unk> <s> </s>)
encode: one line of space-separated pieces per input line; blank lines stay blank
        (they are the document boundaries of the corpus)

Every model argument also takes a Hugging Face tokenizer.json (told apart by its content: a
JSON object with a "model" key), e.g. the one of a model imported by scripts/import_hf.py;
its tokens (without special tokens, truncation or padding) are written the same way.
"""

import collections
import itertools
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import sentencepiece

from .common import Progress, Recipe, atomic, bad_input, cli, default_workers, log, parser, read_lines, require_file

BATCH_LINES = 2000


def train(corpus, out_dir, vocab_size, input_sentence_size, model_type, workers, seed=1):
    out_dir = Path(out_dir)
    corpus = require_file(corpus, "corpus")
    recipe = Recipe(
        "sentencepiece training",
        {"corpus": corpus},
        vocab_size=vocab_size,
        input_sentence_size=input_sentence_size,
        model_type=model_type,
        seed=seed,
    )
    if recipe.done(out_dir):
        return out_dir
    if not any(line.strip() for _, line in read_lines(corpus)):
        bad_input(corpus, None, "empty corpus: nothing to train sentencepiece on")
    log(f"training sentencepiece ({model_type}, vocab {vocab_size}) on {corpus}")
    with atomic(out_dir, recipe) as tmp:
        tmp.mkdir()
        sentencepiece.set_random_generator_seed(seed)
        try:
            sentencepiece.SentencePieceTrainer.train(
                input=str(corpus),
                model_prefix=str(tmp / "spm"),
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=0.9999,
                input_sentence_size=input_sentence_size,
                shuffle_input_sentence=True,
                num_threads=workers,
                minloglevel=1,
            )
        except RuntimeError as e:  # e.g. "Vocabulary size too high" on a small corpus
            bad_input(corpus, None, f"sentencepiece training failed: {e}")
        write_fairseq_dict(tmp / "spm.model", tmp / "dict.txt")
    return out_dir


def write_fairseq_dict(model, path):
    """dict.txt for `fairseq-preprocess --srcdict`: every spm piece but the ones fairseq adds
    itself (<unk>, <s>, </s>), in spm id order; the counts only keep that order if re-sorted."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    n = sp.get_piece_size()
    with open(path, "w") as f:
        for i in range(n):
            if not (sp.is_control(i) or sp.is_unknown(i)):
                f.write(f"{sp.id_to_piece(i)} {n - i}\n")


def check_model(path):
    """Load the model once here, so that a wrong file stops with one line before any work
    (and before any worker process could fail on it)."""
    path = _require_model(path)
    try:
        _load(path)
    except (RuntimeError, OSError) as e:
        bad_input(
            path,
            None,
            f"not a sentencepiece model ({e}) nor a tokenizer.json; give the spm.model of spm.sh train "
            "or the tokenizer.json of a model imported from transformers",
        )
    return path


def add_model_argument(p):
    """--spm-model (or --tokenizer): the tasks' text encoder, for glue.sh and imdb.sh."""
    p.add_argument(
        "--spm-model",
        "--tokenizer",
        required=True,
        type=Path,
        help="the pretraining spm.model, or the tokenizer.json of a model imported from transformers",
    )


def _require_model(path):
    """A missing file has no content to tell its kind by: its name does."""
    return require_file(path, "tokenizer.json" if str(path).endswith(".json") else "sentencepiece model")


def _load(path):
    """The model at `path` as a function: text line -> list of token strings."""
    if _is_tokenizer_json(path):
        return _load_tokenizer(path)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    return lambda line: sp.encode(line, out_type=str)


def _is_tokenizer_json(path):
    """True for a Hugging Face tokenizer.json, False for a file that is not JSON (a
    sentencepiece model is a protobuf); other JSON is neither, and stops here."""
    try:
        content = json.loads(Path(path).read_bytes())
    except ValueError:  # includes UnicodeDecodeError
        return False
    if not (isinstance(content, dict) and "model" in content):
        bad_input(path, None, 'a JSON file, but not a tokenizer.json (no "model" key) nor a sentencepiece model')
    return True


def _load_tokenizer(path):
    try:
        import tokenizers
    except ImportError:
        bad_input(path, None, "encoding with a tokenizer.json needs the tokenizers library: pip install tokenizers")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
        bad_input(path, None, f"not a valid tokenizer.json ({e})")
    spaced = sorted(token for token in tokenizer.get_vocab() if token.split() != [token])
    if spaced:
        bad_input(
            path,
            None,
            f"{len(spaced)} vocabulary tokens are empty or hold whitespace (e.g. {spaced[0]!r}): "
            "encoded text separates tokens by spaces, so they cannot be written",
        )
    tokenizer.no_truncation()  # every token of a line is kept, as with sentencepiece
    tokenizer.no_padding()
    return lambda line: tokenizer.encode(line, add_special_tokens=False).tokens


# The model of this process: the pool initializer only records its path, so it cannot fail;
# the first batch loads it, and a failure there comes back to the parent as that batch's error.
_model_path, _model = None, (None, None)


def _use_model(path):
    global _model_path, _model
    _model_path, _model = str(path), (None, None)  # loaded anew: the file may have changed


def _processor():
    global _model
    if _model[0] != _model_path:
        _model = (_model_path, _load(_model_path))
    return _model[1]


def _encode_batch(lines):
    tokens = _processor()
    return [" ".join(tokens(line)) for line in lines]


def encode(model, src, dst, workers):
    """Encode `src` into `dst` line by line, with `workers` processes, order kept."""
    dst = Path(dst)
    model, src = _require_model(model), require_file(src)
    recipe = Recipe("encoding", {"input": src, "model": model})
    if recipe.done(dst):
        return dst
    check_model(model)
    lines = (line for _, line in read_lines(src))
    batches = iter(lambda: list(itertools.islice(lines, BATCH_LINES)), [])
    progress = Progress(f"encoding {src}")
    with atomic(dst, recipe) as tmp, open(tmp, "w") as out:
        if workers > 1:
            try:
                _write(_in_processes(_encode_batch, batches, workers, model), out, progress)
            except BrokenProcessPool as e:
                bad_input(src, None, f"encoding failed: a worker process died ({e})")
        else:
            _use_model(model)
            _write(map(_encode_batch, batches), out, progress)
    progress.close()
    return dst


def _in_processes(fn, batches, workers, model):
    """fn(batch) for every batch in `workers` processes, in order, a few batches in flight.

    concurrent.futures rather than multiprocessing.Pool: a worker that fails to start or dies
    breaks the pool (BrokenProcessPool) instead of being restarted, or waited for, forever."""
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(workers, context, initializer=_use_model, initargs=(model,)) as pool:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.submit(fn, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _write(encoded_batches, out, progress):
    for batch in encoded_batches:
        out.writelines(line + "\n" for line in batch)
        progress.update(len(batch))


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = parser(__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model and write dict.txt")
    t.add_argument("--corpus", required=True, type=Path, help="train.txt of the corpus")
    t.add_argument("--out", required=True, type=Path, help="output folder")
    t.add_argument("--vocab-size", type=int, default=50000)
    t.add_argument(
        "--input-sentence-size",
        type=int,
        default=10_000_000,
        help="train on a random sample of this many lines (0: all)",
    )
    t.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    t.add_argument("--workers", type=int, default=default_workers())
    e = sub.add_parser("encode", help="encode text files into pieces")
    e.add_argument(
        "--model",
        "--tokenizer",
        required=True,
        type=Path,
        help="spm.model, or the tokenizer.json of a model imported from transformers",
    )
    e.add_argument("--inputs", required=True, type=Path, nargs="+")
    e.add_argument("--outputs", required=True, type=Path, nargs="+")
    e.add_argument("--workers", type=int, default=default_workers())
    return p


def main():
    p = build_parser()
    args = p.parse_args()
    if args.command == "train":
        train(args.corpus, args.out, args.vocab_size, args.input_sentence_size, args.model_type, args.workers)
    else:
        if len(args.inputs) != len(args.outputs):
            p.error("--inputs and --outputs need the same number of files")
        inputs = {src.resolve() for src in args.inputs}
        for dst in args.outputs:  # an input that an earlier output would overwrite
            if dst.resolve() in inputs:
                bad_input(dst, None, "the output is also an input; choose another output")
        for src, dst in zip(args.inputs, args.outputs):
            encode(args.model, src, dst, args.workers)


if __name__ == "__main__":
    cli(main)
