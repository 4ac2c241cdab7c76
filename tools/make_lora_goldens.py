#!/usr/bin/env python3
"""PEFT goldens for q3vl's LoRA (issue 21): logits, loss and the gradient of every adapter matrix, from
transformers + peft in fp32, for the committed golden base models (dense and MoE, with images).

Run on the GPU machine (PyTorch, transformers 5.17 and peft 0.21 are there; tools/gpu/train_checks.sh's
"goldens" part does it):

    python tools/make_lora_goldens.py OUTDIR [--cases dense_tied,dense_untied,moe] [--device cpu|cuda]

and copy OUTDIR/<case>/ to tests/data/golden/<case>/lora/. Per case it reads tests/data/golden/<case>/model and
batch.h5 (the base and the batch of the model goldens) and writes
    OUTDIR/<case>/adapter/       PEFT save_pretrained: adapter_config.json + adapter_model.safetensors (B random,
                                 so that A's gradients are not zero)
    OUTDIR/<case>/expected.h5    logits (f32 [B,S,V]), loss (f64), grads/<PEFT tensor name> (f32) for every
                                 lora_A / lora_B; attrs: r, lora_alpha, use_rslora, target_modules
q3vl's side: `q3vl eval model.hf=<case>/model lora.adapter=OUTDIR/<case>/adapter eval.batch=<case>/batch.h5
eval.grads=true` must give the same logits and grads to 2e-5 and the loss to 1e-5 (tests/unit/test_lora.cpp, on the
CPU op layer and on CUDA); base gradients are not computed
(the base has requires_grad False here as well). Targets: the text attention and MLP projections, the vision blocks'
qkv/proj/fc, the mergers' fc and lm_head (PEFT then saves the head's weights beside the adapters, as
lm_head.base_layer.weight). Not the MoE router: PEFT cannot wrap transformers 5.17's Qwen3VLMoeTextTopKRouter (the
script keeps only nn.Linear modules); q3vl's router adapters are checked against the host model and finite
differences instead (test_lora.cpp). MoE experts are fused 3-D parameters that neither wraps.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "mlp.gate", "attn.qkv",
           "attn.proj", "linear_fc1", "linear_fc2", "lm_head"]


def run_case(name, args):
    import h5py
    import numpy as np
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1234)
    base_dir = os.path.join(REPO, "tests/data/golden", name, "model")
    out = os.path.join(args.outdir, name)
    os.makedirs(out, exist_ok=True)
    cfg = transformers.AutoConfig.from_pretrained(base_dir)
    cls = (transformers.Qwen3VLMoeForConditionalGeneration if "Moe" in cfg.architectures[0]
           else transformers.Qwen3VLForConditionalGeneration)
    model = cls.from_pretrained(base_dir, torch_dtype=torch.float32, attn_implementation="eager")
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    targets = [t for t in TARGETS if any(n == t or n.endswith("." + t) for n in names)]
    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, use_rslora=args.rslora,
                    init_lora_weights=True)
    model = get_peft_model(model, lc)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT inits B to zero: A's gradients would all be zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(os.path.join(out, "adapter"))
    model.train()
    model.to(args.device)

    with h5py.File(os.path.join(REPO, "tests/data/golden", name, "batch.h5")) as b:
        batch = {k: torch.from_numpy(b[k][()]).to(args.device) for k in b.keys()
                 if k in ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw",
                          "mm_token_type_ids")}
    out_ = model(**batch, output_router_logits=False) if "Moe" in cfg.architectures[0] else model(**batch)
    out_.loss.backward()
    with h5py.File(os.path.join(out, "expected.h5"), "w") as f:
        f.create_dataset("logits", data=out_.logits.detach().float().cpu().numpy())
        f.create_dataset("loss", data=np.float64(out_.loss.item()))
        for n, p in model.named_parameters():
            if "lora_" in n:
                assert p.grad is not None, n
                # PEFT's saved names drop the adapter name: ...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight
                f.create_dataset("grads/" + n.replace(".default", ""), data=p.grad.float().cpu().numpy())
            else:
                assert p.grad is None, f"base parameter {n} got a gradient"
        f.attrs.update({"r": 4, "lora_alpha": 8, "use_rslora": args.rslora, "target_modules": json.dumps(targets)})
    print(f"{name}: loss {out_.loss.item():.8f}, {len(targets)} target patterns -> {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir")
    p.add_argument("--cases", default="dense_tied,dense_untied,moe")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rslora", action="store_true")
    args = p.parse_args()
    for c in args.cases.split(","):
        run_case(c, args)


if __name__ == "__main__":
    sys.exit(main())
