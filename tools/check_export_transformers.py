#!/usr/bin/env python3
"""Checks a tools/export_hf directory with Hugging Face transformers (run where PyTorch and transformers are,
e.g. the GPU machine; needs torch, transformers, safetensors, h5py, numpy):

  1. transformers loads the model, the tokenizer and the processor from the directory;
  2. every weight transformers holds equals the file's tensor (MoE experts: transformers 5 keeps them as
     [E,2Im,H]/[E,H,Im], the file in the released [E,H,2Im]/[E,Im,H] layout, so the transpose);
  3. its logits and loss on a batch file (tests/data/golden/*/batch.h5 layout) equal those `q3vl eval` wrote
     for the same directory (eval.output=...), over the positions with attention_mask 1;
  4. with --chat tests/data/chat/golden.json: the exported chat template renders every "messages" case as
     transformers' reference text.

  python3 tools/check_export_transformers.py DIR --batch BATCH.h5 --eval EVAL.h5 [--chat GOLDEN.json]
Exit status 1 if any check fails; each check prints one line.
"""
import argparse
import json
import os
import sys

import h5py
import numpy as np
import torch
import transformers
from safetensors import safe_open


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--batch", required=True, help="batch file given to q3vl eval")
    p.add_argument("--eval", required=True, help="q3vl eval's output for this directory and batch")
    p.add_argument("--chat", help="tests/data/chat/golden.json: also check the chat template")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tol", type=float, default=1e-4, help="largest |logit difference| / max(1, max |logit|)")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    failures = []

    def check(name, good, detail):
        print(f"{'ok' if good else 'FAIL'}: {name}: {detail}")
        if not good:
            failures.append(name)

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, device {a.device}")
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        a.model_dir, dtype=torch.float32, attn_implementation="eager").to(a.device).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    check("model loads", True, type(model).__name__)
    tok = transformers.AutoTokenizer.from_pretrained(a.model_dir)
    check("tokenizer loads", len(tok) > 151000, f"{type(tok).__name__}, {len(tok)} tokens")
    try:
        proc = transformers.AutoProcessor.from_pretrained(a.model_dir)
        check("processor loads", True, type(proc).__name__)
    except Exception as e:  # noqa: BLE001 - report and go on
        check("processor loads", False, repr(e))

    # 2. Weights as loaded against the files.
    index = json.load(open(os.path.join(a.model_dir, "model.safetensors.index.json")))["weight_map"]
    state = model.state_dict()
    bad = []
    for shard in sorted(set(index.values())):
        with safe_open(os.path.join(a.model_dir, shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).float()
                # transformers 5 holds experts as the transpose of the released layout the file has
                expert = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
                want = t.transpose(1, 2) if expert else t
                if name not in state:
                    bad.append(f"{name}: not a parameter of {type(model).__name__}")
                    continue
                have = state[name].detach().cpu().float()
                if have.shape != want.shape or not torch.equal(have, want):
                    untransposed = expert and have.shape == t.shape and torch.equal(have, t)
                    bad.append(f"{name}: differs" + (" (loaded without the layout transpose)" if untransposed else ""))
    tied = model.config.tie_word_embeddings or getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    missing = [n for n in state if n not in index and not (tied and n == "lm_head.weight")]
    check("weights as loaded equal the files", not bad and not missing,
          f"{len(index)} tensors" if not bad and not missing else "; ".join((bad + [f"{n}: not in the files"
                                                                                 for n in missing])[:8]))

    # 3. Logits and loss against q3vl eval.
    with h5py.File(a.batch, "r") as f:
        batch = {k: torch.from_numpy(f[k][()]) for k in f.keys()}
    if "mm_token_type_ids" not in batch:  # 1 at image pads, 2 at video pads (spec 11)
        ids = batch["input_ids"]
        batch["mm_token_type_ids"] = (ids == model.config.image_token_id).long() + \
            2 * (ids == model.config.video_token_id).long()
    with torch.no_grad():
        out = model(**{k: v.to(a.device) for k, v in batch.items()}, use_cache=False)
    with h5py.File(a.eval, "r") as f:
        want_logits, want_loss = f["logits"][()], float(f["loss"][()])
    got = out.logits.float().cpu().numpy()
    mask = batch["attention_mask"].numpy().astype(bool) if "attention_mask" in batch else np.ones(got.shape[:2], bool)
    if got.shape != want_logits.shape:
        check("logits equal q3vl eval", False, f"shape {got.shape} vs {want_logits.shape}")
    else:
        diff = float(np.abs(got[mask] - want_logits[mask]).max())
        scale = max(1.0, float(np.abs(want_logits[mask]).max()))
        check("logits equal q3vl eval", diff <= a.tol * scale, f"max |difference| {diff:.3g} (scale {scale:.3g})")
    loss = float(out.loss)
    check("loss equals q3vl eval", abs(loss - want_loss) <= 1e-4 * max(1.0, abs(want_loss)),
          f"transformers {loss:.8f}, q3vl {want_loss:.8f}")

    # 4. Chat template.
    if a.chat:
        cases = [c for c in json.load(open(a.chat))["cases"] if "messages" in c.get("record", {})]
        wrong = [c["name"] for c in cases if tok.apply_chat_template(c["record"]["messages"], tokenize=False) != c["text"]]
        check("chat template", not wrong and cases, f"{len(cases)} cases" if not wrong else f"differs on {wrong}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
