#!/usr/bin/env python3
"""The PyTorch baseline beside `mpiexec -n N bin/q3vl train` on the GPUs of one host (issue 35): transformers'
Qwen3-VL trained with FSDP2 (torch.distributed.fsdp.fully_shard), as a careful PyTorch user would shard it: every
decoder layer and vision block its own FSDP unit, then the root; parameters gathered in bf16, gradients
reduce-scattered in fp32, fp32 masters and AdamW (fused) on the shards. Each rank trains on its own B sequences of S
tokens a micro-step, each sequence holding one image of G x G patches and labels on every token
(tools/gpu/hf_train_baseline.py's batch: random ids and pixels, no tokenizer files).

    torchrun --standalone --nproc-per-node N tools/gpu/fsdp_train_baseline.py [--preset 8B] [--text-layers L]
        [--batch 4] [--seq 4096] [--grid 28] [--accum 1] [--steps 8] [--warmup 2] [--checkpointing]
        [--offload] [--peak 989e12] [--out FILE.jsonl]

--checkpointing recomputes each decoder layer in the backward (transformers' gradient checkpointing; q3vl's
train.recompute = "block"); --offload keeps parameters, gradients and the optimizer on the host (FSDP2's
CPUOffloadPolicy: the update runs on the CPU); --accum A runs A micro-steps an optimizer step, gradients reduced on
the last only. Rank 0 prints one JSON line a step (tokens and tokens/s per GPU and in all, mfu per GPU by q3vl's
FLOP count, max memory) and a summary line: the median over the steps after the warm-up.

The model is built on the host with the same seed on every rank, then sharded: fully_shard moves each rank's shards
to its GPU (host memory: one fp32 copy of the model a rank while it starts; the 8B: 35 GB).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from hf_serve_baseline import config, model_class  # noqa: E402  the presets' shapes
from hf_train_baseline import batch, train_flops  # noqa: E402  the batch and q3vl's FLOP count


def shard(model, offload):
    """FSDP units: each decoder layer and vision block (the classes whose names say so), then the root."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload else None)
    kw = {k: v for k, v in kw.items() if v is not None}
    units = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "VisionBlock"))]
    for m in units:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return len(units)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8B")
    ap.add_argument("--text-layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    ap.add_argument("--batch", type=int, default=4, help="sequences a rank a micro-step")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--grid", type=int, default=28, help="the image's patches per side (448 px: 28)")
    ap.add_argument("--accum", type=int, default=1, help="micro-steps an optimizer step")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpointing", action="store_true", help="recompute each decoder layer in the backward")
    ap.add_argument("--offload", action="store_true", help="FSDP2's CPUOffloadPolicy (the update on the host)")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--peak", type=float, default=989e12, help="peak FLOP/s a GPU for mfu (q3vl's runtime.peak_flops)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    cfg = config(a.preset, a.text_layers)
    torch.manual_seed(0)  # the same weights on every rank before sharding
    model = model_class(cfg)._from_config(cfg, torch_dtype=torch.float32, attn_implementation=a.attn)
    params = sum(p.numel() for p in model.parameters())
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    units = shard(model, a.offload)  # moves each rank's shards and the buffers to its GPU (offload: shards to the host)
    model.train()
    # Fused AdamW on the GPU's DTensor shards; on the host (offload) the default implementation.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({} if a.offload else {"fused": True}))
    flops = train_flops(cfg, a.batch, a.seq, a.grid) * a.accum  # a rank's, an optimizer step
    torch.manual_seed(1 + rank)  # each rank its own data
    out = open(a.out, "w") if a.out and rank == 0 else None
    times = []
    for step in range(1, a.steps + 1):
        xs = [batch(cfg, a.batch, a.seq, a.grid, dev) for _ in range(a.accum)]
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for i, x in enumerate(xs):
            model.set_requires_gradient_sync(i + 1 == a.accum)
            loss = model(**x).loss / a.accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dist.barrier()
        dt = time.perf_counter() - t0
        tokens = a.batch * a.seq * a.accum  # a GPU's
        rec = dict(step=step, time=dt, gpus=world, tokens=tokens, tokens_per_s=tokens / dt,
                   tokens_per_s_total=world * tokens / dt, mfu=flops / dt / a.peak, loss=loss.item() * a.accum,
                   max_memory_mib=torch.cuda.max_memory_allocated() / 2**20)
        if rank == 0:
            print(json.dumps(rec), flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
        if step > a.warmup:
            times.append(dt)
    med = statistics.median(times)
    tok = a.batch * a.seq * a.accum
    if rank == 0:
        layers = f" ({cfg.text_config.num_hidden_layers} text layers)" if a.text_layers else ""
        print(f"FSDP2 {a.preset}{layers} on {world} GPU(s): {params / 1e9:.2f} B parameters in {units + 1} FSDP units, "
              f"{a.batch} x {a.seq} tokens a GPU a micro-step x {a.accum}, one {a.grid}x{a.grid}-patch image per "
              f"sequence, {a.attn}, bf16 parameters / fp32 reductions, "
              f"{'CPUOffloadPolicy' if a.offload else 'fused AdamW'}{', checkpointing' if a.checkpointing else ''}: "
              f"median step {med:.3f} s, {tok / med:.0f} tokens/s per GPU ({world * tok / med:.0f} in all, mfu "
              f"{flops / med / a.peak:.3f}) over steps {a.warmup + 1}-{a.steps}; max memory "
              f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; torch {torch.__version__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
