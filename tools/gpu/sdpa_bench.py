#!/usr/bin/env python3
"""PyTorch SDPA forward and backward at bin/attn_check's shapes: the baseline of issue 30's attention goal, timed in the
same device call as bin/attn_check.

    env -u LD_LIBRARY_PATH python3 tools/gpu/sdpa_bench.py [--iters 20] [--first N] [--out sdpa.jsonl]

Each case runs torch.nn.functional.scaled_dot_product_attention on [batch, heads, L, hd] tensors (equal-length
segments as a batch: attn_check's packed segments are all of one length), bf16 or fp16, through every backend that
takes it: PyTorch's own choice ("default"), then FLASH_ATTENTION, EFFICIENT_ATTENTION and CUDNN_ATTENTION forced one
at a time. Grouped-query cases (16 query heads, 8 kv heads) pass enable_gqa=True. Times are medians of --iters calls
between CUDA events, after 3 warm-up calls: the forward with autograd recording (as in training), the backward as
torch.autograd.grad of one recorded forward's output (retain_graph). A backend that refuses a case is listed as such.
"""
import argparse
import contextlib
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# name, segments, L, query heads, kv heads, hd, causal, dtype: bin/attn_check's timing table, in its order
CASES = [
    ("text", 4, 4096, 16, 8, 128, True, torch.bfloat16),
    ("text", 4, 4096, 16, 8, 128, True, torch.float16),
    ("text", 4, 4096, 16, 8, 64, True, torch.bfloat16),
    ("vision", 20, 784, 16, 16, 64, False, torch.bfloat16),
    ("vision", 4, 1024, 16, 16, 64, False, torch.bfloat16),
    ("vision", 1, 16384, 16, 16, 64, False, torch.bfloat16),
    ("vision", 20, 784, 16, 16, 72, False, torch.bfloat16),
    ("vision", 1, 1024, 16, 16, 72, False, torch.bfloat16),
    ("vision", 1, 16384, 16, 16, 72, False, torch.bfloat16),
]
BACKENDS = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def median_ms(f, iters):
    for _ in range(3):
        f()
    times = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        f()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def run_case(case, backend, iters):
    _, b, L, nh, nkv, hd, causal, dt = case
    gen = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda h: torch.randn(b, h, L, hd, device="cuda", dtype=dt, generator=gen).requires_grad_()
    q, k, v = mk(nh), mk(nkv), mk(nkv)
    do = torch.randn(b, nh, L, hd, device="cuda", dtype=dt, generator=gen)
    gqa = nh != nkv

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        t_fwd = median_ms(fwd, iters)
        out = fwd()
        t_bwd = median_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), iters)
    return t_fwd, t_bwd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--first", type=int, default=len(CASES))
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cudnn {torch.backends.cudnn.version()}")
    print(f"{'case (median of %d)' % a.iters:<40} {'backend':<10} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} "
          f"{'fwd TF':>7} {'bwd TF':>7}")
    rows = []
    for case in CASES[:a.first]:
        name, b, L, nh, nkv, hd, causal, dt = case
        label = (f"{name} {b}x{L} {nh}/{nkv} hd{hd}{' causal' if causal else ''} "
                 f"{'bf16' if dt == torch.bfloat16 else 'fp16'}")
        flops = 4.0 * nh * hd * b * L * L / (2.0 if causal else 1.0)
        for bname, backend in BACKENDS:
            try:
                tf, tb = run_case(case, backend, a.iters)
            except RuntimeError as e:  # the backend does not take this case
                print(f"{label:<40} {bname:<10} refused: {str(e).splitlines()[0][:80]}")
                torch.cuda.empty_cache()
                continue
            print(f"{label:<40} {bname:<10} {tf:8.3f} {tb:8.3f} {tf + tb:8.3f} {flops / tf * 1e-9:7.1f} "
                  f"{2.5 * flops / tb * 1e-9:7.1f}")
            rows.append({"case": label, "backend": bname, "fwd_ms": tf, "bwd_ms": tb, "fb_ms": tf + tb})
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
