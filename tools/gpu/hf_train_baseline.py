#!/usr/bin/env python3
"""The PyTorch baseline beside `q3vl train input/bench_2b_gpu.deck` (issue 30): transformers' Qwen3-VL trained on the
same shape with random weights, as a careful PyTorch user would run it on one GPU: fp32 parameters and AdamW
(fused), bf16 autocast, SDPA attention, no activation checkpointing; each step B sequences of S tokens, each holding
one image of G x G patches (G*G/4 image tokens) and labels on every token.

usage: tools/gpu/hf_train_baseline.py [--preset 2B] [--batch 4] [--seq 4096] [--grid 28] [--steps 8] [--warmup 2]
                                      [--attn sdpa] [--out FILE.jsonl]

Prints one JSON line per step (step, time, tokens, tokens_per_s, max memory) and a summary line: the median of the
steps after the warm-up. Ids and pixels are random; no tokenizer or processor files are needed.
"""
import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_serve_baseline import config  # noqa: E402  the presets' shapes, shared with the serving baseline

from transformers import Qwen3VLForConditionalGeneration  # noqa: E402


def batch(cfg, b, s, g, dev):
    """B sequences of S ids: vision start, G*G/4 image pads, vision end, random text; one image per sequence."""
    n_img = g * g // 4
    ids = torch.randint(0, 150000, (b, s), device=dev)
    ids[:, 0] = cfg.vision_start_token_id
    ids[:, 1:1 + n_img] = cfg.image_token_id
    ids[:, 1 + n_img] = cfg.vision_end_token_id
    patch = 3 * cfg.vision_config.temporal_patch_size * cfg.vision_config.patch_size ** 2
    pixels = torch.randn(b * g * g, patch, device=dev)
    grid = torch.tensor([[1, g, g]] * b, device=dev)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone(), pixel_values=pixels,
                image_grid_thw=grid, mm_token_type_ids=(ids == cfg.image_token_id).long())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="2B")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--grid", type=int, default=28, help="the image's patches per side (448 px: 28)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    cfg = config(a.preset)
    torch.manual_seed(0)
    with dev:
        model = Qwen3VLForConditionalGeneration._from_config(cfg, torch_dtype=torch.float32,
                                                             attn_implementation=a.attn)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    params = sum(p.numel() for p in model.parameters())
    out = open(a.out, "w") if a.out else None
    times = []
    for step in range(1, a.steps + 1):
        x = batch(cfg, a.batch, a.seq, a.grid, dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens = a.batch * a.seq
        rec = dict(step=step, time=dt, tokens=tokens, tokens_per_s=tokens / dt, loss=loss.item(),
                   max_memory_mib=torch.cuda.max_memory_allocated() / 2**20)
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
        if step > a.warmup:
            times.append(dt)
    med = statistics.median(times)
    print(f"transformers {a.preset}: {params / 1e9:.2f} B parameters, {a.batch} x {a.seq} tokens, one {a.grid}x{a.grid}"
          f"-patch image per sequence, {a.attn}, bf16 autocast, fused AdamW: median step {med:.3f} s, "
          f"{a.batch * a.seq / med:.0f} tokens/s over steps {a.warmup + 1}-{a.steps}; max memory "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
