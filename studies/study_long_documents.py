"""Long-document study: on IMDB, does a model that reads whole reviews beat one that reads their
truncated n tokens? Its report fills docs/long_documents.md, which has the method and the results.

Two kinds of models, one mode each:

  --hf-dir HF_DIR   an encoder imported from transformers (all-MiniLM-L6-v2: n = 512). The
                    original reads n tokens (head, and head+tail truncation) and is extended to
                    n' with full attention (scripts/extend_max_positions.py, positions copied
                    periodically); Linformers of it are made at each n' by scripts/linearize.py
                    on IMDB's unlabeled reviews, the teacher being the original extended to n'
                    the same way, with each k of --ks (a number, or n/D: k growing with n')
  --quality DIR     the RoBERTa and Linformer a quality study (studies/study_quality.py --out
                    DIR) pretrained at n: each extended to n' and pretrained further at n'
                    (scripts/pretrain.sh --from CHECKPOINT extend), a Linformer for each
                    --projections way of extending its projections

With --pooler-tokens mean (--hf-dir), the original also reads whole reviews of up to n' tokens as
consecutive chunks of n, each through full attention, its head on the mean of every chunk's states
(runs original-nN-chunks-nN'; --chunk-length).

--control (--hf-dir only, for now) adds each Linformer's linearization at n followed by
head+tail truncation: whatever it gains is not from reading more.
Folders of further training carry its length (-uUPDATES, -sSTEPS), so another length is
another run.

Steps, each skipped when its output exists (a killed study resumes where it stopped):

1. data: a fixed stratified IMDB subset (data-prep/imdb.sh --train-size/--test-size), reviews
   kept whole, in the models' tokens (and with --hf-dir, train/unsup as text for linearize.py);
2. the models each run finetunes (above); with --probe (or --probe-only, which stops there), a
   linear probe of each: a logistic regression on its frozen, review-averaged final hidden
   states, which tells what the model carries of the labels from what finetuning makes of it;
3. runs: finetuned with scripts/finetune.sh imdb over --seeds seeds (reviews longer than the
   model reads cut head+tail: the first n/4 tokens and the rest from the end, as Sun et al.
   2019); each final model predicts the test subset: accuracy overall and by review length,
   and that of the seed best on fairseq's validation reviews (what a user keeping one of
   several finetunings would get);
4. the cost at the length each run reads, measured alone after the runs: seconds per
   finetuning update (--batch documents, in steps of at most --step-tokens tokens) and the peak
   memory of a step, documents per second when predicting; with --hf-dir, each Linformer's
   fidelity to the original on test reviews by length (measured when the run is run: a finished
   run named in --runs gets it too); OUT/report.md, OUT/results.json, OUT/accuracy_by_length.png
   and OUT/records.json, one record a seed (its head, command and date) for
   studies/long_documents_records.py to merge into docs/long_documents/records.json.
   A finetuned model with a band also predicts with its rows masked out and with its band off.
"""

import argparse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from linformer_tools import checkpoints
from linformer_tools.common import REPO, fail

# the study's data, runs and report are in long_documents/, beside this file
from long_documents.data import prepare_imdb
from long_documents.report import report
from long_documents.runs import base_checkpoint, do_run, import_original, k_at, model_kind, runs


def build_parser():
    """The command line (tests/test_readme.py parses the README's commands with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--hf-dir", type=Path, help="a transformers encoder folder (e.g. all-MiniLM-L6-v2)")
    mode.add_argument("--quality", type=Path, help="a quality study's --out folder (runs/roberta, runs/linformer)")
    a("--imdb", type=Path, required=True, help="aclImdb_v1 tarball, or one in its layout (data-prep/polarity.sh)")
    a("--out", type=Path, default=REPO / "work" / "long", help="output folder (default: work/long)")
    a("--factors", nargs="+", type=int, default=[4], help="n' = factor x n (default: 4)")
    a("--control", action="store_true", help="--hf-dir: also each linearization at n, then head+tail truncation")
    a("--train-size", type=int, default=1000, help="training reviews, half of each class (default: 1000)")
    a("--test-size", type=int, default=1000, help="test reviews, half of each class (default: 1000)")
    a("--valid-size", type=int, default=200, help="training reviews held out for fairseq's validation")
    a("--epochs", type=int, default=2, help="finetuning epochs (default: 2)")
    a("--batch", type=int, default=8, help="reviews per update (default: 8)")
    a("--step-tokens", type=int, default=4096,
      help="tokens a finetuning step holds: at longer lengths an update of --batch reviews takes several steps, "
           "each of fewer reviews; the cost is measured on one step (default: 4096)")  # fmt: skip
    a("--lr", type=float, default=1e-4, help="finetuning peak lr (default: 1e-4)")
    a("--finetune-overrides", nargs="+", default=[], metavar="OVERRIDE",
      help="hydra overrides added to every finetuning (scripts/finetune.sh), e.g. ++model.freeze_compress=1 "
           "++task.log_parameter_groups=true; give each set its own --out")  # fmt: skip
    a("--lp-ft", action="store_true",
      help="finetune from the head of a linear probe of the frozen model (scripts/probe_head.py: LP-FT), "
           "not a random one (OUT/probed/NAME.pt)")  # fmt: skip
    a("--pooler-tokens", choices=["first", "mean"], default="first",
      help="what the classification head reads: <s>'s final state (first, fairseq's RoBERTa) or the mean of "
           "the review's (mean); with --lp-ft, what the probe reads too (default: first)")  # fmt: skip
    a("--predict-with", choices=["last", "best"], default="last",
      help="the finetuning's checkpoint that predicts the test reviews: its last, or the best on fairseq's "
           "validation reviews (early stopping; default: last)")  # fmt: skip
    a("--seeds", type=int, default=3, help="finetuning seeds (default: 3)")
    a("--first-seed", type=int, default=1,
      help="finetune seeds FIRST..--seeds only: a study continued in another folder (default: 1)")  # fmt: skip
    g = p.add_argument_group("--hf-dir: linearization (scripts/linearize.py)")
    g.add_argument("--ks", nargs="+", default=["128", "n/4"], help="k at each n': a number or n/D (default: 128 n/4)")
    g.add_argument(
        "--linearize-steps",
        nargs="+",
        type=int,
        default=[300],
        help="distillation steps, each its own run (-sSTEPS; 0: the converted model; default: 300)",
    )
    g.add_argument("--linearize-tokens", type=int, default=2048, help="tokens a distillation step (default: 2048)")
    g.add_argument("--linearize-on", nargs="+", choices=["blocks", "documents"], default=["blocks"],
                   help="distil on blocks of n' tokens of running text, or on whole reviews as finetuning reads "
                   "them (--batch a step; runs named ...-docs); each is its own run (default: blocks)")  # fmt: skip
    g.add_argument("--transfer-steps", type=int, default=100, help="attention transfer steps a layer (default: 100)")
    g.add_argument("--valid-blocks", type=int, default=8, help="held-out blocks for the fidelity (default: 8)")
    g.add_argument("--fidelity-reviews", type=int, default=24,
                   help="test reviews a length bin on which each Linformer's fidelity to the original is reported "
                   "(0: none; default: 24)")  # fmt: skip
    g.add_argument("--read-exact", action="store_true",
                   help="also each Linformer at n' switched to compress_length_norm exact before finetuning: "
                   "a review of at most k tokens read with each token its own key and value, not E stretched "
                   "over it (runs named ...-exact)")  # fmt: skip
    g.add_argument("--resample-probs", nargs="+", type=float, default=[], metavar="P",
                   help="with --read-exact: also each -exact run finetuned with --compress-resample-prob P (a "
                   "review that fits k read through the projection with probability P, so that finetuning also "
                   "sees the reading longer reviews get; runs named ...-exact-resampleP)")  # fmt: skip
    g.add_argument("--linearize-flags", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the command line goes to linearize.py, after --compress-length-norm "
                   "resample (the study's runs were made under it; exact from the start: its own --out)")  # fmt: skip
    g = p.add_argument_group("--quality")
    g.add_argument("--models", nargs="+", default=["roberta", "linformer"], help="runs of the quality study to extend")
    g.add_argument(
        "--projections",
        nargs="+",
        choices=["periodic", "stretch"],
        default=["periodic"],
        help="how a Linformer's projections are extended (extend_max_positions.py --projections); "
        "each is its own run, named MODEL-nN'-stretch-u... for stretch (default: periodic)",
    )
    g.add_argument("--continue-updates", type=int, default=500, help="continued pretraining updates (default: 500)")
    g.add_argument("--continue-lr", type=float, default=1e-4, help="its peak lr (default: 1e-4)")
    g.add_argument("--continue-tokens", type=int, default=4096, help="tokens per continued update (default: 4096)")
    g.add_argument("--eval-blocks", type=int, default=50, help="validation blocks for the loss table (default: 50)")
    a("--jobs", type=int, default=1, help="runs at once, each on --threads threads (default: 1)")
    a("--threads", type=int, default=0, help="threads per process, 0 for torch's default")
    a("--gpu", action="store_true",
      help="finetune (in the launchers' fp16 mixed precision), linearize, predict and measure fidelity on the "
           "GPU (--jobs runs share it); no cost is measured (--no-timing: the cost table is the CPU's)")  # fmt: skip
    a("--timing-seconds", type=float, default=10, help="timed updates per run last at least this long (default: 10)")
    a(
        "--no-timing",
        action="store_true",
        help="report runs not yet timed without their cost (timings taken while other jobs share the CPU are noise)",
    )
    a("--probe", action="store_true",
      help="also a linear probe of each run's model before finetuning: a logistic regression on its frozen "
      "final hidden states averaged over each review, fit on the training reviews as the run reads them "
      "(OUT/probe/NAME.json; the report's probe table)")  # fmt: skip
    a("--probe-only", action="store_true", help="only the linear probes (--probe): no finetuning")
    a("--runs", nargs="+", metavar="NAME", help="only these runs, in this order (default: all; names as the report's)")
    a("--report-only", action="store_true", help="only write the report of what has finished")
    return p


def parse_args():
    p = build_parser()
    args = p.parse_args()
    positive = ["train_size", "test_size", "valid_size", "epochs", "batch", "step_tokens", "seeds", "jobs"]
    positive += ["continue_updates", "first_seed"]
    for name in positive + ["linearize_tokens", "valid_blocks"]:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.probe |= args.probe_only
    if args.fidelity_reviews < 0:
        p.error("--fidelity-reviews must be >= 0")
    if args.first_seed > args.seeds:
        p.error(f"--first-seed {args.first_seed} is past --seeds {args.seeds}: no seed to finetune")
    if args.resample_probs and not args.read_exact:
        p.error("--resample-probs makes variants of the -exact runs: add --read-exact")
    if any(not 0 < prob <= 1 for prob in args.resample_probs):
        p.error("--resample-probs must be in (0, 1]")
    if min(args.linearize_steps) < 0:
        p.error("--linearize-steps must be >= 0")
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            p.error("--gpu: no GPU visible to torch")
        args.no_timing = True
    if args.timing_seconds <= 0:
        p.error("--timing-seconds must be > 0")
    if any(f < 2 for f in args.factors):
        p.error("--factors must be >= 2 (n' = factor x n)")
    for spec in args.ks:
        if not (spec.isdigit() and int(spec) > 0 or spec.startswith("n/") and spec[2:].isdigit() and int(spec[2:]) > 0):
            p.error(f"--ks {spec}: expected a positive number or n/D")
    if not args.imdb.is_file():
        p.error(f"--imdb {args.imdb} not found")
    if args.control and args.quality:  # pretrain.sh --from the base checkpoint at n aborts at exit (SIGABRT)
        p.error(
            "--control with --quality is not available yet (its continuation at n aborts when it exits); "
            "docs/long_documents/imdb-small-model.md shows the control made with the launchers"
        )
    if args.hf_dir and not (args.hf_dir / "config.json").is_file():
        p.error(f"--hf-dir {args.hf_dir}: no config.json (not a transformers model folder)")
    return args


def main():
    args = parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hf_dir:
        args.hf_dir, args.models, args.data_bin = args.hf_dir.resolve(), ["original"], None
        args.original, args.unlabeled = args.out / "original", args.out / "unsup.txt"
        import_original(args)
    else:
        args.quality = args.quality.resolve()
        args.data_bin = next(iter(sorted((args.quality / "data" / "data-bin").glob("shard*"))), None)
        if args.data_bin is None:
            fail(f"--quality {args.quality} has no data/data-bin/shard*: not a quality study's folder")
    args.kinds = {m: model_kind(base_checkpoint(args, m)) for m in args.models}
    base = checkpoints.read_checkpoint(base_checkpoint(args, args.models[0]))
    args.n = checkpoints.model_namespace(base).max_positions
    for spec in args.ks if args.hf_dir else []:
        for long_n in [args.n * f for f in args.factors]:
            if not 0 < k_at(spec, long_n) <= long_n:
                fail(f"--ks {spec} gives k = {k_at(spec, long_n)} at n' = {long_n}: k must be in 1..n'")
    args.imdb_bin = prepare_imdb(args)
    specs = runs(args)
    unknown = sorted(set(args.runs or []) - set(specs))
    if unknown:
        fail(f"--runs {' '.join(unknown)}: not runs of this study; its runs are {' '.join(specs)}")
    if not args.report_only:
        for name in args.runs or specs:  # now: a finished run never asks for its checkpoint again
            specs[name].check()
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in [pool.submit(do_run, args, name, specs[name]) for name in args.runs or specs]:
                done.result()
    report(args, specs)


if __name__ == "__main__":
    main()
