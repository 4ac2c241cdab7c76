#!/usr/bin/env python3
"""The PyTorch baseline beside `q3vl train input/bench_2b_gpu.deck` (issue 30): transformers' Qwen3-VL trained on the
same shape with random weights, as a careful PyTorch user would run it on one GPU: fp32 parameters and AdamW
(fused), bf16 autocast, SDPA attention, no activation checkpointing; each step B sequences of S tokens, each holding
one image of G x G patches (G*G/4 image tokens) and labels on every token.

usage: tools/gpu/hf_train_baseline.py [--preset 2B] [--text-layers N] [--batch 4] [--seq 4096] [--grid 28]
                                      [--steps 8] [--warmup 2] [--attn sdpa] [--peak 989e12] [--out FILE.jsonl]

--text-layers cuts the decoder to its first N layers (as q3vl's model.text_layers): the MoE preset 30B-A3B at 6
layers fits one GPU with fp32 AdamW. Prints one JSON line per step (step, time, tokens, tokens_per_s, mfu, max
memory) and a summary line: the median of the steps after the warm-up. mfu counts q3vl's model FLOPs
(src/train/flops.cpp: 3 x forward, MoE layers on their active experts only, causal attention) over --peak. Ids and
pixels are random; no tokenizer or processor files are needed.
"""
import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_serve_baseline import config, model_class  # noqa: E402  the presets' shapes, shared with serving


def train_flops(cfg, b, s, g):
    """q3vl's train_flops (src/train/flops.cpp) for B sequences of S tokens, one G x G-patch image each."""
    t, v = cfg.text_config, cfg.vision_config
    H, hd = t.hidden_size, t.head_dim
    moe = getattr(t, "num_experts", 0) > 0
    ffn = (t.num_experts * H + t.num_experts_per_tok * 3.0 * t.moe_intermediate_size * H) if moe else \
        3.0 * t.intermediate_size * H
    text_w = t.num_hidden_layers * (H * hd * (2.0 * t.num_attention_heads + 2.0 * t.num_key_value_heads) + ffn)
    tokens, keys = b * s, b * s * (s + 1) / 2
    patches, vkeys = b * g * g, b * float(g * g) ** 2
    m = v.spatial_merge_size
    dv, dm = v.hidden_size, v.hidden_size * m * m
    patch_dim = 3 * v.temporal_patch_size * v.patch_size ** 2
    vis_w = patch_dim * dv + v.depth * (4.0 * dv * dv + 2.0 * v.intermediate_size * dv)
    merger_w = (1.0 + len(v.deepstack_visual_indexes)) * (dm * dm + dm * v.out_hidden_size)
    fwd = (2 * text_w * tokens + 4 * t.num_attention_heads * hd * keys * t.num_hidden_layers
           + 2 * t.vocab_size * H * tokens + 2 * vis_w * patches + 2 * merger_w * patches / (m * m)
           + 4 * dv * vkeys * v.depth)
    return 3 * fwd


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
    ap.add_argument("--text-layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--grid", type=int, default=28, help="the image's patches per side (448 px: 28)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s for mfu (q3vl's runtime.peak_flops)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    cfg = config(a.preset, a.text_layers)
    flops = train_flops(cfg, a.batch, a.seq, a.grid)
    torch.manual_seed(0)
    with dev:
        model = model_class(cfg)._from_config(cfg, torch_dtype=torch.float32,
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
        rec = dict(step=step, time=dt, tokens=tokens, tokens_per_s=tokens / dt, mfu=flops / dt / a.peak,
                   loss=loss.item(),
                   max_memory_mib=torch.cuda.max_memory_allocated() / 2**20)
        print(json.dumps(rec), flush=True)
        if out:
            out.write(json.dumps(rec) + "\n")
        if step > a.warmup:
            times.append(dt)
    med = statistics.median(times)
    layers = f" ({cfg.text_config.num_hidden_layers} text layers)" if a.text_layers else ""
    print(f"transformers {a.preset}{layers}: {params / 1e9:.2f} B parameters, {a.batch} x {a.seq} tokens, one "
          f"{a.grid}x{a.grid}-patch image per sequence, {a.attn}, bf16 autocast, fused AdamW: median step {med:.3f} s, "
          f"{a.batch * a.seq / med:.0f} tokens/s (mfu {flops / med / a.peak:.3f}) over steps {a.warmup + 1}-{a.steps}; "
          f"max memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; torch {torch.__version__}", flush=True)


if __name__ == "__main__":
    main()
