"""Reading metrics.jsonl (one JSON object per optimizer step, written by `q3vl train`).

Fields used (src/train/train.cpp): step, loss, lr, grad_norm, tokens, tokens_seen, tokens_per_s,
time.step (seconds of the step), skipped, rss_mib; optional: mfu (a fraction), resumed, time.wall, and any other
memory figure: a number whose key ends in _mib or contains "mem", or one inside such an object, named with a dot
(memory_mib.activations); gathered_mib is traffic, not memory.

A restart shows as a step that is not larger than the one before it, or as a line with "resumed": true.
Wall time is the running sum of time.step (training time; start-up and checkpoint writes are not in it).
"""
import json
import math
import os

from . import ToolError


class Run:
    def __init__(self, path, label, rows, restarts):
        self.path = path
        self.label = label
        self.rows = rows          # dicts as written, plus "_line" and "_wall" (cumulative step time, s)
        self.restarts = restarts  # indices into rows where a new segment (after a restart) begins

    def series(self, key):
        """(steps, walls, values) of the rows where key holds a finite number."""
        pts = [(r["step"], r["_wall"], num(field(r, key))) for r in self.rows]
        pts = [p for p in pts if p[2] is not None]
        return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]

    def segments(self):
        """Row index ranges [b, e) between restarts."""
        cuts = [0] + self.restarts + [len(self.rows)]
        return [(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)]

    def skipped_rows(self):
        return [r for r in self.rows if r.get("skipped") is True]

    def memory_keys(self):
        keys = []
        for r in self.rows:
            for k, v in r.items():
                if not (k.endswith("_mib") or "mem" in k) or k == "gathered_mib":
                    continue
                for name, x in (v.items() if isinstance(v, dict) else [(None, v)]):
                    key = k if name is None else f"{k}.{name}"
                    if key not in keys and num(x) is not None:
                        keys.append(key)
        return keys


def field(row, key):
    """row[key], where a dotted key walks into nested objects (memory_mib.activations)."""
    if key in row:
        return row[key]
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def num(v):
    """v as a float if it is a finite number (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def step_seconds(row):
    t = row.get("time")
    return num(t.get("step")) if isinstance(t, dict) else num(t)


def load_run(path, label=None):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ToolError(f"cannot read {path}: {e.strerror}")
    lines = data.decode("utf-8", errors="replace").split("\n")
    last = max((n for n, t in enumerate(lines, 1) if t.strip()), default=0)
    rows, restarts, wall = [], [], 0.0
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except ValueError:
            what = "truncated line" if n == last else "not valid JSON"
            raise ToolError(f"{path}:{n}: {what} ({text[:60]!r})")
        if not isinstance(row, dict):
            raise ToolError(f"{path}:{n}: not a JSON object")
        if isinstance(row.get("step"), bool) or not isinstance(row.get("step"), int):
            raise ToolError(f"{path}:{n}: no integer 'step' field (is this a q3vl metrics.jsonl?)")
        if rows and (row["step"] <= rows[-1]["step"] or row.get("resumed") is True):
            restarts.append(len(rows))
        wall += step_seconds(row) or 0.0
        row["_line"], row["_wall"] = n, wall
        rows.append(row)
    if not rows:
        raise ToolError(f"{path}: empty log (no metrics lines)")
    if label is None:
        parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
        label = parent or os.path.basename(path)
    return Run(path, label, rows, restarts)


def load_runs(paths, labels=None):
    if labels and len(labels) != len(paths):
        raise ToolError(f"{len(labels)} labels for {len(paths)} metrics files")
    runs = [load_run(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    seen = {}
    for r in runs:  # two runs from directories of the same name: tell them apart
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1 and not labels:
            r.label = r.path
    return runs


def summary(run):
    """One run's figures for summarize: a dict of numbers (None where the log has no data)."""
    rows = run.rows
    secs = [step_seconds(r) for r in rows]
    tokens = [num(r.get("tokens")) for r in rows]
    total_s = sum(s for s in secs if s is not None)
    timed_tokens = sum(t for t, s in zip(tokens, secs) if t is not None and s is not None)
    losses = [(num(r.get("loss")), r["step"]) for r in rows if r.get("skipped") is not True]
    losses = [(l, s) for l, s in losses if l is not None]
    mfus = [m for m in (num(r.get("mfu")) for r in rows) if m is not None]
    seen = num(rows[-1].get("tokens_seen"))
    best = min(losses) if losses else (None, None)
    return {
        "steps": rows[-1]["step"],
        "lines": len(rows),
        "tokens": seen if seen is not None else (sum(t for t in tokens if t is not None) if any(
            t is not None for t in tokens) else None),
        "wall_s": total_s if any(s is not None for s in secs) else None,
        "tokens_per_s": timed_tokens / total_s if total_s > 0 and timed_tokens > 0 else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "restarts": len(run.restarts),
        "skipped": len(run.skipped_rows()),
        "final_loss": losses[-1][0] if losses else None,
        "best_loss": best[0],
        "best_step": best[1],
    }
