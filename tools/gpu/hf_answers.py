#!/usr/bin/env python3
"""Greedy answers of a tools/export_hf directory loaded by transformers with no settings of ours (processor, chat
template, pixel bounds and generation config all from the directory), for the prompts of a training-data JSONL, and
their agreement with q3vl's answers for the same directory (`q3vl generate model.hf=DIR`).

  python3 tools/gpu/hf_answers.py DIR EVAL.jsonl Q3VL_ANSWERS.jsonl OUT.jsonl [--dtype auto|float32]

Prints one line: how many answers are equal, and the first differences. Exit 1 when any differs.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from PIL import Image


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("eval")
    p.add_argument("q3vl")
    p.add_argument("out")
    p.add_argument("--dtype", default="auto", help="from_pretrained's dtype (auto: the directory's)")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kw = {} if a.dtype == "auto" else {"dtype": getattr(torch, a.dtype)}
    model = transformers.AutoModelForImageTextToText.from_pretrained(a.model_dir, **kw).to(dev).eval()
    proc = transformers.AutoProcessor.from_pretrained(a.model_dir)
    folder = os.path.dirname(a.eval)
    recs = [json.loads(l) for l in open(a.eval) if l.strip()]
    ours = {r["line"]: r["answer"] for r in map(json.loads, open(a.q3vl))}
    same, diffs = 0, []
    with open(a.out, "w") as f:
        for i, rec in enumerate(recs, 1):
            user = next(m for m in rec["messages"] if m["role"] == "user")
            content, images = [], []
            for part in user["content"]:
                if part["type"] == "image":
                    images.append(Image.open(os.path.join(folder, part["image"])).convert("RGB"))
                    content.append({"type": "image"})
                else:
                    content.append({"type": "text", "text": part["text"]})
            text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            inputs = proc(text=[text], images=images or None, return_tensors="pt").to(dev)
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
            answer = proc.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)[0]
            f.write(json.dumps({"line": i, "answer": answer}) + "\n")
            if answer == ours[i]:
                same += 1
            else:
                diffs.append((i, answer, ours[i]))
    print(f"transformers {transformers.__version__} ({model.dtype}, {dev}): {same}/{len(recs)} answers equal q3vl's"
          + "".join(f"; line {i}: {h!r} vs q3vl {q!r}" for i, h, q in diffs[:5]))
    return 0 if not diffs else 1


if __name__ == "__main__":
    sys.exit(main())
