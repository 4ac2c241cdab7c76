#!/usr/bin/python3
"""Writes a q3vl checkpoint in the documented layout (include/q3vl/io/checkpoint.hpp) from a HF model
directory, for the tools tests: model/<name> = the HF weights (MoE experts in the compute layout),
optimizer moments with small random values for every tensor the deck trains, checksums as checkpoint.cpp,
and (as q3vl train with model.hf) the directory's config.json unchanged in hf_config_json.

make_checkpoint.py HF_DIR OUT_DIR STEP [--freeze-vision]
"""
import argparse
import json
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "../../tools"))
from q3vl_tools import ckpt, safetensors  # noqa: E402
from q3vl_tools.hfconfig import to_compute_layout  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("hf_dir")
p.add_argument("out_dir")
p.add_argument("step", type=int)
p.add_argument("--freeze-vision", action="store_true")
a = p.parse_args()
with open(os.path.join(a.hf_dir, "config.json")) as f:
    cfg_text = f.read()
cfg = json.loads(cfg_text)
tune_vision = "false" if a.freeze_vision else "true"
deck = (f'[run]\nout_dir = "{a.out_dir}"\n\n[model]\nhf = "{os.path.abspath(a.hf_dir)}"\npreset = ""\n\n'
        f'[train]\nsteps = 100\nlr = 0.0001\ntune_vision = {tune_vision}\ntune_merger = true\ntune_llm = true\n')
rng = np.random.default_rng(a.step)
os.makedirs(a.out_dir, exist_ok=True)
name = f"step_{a.step:08d}.h5"
with h5py.File(os.path.join(a.out_dir, name), "w", libver=("v108", "v108")) as f:
    attrs = {"format": "q3vl-checkpoint", "format_version": np.int64(1), "step": np.int64(a.step),
             "tokens_seen": np.int64(a.step * 4096), "world_size": np.int64(4), "deck": deck,
             "state_json": json.dumps({"step": a.step, "adam_t": a.step, "tokens": a.step * 4096}),
             "build": "q3vl git test", "hf_config_json": cfg_text}
    for k, v in attrs.items():
        f.attrs[k] = v
    weights = safetensors.open_dir(a.hf_dir)
    tensors = {n: to_compute_layout(cfg, n, e.f32()) for n, e in sorted(weights.items())}
    decked = ckpt.deck_of(f)
    for prefix in ["model/"] + ckpt.MOMENTS:
        for n, w in tensors.items():
            if prefix != "model/" and not ckpt.trainable(decked, n):
                continue
            data = w if prefix == "model/" else rng.normal(0, 1e-3, w.shape).astype(np.float32)
            if prefix.endswith("_sq/"):
                data = data * data
            ds = f.create_dataset(prefix + n, data=data, dtype="<f4", track_times=False)
            ds.attrs["checksum"] = np.uint64(ckpt.scan(ds)[3])
with open(os.path.join(a.out_dir, "latest"), "w") as f:
    f.write(name + "\n")
print(os.path.join(a.out_dir, name))
