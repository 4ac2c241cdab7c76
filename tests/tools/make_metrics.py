#!/usr/bin/python3
"""Writes a realistic metrics.jsonl (the fields src/train/train.cpp writes) for the tools tests.

make_metrics.py OUT STEPS [--restart-at N --resume-from M] [--skip S,S] [--mfu] [--seed K]
A restart: after step N the log continues at step M+1 (as after resuming from checkpoint M).
"""
import argparse
import json
import math
import random

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("steps", type=int)
p.add_argument("--restart-at", type=int)
p.add_argument("--resume-from", type=int)
p.add_argument("--skip", default="")
p.add_argument("--mfu", action="store_true")
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
rng = random.Random(a.seed)
skip = {int(s) for s in a.skip.split(",") if s}
steps = list(range(1, a.steps + 1))
if a.restart_at:
    steps = list(range(1, a.restart_at + 1)) + list(range(a.resume_from + 1, a.steps + 1))
seen, skipped_total = 0, 0
with open(a.out, "w") as f:
    for s in steps:
        tokens = 8192 + rng.randrange(-512, 512)
        seen = s * 8192  # what the checkpoint restores
        dt = 0.8 + 0.1 * rng.random()
        lr = 1e-4 * min(1.0, s / 10) * (0.5 + 0.5 * math.cos(math.pi * s / a.steps))
        loss = 2.0 + 8.0 * math.exp(-s / 15) + 0.1 * rng.random()
        row = {"step": s, "loss": loss, "lr": lr, "grad_norm": 1.0 + 5 * math.exp(-s / 10),
               "tokens": tokens, "supervised_tokens": tokens // 2, "tokens_seen": seen,
               "tokens_per_s": tokens / dt,
               "time": {"step": dt, "data": 0.01, "forward": dt * 0.3, "backward": dt * 0.6, "comm": 0.02,
                        "optimizer": 0.03},
               "rss_mib": 4000.0 + s, "skipped": s in skip, "skipped_total": skipped_total,
               "dropped_samples": 0}
        if s in skip:
            skipped_total += 1
            row.update(loss=None, grad_norm=None, skipped_total=skipped_total)
        if a.mfu:
            row["mfu"] = 0.5 + 0.02 * rng.random()
        f.write(json.dumps(row) + "\n")
