#!/usr/bin/python3
"""Compares the weights of two HF model directories bit for bit, after bringing MoE experts of both to one
layout (each directory's config.json transformers_version says which it holds). Exit 1 naming the first
differences. st_compare.py DIR_A DIR_B"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "../../tools"))
from q3vl_tools import hfconfig, safetensors  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("a")
p.add_argument("b")
a = p.parse_args()
sets = []
for d in (a.a, a.b):
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    sets.append((cfg, safetensors.open_dir(d)))
(ca, ta), (cb, tb) = sets
bad = [f"only in {a.a}: {n}" for n in sorted(set(ta) - set(tb))]
bad += [f"only in {a.b}: {n}" for n in sorted(set(tb) - set(ta))]
for n in sorted(set(ta) & set(tb)):
    if ta[n].dtype != tb[n].dtype:
        bad.append(f"{n}: dtype {ta[n].dtype} vs {tb[n].dtype}")
        continue
    x = hfconfig.to_compute_layout(ca, n, ta[n].raw())
    y = hfconfig.to_compute_layout(cb, n, tb[n].raw())
    if x.shape != y.shape:
        bad.append(f"{n}: shape {list(x.shape)} vs {list(y.shape)}")
    elif x.tobytes() != y.tobytes():
        bad.append(f"{n}: {int(np.sum(x.view(np.uint8) != y.view(np.uint8)))} bytes differ")
if bad:
    print(f"{len(bad)} difference(s):\n  " + "\n  ".join(bad[:20]))
    sys.exit(1)
print(f"{len(ta)} tensors bitwise equal")
