#!/usr/bin/env python3
"""The PyTorch baseline beside `tools/bench_serve` on `q3vl serve`: transformers' generate() on the same model shape
with random weights, the same request shape (a prompt of P tokens holding one image of G x G patches, T greedy
tokens out), one request alone and B requests as one static batch.

usage: tools/gpu/hf_serve_baseline.py --preset 8B [--dtype bf16] [--prompt 274] [--grid 16] [--tokens 128]
                                      [--batch 32] [--attn sdpa] [--label NAME]

Prints Markdown table rows: batch, output tok/s, time to first token (a generate() of one token), time per output
token ((time of T tokens - time of 1) / (T - 1)). No tokenizer or processor files are needed (ids and pixels are
random; min_new_tokens keeps every answer T long). Static batching: the batch starts and ends together, which is
the best case for throughput and says nothing of a server's queueing.
"""
import argparse
import time

import torch
import transformers
from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                          Qwen3VLMoeForConditionalGeneration)

# q3vl's presets (src/model/config.cpp, spec section 7): vision depth, hidden, intermediate, out; text hidden,
# intermediate, layers, heads, kv heads, tied embeddings.
PRESETS = {
    "2B": ((24, 1024, 4096, 2048, [5, 11, 17]), (2048, 6144, 28, 16, 8, True)),
    "4B": ((24, 1024, 4096, 2560, [5, 11, 17]), (2560, 9728, 36, 32, 8, True)),
    "8B": ((27, 1152, 4304, 4096, [8, 16, 24]), (4096, 12288, 36, 32, 8, False)),
    "30B-A3B": ((27, 1152, 4304, 2048, [8, 16, 24]), (2048, 6144, 48, 32, 4, False)),
}
# The MoE presets' experts: count, experts per token, expert intermediate (every decoder layer sparse).
MOE = {"30B-A3B": (128, 8, 768)}


def model_class(cfg):
    """The transformers class of a config made by config(): dense or MoE."""
    return Qwen3VLMoeForConditionalGeneration if isinstance(cfg, Qwen3VLMoeConfig) else Qwen3VLForConditionalGeneration


def config(name, text_layers=0):
    """The preset's config; text_layers > 0 keeps the first text_layers decoder layers (built so, not cut after)."""
    (vd, vh, vi, vo, ds), (h, i, layers, heads, kv, tie) = PRESETS[name]
    layers = text_layers or layers
    moe = {}
    if name in MOE:
        e, k, im = MOE[name]
        moe = dict(num_experts=e, num_experts_per_tok=k, moe_intermediate_size=im, decoder_sparse_step=1,
                   mlp_only_layers=[], norm_topk_prob=True)
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        vision_config=dict(depth=vd, hidden_size=vh, intermediate_size=vi, out_hidden_size=vo, num_heads=16,
                           deepstack_visual_indexes=ds, patch_size=16, spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(hidden_size=h, intermediate_size=i, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=128, vocab_size=151936, max_position_embeddings=262144,
                         rope_theta=5000000.0, rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20],
                                                             "mrope_interleaved": True}, **moe),
        tie_word_embeddings=tie, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8B", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--prompt", type=int, default=274, help="prompt tokens, the image's among them")
    ap.add_argument("--grid", type=int, default=16, help="the image's patches per side (G*G/4 image tokens)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    cfg = config(a.preset)
    t0 = time.time()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_class(cfg)._from_config(cfg, torch_dtype=dt, attn_implementation=a.attn).eval()
        for name, p in model.named_parameters():  # small matrices, unit norms, zero biases: finite activations
            if p.dim() > 1:
                torch.nn.init.normal_(p, 0.0, 0.02)
            else:
                torch.nn.init.zeros_(p) if name.endswith("bias") else torch.nn.init.ones_(p)
    load_s = time.time() - t0
    n_img = a.grid * a.grid // 4
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1000, 150000, (a.prompt - n_img - 2,), generator=g)
    ids = torch.cat([text[:8], torch.tensor([151652] + [151655] * n_img + [151653]), text[8:]])
    pixels = torch.randn(a.grid * a.grid, 3 * 2 * 16 * 16, generator=g)

    def run(batch, new):
        inputs = dict(input_ids=ids.repeat(batch, 1).cuda(), attention_mask=torch.ones(batch, len(ids), dtype=torch.long).cuda(),
                      pixel_values=pixels.repeat(batch, 1).to("cuda", dt),
                      image_grid_thw=torch.tensor([[1, a.grid, a.grid]] * batch).cuda())
        torch.cuda.synchronize()
        t = time.time()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        assert out.shape[1] == len(ids) + new, out.shape
        return time.time() - t

    run(1, 4)  # warm-up: kernels, allocator
    print(f"<!-- transformers {transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{a.preset} {a.dtype} random weights ({load_s:.0f} s to build), attn {a.attn}, prompt {len(ids)} tokens "
          f"({n_img} image), {a.tokens} out -->")
    print("| run | batch | output tok/s | TTFT ms | TPOT ms | peak GiB |")
    print("|---|---|---|---|---|---|")
    for b in (1, a.batch):
        torch.cuda.reset_peak_memory_stats()
        first = run(b, 1)
        full = run(b, a.tokens)
        print(f"| {a.label or 'transformers ' + a.preset} | {b} | {b * a.tokens / full:.1f} | {first * 1e3:.1f} | "
              f"{(full - first) / (a.tokens - 1) * 1e3:.1f} | {torch.cuda.max_memory_allocated() / 2**30:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
