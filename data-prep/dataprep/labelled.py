"""Write a labelled task in the layout of fairseq's `sentence_prediction` task.

  DEST/input0/{dict.txt, train.*, valid.*, test.*}   first text, binarized with the spm dict
  DEST/input1/...                                     second text of sentence-pair tasks
  DEST/label/{dict.txt, train.*, valid.*}             classification: one label token per row
  DEST/label/{train,valid}.label                      regression (--regression-target): a float per row
  DEST/meta.json                                      classes, --num-classes, rows per split

A second valid or test set (MNLI's mismatched ones) is split valid1/test1, as fairseq names them.
The class index of a label is its position in the task's class list (label/dict.txt order).
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from . import spm
from .common import atomic, fairseq_preprocess, log, preprocess_argv, remove


@dataclass
class Split:
    name: str  # fairseq split name: train, valid, valid1, test, test1
    inputs: list  # one list of texts per input (input0, input1)
    labels: list = None  # label strings; None for an unlabelled test set


def write_task(dest, splits, spm_model, srcdict, classes, workers, recipe=None):
    """Encode, binarize and describe `splits`; classes=None means a regression target.
    The caller checks `recipe` (what the splits were read from) and this saves it in `dest`."""
    dest = Path(dest)
    n_inputs = len(splits[0].inputs)
    log(f"writing {dest} ({', '.join(f'{s.name} {len(s.inputs[0]):,}' for s in splits)} rows)")
    with atomic(dest, recipe) as tmp:
        raw = tmp / "raw"
        raw.mkdir(parents=True)
        for s in splits:
            for k, texts in enumerate(s.inputs):
                _write_lines(raw / f"{s.name}.input{k}.txt", texts)
                spm.encode(spm_model, raw / f"{s.name}.input{k}.txt", raw / f"{s.name}.input{k}", workers)
            if s.labels is not None:
                _write_lines(raw / f"{s.name}.label", s.labels)
        argvs = [
            preprocess_argv(srcdict, tmp / f"input{k}", workers, **_prefixes(splits, raw, f"input{k}"))
            for k in range(n_inputs)
        ]
        labelled = [s for s in splits if s.labels is not None]
        if classes:
            _write_lines(raw / "label.dict", [f"{c} 1" for c in classes])
            argvs.append(
                preprocess_argv(raw / "label.dict", tmp / "label", workers, **_prefixes(labelled, raw, "label"))
            )
        else:  # sentence_prediction reads regression targets as text: label/<split>.label
            (tmp / "label").mkdir()
            for s in labelled:
                _write_lines(tmp / "label" / f"{s.name}.label", s.labels)
        fairseq_preprocess(*argvs)
        remove(raw)
        meta = {
            "classes": list(classes) if classes else None,
            "num_classes": len(classes) if classes else 1,
            "regression_target": not classes,
            "rows": {s.name: len(s.inputs[0]) for s in splits},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return dest


def _prefixes(splits, raw, suffix):
    """trainpref/validpref/testpref; several valid (or test) sets are comma-separated."""
    kinds = {}
    for s in splits:
        kinds.setdefault(re.sub(r"\d+$", "", s.name), []).append(f"{raw / s.name}.{suffix}")
    return {f"{kind}pref": ",".join(paths) for kind, paths in kinds.items()}


def _write_lines(path, lines):
    with open(path, "w") as f:
        f.writelines(f"{line}\n" for line in lines)
