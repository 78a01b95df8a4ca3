"""fairseq's training logs, read one way for the quickstart, scripts/collect_results.py, the
quality study and the tests. fairseq writes a record per log interval and per validation, in
one of two formats:

  json (the configs' common.log_format):  ... | INFO | valid | {"epoch": 1, "valid_loss": "9.1", ...}
                                 (hydra): [2026-...][valid][INFO] - {"epoch": 1, ...}
  simple:  ... | INFO | valid | epoch 001 | valid on 'valid' subset | loss 9.1 | ppl 557 | ...

records() gives both as dicts with the keys as in the json format, minus its 'valid_'/'train_'
prefix, values as floats where they are numbers.
"""

import json
import re
from pathlib import Path

_SIMPLE_FIELD = re.compile(r"^(\S+) (\S+)$")


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def _parse(line: str, tag: str):
    """The record on ``line`` if it is one of kind ``tag``, else None."""
    if f"[{tag}][" in line or f"| {tag} | " in line:
        if "{" in line:  # json
            stats = json.loads(line[line.index("{") :])
            prefix = f"{tag}_" if tag != "train_inner" else ""
            return {k.removeprefix(prefix): _number(v) for k, v in stats.items()}
        text = line.split(f"| {tag} | ", 1)[-1]
        if tag == "train_inner":  # "epoch 001:  10 / 50 loss=9.1, ppl=549, ..., num_updates=10"
            pairs = (f.split("=", 1) for f in text.split(":", 1)[-1].split(", ") if "=" in f)
            return {k.strip().split()[-1]: _number(v) for k, v in pairs}
        fields = (_SIMPLE_FIELD.match(f.strip()) for f in text.split(" | "))
        return {m[1]: _number(m[2]) for m in fields if m}
    return None


def records(log, tag: str = "valid", start: int = 0, end: int = -1) -> list:
    """The records of kind ``tag`` (valid, train_inner, train) in bytes [start, end) of ``log``;
    [] if the file does not exist yet."""
    log = Path(log)
    if not log.exists():
        return []
    with open(log, "rb") as f:
        f.seek(start)
        return records_in(f.read(end - start if end >= 0 else -1).decode(errors="replace"), tag)


def records_in(text: str, tag: str = "valid") -> list:
    """The records of kind ``tag`` in a log's text (e.g. a training command's captured output)."""
    return [r for r in (_parse(line, tag) for line in text.splitlines()) if r is not None]


def by_update(stats, key: str = "loss") -> dict:
    """{num_updates: stats[key]}; a resumed run may log an update twice: the last one stays."""
    return {int(s["num_updates"]): s[key] for s in stats if key in s}
