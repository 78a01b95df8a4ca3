"""The long-document study's data: the IMDB subset read from the tarball (data-prep/imdb.sh: fixed
stratified train/test subsets, reviews kept whole), the test reviews and their lengths as the
models read them, the labeled reviews of each split as a run reads them (the linear probe), and the
length bins the report splits them into."""

from linformer_tools.common import REPO

from common import sh


def prepare_imdb(args):
    if args.hf_dir:
        encoder, srcdict = args.original / "tokenizer.json", args.original / "dict.txt"
        unlabeled = ["--unlabeled", args.unlabeled]
    else:
        encoder, srcdict = args.quality / "data" / "spm" / "spm.model", args.quality / "data" / "spm" / "dict.txt"
        unlabeled = []
    sh(
        [REPO / "data-prep" / "imdb.sh", "--tarball", args.imdb, "--destdir", args.out / "data", "--workers", 2]
        + ["--spm-model", encoder, "--srcdict", srcdict, *unlabeled]
        + ["--train-size", args.train_size, "--test-size", args.test_size, "--valid-size", args.valid_size]
    )
    return args.out / "data" / "IMDB-bin"


def reviews_of(args, split):
    """A split's reviews as the models read them whole (<s> review </s>), in its order."""
    import torch
    from fairseq.data import data_utils

    reviews = data_utils.load_indexed_dataset(str(args.imdb_bin / "input0" / split))
    bos = torch.tensor([0])  # <s>: sentence prediction prepends it; the review ends with </s>
    return [torch.cat([bos, reviews[i].long()]) for i in range(len(reviews))]


def test_reviews(args, reads):
    """The test reviews of at most READS tokens as the models read them, in the test set's order."""
    return [review for review in reviews_of(args, "test") if len(review) <= reads]


def labeled_reviews(args, split, reads, truncation):
    """(reviews, labels) of a split as finetuning reads them: a review longer than READS tokens cut
    as TRUNCATION says (head_tail keeps n/4 tokens from the start, the task's own cut); labels as
    class indices of the label dictionary, in the split's order."""
    from fairseq.data import Dictionary, data_utils

    from linformer_fairseq.tasks.long_sentence_prediction import TruncatedDataset

    whole = reviews_of(args, split)
    cut = TruncatedDataset(whole, reads, truncation, args.n // 4, keep_first=1)
    labels = Dictionary.load(str(args.imdb_bin / "label" / "dict.txt"))
    classes = data_utils.load_indexed_dataset(str(args.imdb_bin / "label" / split), labels)
    return [cut[i] for i in range(len(whole))], [int(classes[i][0]) - labels.nspecial for i in range(len(classes))]


def test_lengths(args):
    """Each test review's length as the models see it whole (with <s> and </s>)."""
    from fairseq.data import data_utils

    reviews = data_utils.load_indexed_dataset(str(args.imdb_bin / "input0" / "test"))
    return [int(size) + 1 for size in reviews.sizes]  # read while the dataset (its memory map) is open


def length_bins(n, factors):
    """(label, keep) for review lengths split at n, 2n and each n'."""
    edges = sorted({n, 2 * n} | {n * f for f in factors})
    bins = [(f"<= {edges[0]}", lambda x: x <= edges[0])]
    bins += [(f"{lo + 1}-{hi}", lambda x, lo=lo, hi=hi: lo < x <= hi) for lo, hi in zip(edges, edges[1:])]
    return bins + [(f"> {edges[-1]}", lambda x: x > edges[-1])]


def corpus_name(args):
    """IMDB for aclImdb's own tarball, else the tarball's name: data-prep/polarity.sh writes Pang &
    Lee's reviews in the same layout, and a report on them must not say IMDB."""
    return "IMDB" if args.imdb.name.startswith("aclImdb") else args.imdb.name
