"""What each way of reading a long document costs, side by side in one process: the update time
and peak memory of finetuning (an update of --batch documents in steps of at most --step-tokens
tokens, as studies/study_long_documents.py finetunes) and documents a second predicting, for
each option at the length it reads:

  head+tail 512      the encoder as imported (n = 512), 8 documents of 512 tokens a step
  chunks of 512      the same encoder over documents of --long-n tokens in chunks of 512
                     (--chunk-length 512: the head reads the mean of every chunk's states)
  full attention     the encoder extended to n' = --long-n (scripts/extend_max_positions.py)
  Linformer          k = n'/4 at n' (scripts/convert_roberta_to_linformer.py, exact reading)
  Linformer + band   the same with --local-window 128

Costs do not depend on weights: the Linformers are converted, not distilled. Every option is
timed --rounds times, in reverse order on every other round (a point on a shared 2-core VM
moves by up to 30% between timings). Run it alone on the machine. Writes --out (JSON: each
option's timings per round, the date, the command and the machine), which
studies/long_documents_records.py add-cost merges into the committed records.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from linformer_tools.common import SCRIPTS_DIR, fail, write_text

from common import command_line, finetuning_cost, load, log, sh
from long_documents.runs import step_batch


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", type=Path, required=True,
                   help="a study --out made with --hf-dir (its original/model.pt, dict.txt)")  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="the JSON to write")
    p.add_argument("--long-n", type=int, default=2048, help="n' of the options that read whole documents")
    p.add_argument("--batch", type=int, default=8, help="documents an update (default: 8, the study's)")
    p.add_argument("--step-tokens", type=int, default=4096, help="tokens a step at most (default: 4096)")
    p.add_argument("--rounds", type=int, default=2, help="timings of each option (default: 2)")
    p.add_argument("--timing-seconds", type=float, default=10, help="each timing lasts at least this (default: 10)")
    p.add_argument("--options", nargs="+", help="only these options (names as in --help, e.g. 'head+tail 512')")
    return p


def models(args):
    """option -> (checkpoint, what it reads, model settings changed after loading)."""
    original = args.study / "original" / "model.pt"
    if not original.is_file():
        fail(f"--study {args.study}: no original/model.pt (a study made with --hf-dir)")
    made = args.study / "cost-models"
    made.mkdir(exist_ok=True)
    extended = made / f"original-n{args.long_n}.pt"
    if not extended.is_file():
        sh([sys.executable, SCRIPTS_DIR / "extend_max_positions.py", original, extended,
            "--max-positions", args.long_n], made / "extend.log")  # fmt: skip
    found = {
        "head+tail 512": (original, 512, {}),
        "chunks of 512": (original, args.long_n, {"chunk_length": 512, "pooler_tokens": "mean"}),
        f"full attention {args.long_n}": (extended, args.long_n, {}),
    }
    for name, band in (("Linformer", []), ("Linformer + band", ["--local-window", 128])):
        path = made / f"linformer-n{args.long_n}-k{args.long_n // 4}{'-w128' if band else ''}.pt"
        if not path.is_file():
            sh([sys.executable, SCRIPTS_DIR / "convert_roberta_to_linformer.py", extended, path, "--compressed-dim",
                args.long_n // 4, "--compress-length-norm", "exact", *band], path.with_suffix(".log"))  # fmt: skip
        found[f"{name} k={args.long_n // 4}"] = (path, args.long_n, {})
    return found


def cost(args, checkpoint, reads, settings):
    model, task = load(checkpoint, args.study / "original")
    for key, value in settings.items():
        setattr(model.args, key, value)
    step = step_batch(args, reads)
    measured = finetuning_cost(model, task, step, reads, args.timing_seconds)
    measured["seconds_per_update"] *= args.batch // step  # an update is batch // step steps
    return {**measured, "reviews_per_step": step}


def main():
    args = build_parser().parse_args()
    if args.rounds < 1 or args.timing_seconds <= 0 or args.long_n <= 512:
        fail("--rounds must be >= 1, --timing-seconds > 0 and --long-n > 512")
    options = models(args)
    unknown = set(args.options or []) - set(options)
    if unknown:
        fail(f"--options {sorted(unknown)}: the options are {sorted(options)}")
    names = args.options or list(options)
    found = {name: dict(reads=options[name][1], checkpoint=options[name][0].name) for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            log(f"round {round_ + 1}: {name}")
            for key, value in cost(args, *options[name]).items():
                if key in ("parameters", "reviews_per_step"):
                    found[name][key] = value
                else:
                    found[name].setdefault(key, []).append(value)
    import torch

    command = command_line("studies/long_documents_cost.py", {"--study": "OUT", "--out": "COST.json"})
    record = dict(date=time.strftime("%Y-%m-%d", time.gmtime()), command=command,
                  machine=dict(cpus=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__),
                  batch=args.batch, step_tokens=args.step_tokens, options=found)  # fmt: skip
    write_text(args.out, json.dumps(record, indent=1) + "\n")
    for name, r in found.items():
        print(f"{name}: s/update {r['seconds_per_update']}, peak MB {[round(m) for m in r['peak_mb']]}, "
              f"docs/s {[round(d, 2) for d in r['documents_per_second']]}")  # fmt: skip


if __name__ == "__main__":
    main()
