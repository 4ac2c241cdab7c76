#!/usr/bin/python3
"""A random-weight HF model directory (transformers 5 layout, as save_pretrained writes it) from a base
config.json with text_config overrides, e.g. an MoE with H != 2*Im (the golden MoE has H == 2*Im, where
the expert layout cannot be told from the shapes).

make_hf_model.py BASE_CONFIG OUT_DIR key=value... (text_config keys, integer values)"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "../../tools"))
from q3vl_tools import hfconfig, safetensors  # noqa: E402

base, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(base) as f:
    cfg = json.load(f)
for kv in overrides:
    k, v = kv.split("=", 1)
    cfg["text_config"][k] = int(v)
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
rng = np.random.default_rng(0)
shapes = hfconfig.expected_shapes(cfg)  # compute layout = transformers 5 layout
tensors = [(n, s, lambda s=s: rng.normal(0, 0.05, s).astype(np.float32)) for n, s in sorted(shapes.items())]
safetensors.write_sharded(out, tensors, "F32", 1 << 40)
print(out)
