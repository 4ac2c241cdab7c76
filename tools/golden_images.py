#!/usr/bin/python3
"""Make the test images and goldens for tests/unit/test_image.cpp.

Run from the repository root:   /usr/bin/python3 tools/golden_images.py [OUT_DIR]   (needs PIL, numpy, h5py)

Writes into tests/data/images/:
  *.png, *.jpg    test inputs: sizes from 1x1 to 300x40, prime sides, every PNG colour type and bit depth,
                  interlaced PNGs, palette with tRNS, JPEG (4:2:0, progressive, grey, CMYK), broken files
  golden.json     what PIL / transformers said: decoded sizes and modes, smart_resize table, resized sizes,
                  grids, token counts, and which source made each golden
  golden.h5       gzip arrays: decoded RGB, PIL-resized uint8, pixel_values (or sampled rows of them)

Goldens for the full preprocessing come from transformers' slow, PIL-based Qwen2-VL image processor
(Qwen2VLImageProcessorPil in transformers 5, Qwen2VLImageProcessor in 4.x) when transformers is importable;
otherwise from PIL plus the transcription below of what that processor does. golden.json records which.
"""
import io
import json
import math
import os
import re
import struct
import sys
import zlib

import h5py
import numpy as np
import PIL
from PIL import Image

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join("tests", "data", "images")  # optional: another dir
MEAN = STD = [0.5, 0.5, 0.5]
PATCH, TEMPORAL, MERGE = 16, 2, 2
DEFAULT_MIN, DEFAULT_MAX = 65536, 16777216

try:
    import transformers
except ImportError:
    transformers = None

rng = np.random.RandomState(20240917)


# ---- a tiny PNG writer for what PIL cannot write (2/4/16-bit grey, 16-bit colour, Adam7) ----

def _pack_row(samples, bit_depth):
    """samples: 1-D integer array of one row's samples -> packed bytes (big-endian, MSB first)."""
    if bit_depth == 16:
        return samples.astype(">u2").tobytes()
    if bit_depth == 8:
        return samples.astype(np.uint8).tobytes()
    per_byte = 8 // bit_depth
    pad = (-len(samples)) % per_byte
    s = np.concatenate([samples, np.zeros(pad, samples.dtype)]).reshape(-1, per_byte).astype(np.uint16)
    shifts = np.array([8 - bit_depth * (i + 1) for i in range(per_byte)], np.uint16)
    return (s << shifts).sum(axis=1).astype(np.uint8).tobytes()


def _chunk(tag, data):
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def raw_png(path, samples, color_type, bit_depth, palette=None, trns=None, interlace=False):
    """samples: (h, w, channels) integers. Filter type 0 on every row."""
    h, w, _ = samples.shape
    passes = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]
    raw = b""
    for x0, y0, dx, dy in (passes if interlace else [(0, 0, 1, 1)]):
        sub = samples[y0::dy, x0::dx]
        if sub.size == 0:
            continue
        for row in sub:
            raw += b"\x00" + _pack_row(row.reshape(-1), bit_depth)
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0,
                                                              1 if interlace else 0))
    if palette is not None:
        png += _chunk(b"PLTE", bytes(np.asarray(palette, np.uint8).reshape(-1)))
    if trns is not None:
        png += _chunk(b"tRNS", trns)
    png += _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


# ---- test images ----

def pattern(w, h, noise=0):
    """Smooth colour waves with sharp edges; `noise` adds that much uniform noise (compresses worse)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 127.5 + 127.5 * np.sin(x / 3.1 + y / 7.3)
    g = 127.5 + 127.5 * np.cos(x / 5.7 - y / 2.9)
    b = np.where((x // 4 + y // 3) % 2 == 0, 250.0, 10.0)
    im = np.stack([r, g, b], -1)
    if noise:
        im += rng.uniform(-noise, noise, im.shape)
    return np.clip(np.rint(im), 0, 255).astype(np.uint8)


def make_images():
    """Writes every input image; returns the list of decodable file names."""
    files = []

    def save(name, im, **kw):
        im.save(os.path.join(OUT, name), **kw)
        files.append(name)

    def raw(name, *a, **kw):
        raw_png(os.path.join(OUT, name), *a, **kw)
        files.append(name)

    save("rgb8_37x23.png", Image.fromarray(rng.randint(0, 256, (23, 37, 3), dtype=np.uint8)))
    save("rgb8_64x48.png", Image.fromarray(pattern(64, 48, noise=20)))
    y, x = np.mgrid[0:61, 0:97]
    checker = np.where(((x + y) % 2 == 0)[..., None], [255, 255, 255], [0, 0, 0]).astype(np.uint8)
    checker[::7] = [255, 0, 0]
    checker[:, ::5] = [0, 0, 255]
    save("checker_97x61.png", Image.fromarray(checker))
    save("wide_300x40.png", Image.fromarray(pattern(300, 40)))
    save("tall_29x211.png", Image.fromarray(pattern(29, 211)))
    save("tiny_3x5.png", Image.fromarray(rng.randint(0, 256, (5, 3, 3), dtype=np.uint8)))
    save("one_1x1.png", Image.fromarray(np.array([[[200, 30, 90]]], np.uint8)))
    save("gray8_45x33.png", Image.fromarray(pattern(45, 33, noise=30)[..., 1]))
    save("gray1_19x13.png", Image.fromarray(rng.randint(0, 2, (13, 19)).astype(bool)))
    raw("gray2_21x11.png", rng.randint(0, 4, (11, 21, 1)), 0, 2)
    raw("gray4_17x9.png", rng.randint(0, 16, (9, 17, 1)), 0, 4)
    g16 = rng.randint(0, 65536, (15, 23, 1))
    g16[::2, ::3] = rng.randint(0, 256, g16[::2, ::3].shape)  # some values below 256, kept as is by PIL
    raw("gray16_23x15.png", g16, 0, 16)
    save("ga8_20x14.png", Image.fromarray(rng.randint(0, 256, (14, 20, 2), dtype=np.uint8), "LA"))
    raw("ga16_13x7.png", rng.randint(0, 65536, (7, 13, 2)), 4, 16)
    save("rgba8_33x27.png", Image.fromarray(rng.randint(0, 256, (27, 33, 4), dtype=np.uint8), "RGBA"))
    raw("rgb16_19x17.png", rng.randint(0, 65536, (17, 19, 3)), 2, 16)
    raw("rgba16_11x13.png", rng.randint(0, 65536, (13, 11, 4)), 6, 16)
    pal = Image.fromarray(pattern(40, 30)).quantize(colors=50)
    pal.info["transparency"] = 3
    save("pal8_40x30_trns.png", pal, transparency=3)
    raw("pal4_25x19.png", rng.randint(0, 16, (19, 25, 1)), 3, 4, palette=rng.randint(0, 256, (16, 3)),
        trns=bytes([0, 128, 255]))
    raw("rgb8_interlaced_37x29.png", pattern(37, 29, noise=40), 2, 8, interlace=True)
    raw("pal2_interlaced_9x7.png", rng.randint(0, 4, (7, 9, 1)), 3, 2, palette=rng.randint(0, 256, (4, 3)),
        interlace=True)
    raw("rgb8_trns_8x6.png", rng.randint(0, 256, (6, 8, 3)), 2, 8, trns=struct.pack(">HHH", 10, 20, 30))
    photo = Image.fromarray(pattern(64, 48, noise=25))
    save("photo_q90_64x48.jpg", photo, quality=90)
    save("photo_prog_50x38.jpg", Image.fromarray(pattern(50, 38, noise=25)), quality=85, progressive=True)
    save("photo_444_31x17.jpg", Image.fromarray(pattern(31, 17, noise=25)), quality=95, subsampling=0)
    save("gray_40x24.jpg", Image.fromarray(pattern(40, 24, noise=25)[..., 0]), quality=90)
    save("cmyk_24x16.jpg", Image.fromarray(pattern(24, 16, noise=25)).convert("CMYK"), quality=90)
    return files


def make_broken():
    """Broken files; returns [(name, kind)]. The C++ decoder must refuse each one."""
    out = []

    def put(name, kind, data):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
        out.append((name, kind))

    png = open(os.path.join(OUT, "rgb8_37x23.png"), "rb").read()
    jpg = open(os.path.join(OUT, "photo_q90_64x48.jpg"), "rb").read()
    put("bad_truncated.png", "truncated", png[: len(png) // 2])
    put("bad_truncated.jpg", "truncated", jpg[: len(jpg) // 2])
    bad_crc = bytearray(png)
    bad_crc[29] ^= 0xFF  # last byte of the IHDR CRC
    put("bad_crc.png", "corrupt", bytes(bad_crc))
    bad_jpg = bytearray(jpg)
    sof = bad_jpg.find(b"\xff\xc0")
    bad_jpg[sof + 9] = 7  # 7 colour components: neither PIL nor libjpeg reads it
    put("bad_components.jpg", "corrupt", bytes(bad_jpg))
    put("bad_format.gif", "unsupported", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;")
    put("bad_empty.png", "empty", b"")
    return out


# ---- the reference pipeline ----

def smart_resize_py(h, w, factor=32, min_pixels=DEFAULT_MIN, max_pixels=DEFAULT_MAX):
    """transformers' smart_resize (models/qwen2_vl/image_processing_qwen2_vl.py, v4.5x/v5)."""
    if max(h, w) / min(h, w) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = round(h / factor) * factor
    w_bar = round(w / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((h * w) / max_pixels)
        h_bar = max(factor, math.floor(h / beta / factor) * factor)
        w_bar = max(factor, math.floor(w / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        h_bar = math.ceil(h * beta / factor) * factor
        w_bar = math.ceil(w * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_ref():
    if transformers is not None:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        return smart_resize, "transformers %s smart_resize" % transformers.__version__
    return smart_resize_py, "python transcription of transformers' smart_resize"


def patchify_py(chw):
    """(3, H, W) float32 -> [Np, 1536], as the processor does (frame repeated to temporal_patch)."""
    c, h, w = chw.shape
    frames = np.repeat(chw[None], TEMPORAL, axis=0)
    gh, gw = h // PATCH, w // PATCH
    p = frames.reshape(1, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    p = p.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return p.reshape(gh * gw, c * TEMPORAL * PATCH * PATCH), (1, gh, gw)


def preprocess_py(img, min_pixels, max_pixels):
    rgb = img.convert("RGB")
    rh, rw = smart_resize_py(rgb.height, rgb.width, PATCH * MERGE, min_pixels, max_pixels)
    resized = np.array(rgb.resize((rw, rh), Image.BICUBIC))
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    pv, grid = patchify_py(x.transpose(2, 0, 1))
    return pv, grid, resized


def hf_processor(min_pixels, max_pixels):
    kw = dict(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE, image_mean=MEAN,
              image_std=STD, do_convert_rgb=True, resample=Image.BICUBIC)
    try:  # transformers 5: the PIL backend has its own class
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **kw)
    except ImportError:  # transformers 4.x: the slow processor is the PIL one
        from transformers import Qwen2VLImageProcessor
        return Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, **kw)


def unpatchify_frame0(pv, grid):
    """pixel_values -> the uint8 image of temporal frame 0 (undoes normalisation; exact for 8-bit input)."""
    _, gh, gw = grid
    p = pv.reshape(gh // MERGE, gw // MERGE, MERGE, MERGE, 3, TEMPORAL, PATCH, PATCH)[:, :, :, :, :, 0]
    chw = p.transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * PATCH, gw * PATCH)
    x = (chw * np.array(STD)[:, None, None] + np.array(MEAN)[:, None, None]) * 255
    assert np.abs(x - np.rint(x)).max() < 1e-3
    return np.rint(x).astype(np.uint8).transpose(1, 2, 0)


def preprocess_ref(img, min_pixels, max_pixels):
    """-> pixel_values, grid, resized uint8, source, max |transformers - transcription| (or None)."""
    pv_py, grid_py, resized_py = preprocess_py(img, min_pixels, max_pixels)
    if transformers is None:
        return pv_py, grid_py, resized_py, "PIL %s + python transcription" % PIL.__version__, None
    proc = hf_processor(min_pixels, max_pixels)
    out = proc(images=[img], return_tensors="np")
    pv = np.asarray(out["pixel_values"], np.float32)
    grid = tuple(int(v) for v in np.asarray(out["image_grid_thw"])[0])
    resized = unpatchify_frame0(pv, grid)
    diff = float(np.abs(pv - pv_py).max()) if pv.shape == pv_py.shape else float("inf")
    src = "transformers %s %s (PIL %s)" % (transformers.__version__, type(proc).__name__, PIL.__version__)
    return pv, grid, resized, src, diff


# ---- golden tables ----

def smart_resize_cases():
    fn, src = smart_resize_ref()
    cfgs = [(32, DEFAULT_MIN, DEFAULT_MAX), (32, 1024, 4096), (32, 4096, 1 << 20), (28, 3136, 1003520)]
    sizes = [(1, 1), (1, 2), (2, 1), (1, 200), (200, 1), (1, 201), (3, 601), (5, 1000), (10, 2001), (16, 16),
             (48, 48), (80, 80), (112, 144), (16, 48), (47, 49), (33, 31), (15, 3000), (32, 32), (256, 256),
             (255, 257), (1000, 1000), (4096, 4096), (4097, 4095), (20000, 30000), (40000, 200), (200, 40000),
             (99, 19800), (7, 1401), (2160, 3840), (1080, 1920), (3024, 4032), (512, 511), (80, 16), (16, 80)]
    sizes += [(int(a), int(b)) for a, b in rng.randint(1, 5000, (120, 2))]
    sizes += [(int(a), int(b)) for a, b in rng.randint(1, 300, (60, 2))]
    cases = []
    for factor, mn, mx in cfgs:
        for h, w in sizes:
            try:
                rh, rw = fn(h, w, factor=factor, min_pixels=mn, max_pixels=mx)
            except ValueError:
                rh = rw = -1
            cases.append([h, w, factor, mn, mx, int(rh), int(rw)])
    return {"source": src, "cases": cases}


def main():
    os.makedirs(OUT, exist_ok=True)
    files = make_images()
    broken = make_broken()
    h5 = h5py.File(os.path.join(OUT, "golden.h5"), "w", libver=("earliest", "v110"))  # HDF5 1.10 reads it

    def put(name, arr):
        if len(zlib.compress(arr.tobytes(), 9)) + 3000 > arr.nbytes:  # a chunk index costs about 3 KB
            h5.create_dataset(name, data=arr)
        else:
            h5.create_dataset(name, data=arr, chunks=arr.shape, compression="gzip", compression_opts=9,
                              shuffle=True)
        return name

    golden = {"generator": "tools/golden_images.py", "pillow": PIL.__version__, "numpy": np.__version__,
              "transformers": transformers.__version__ if transformers else None}

    golden["decode"] = []
    for f in files:
        im = Image.open(os.path.join(OUT, f))
        mode = im.mode
        rgb = np.array(im.convert("RGB"))  # what transformers' convert_to_rgb does
        golden["decode"].append({"file": f, "pil_mode": mode, "w": im.width, "h": im.height,
                                 "rgb": put("decode/" + f, rgb)})

    golden["broken"] = []
    for f, kind in broken:
        try:
            Image.open(os.path.join(OUT, f)).convert("RGB")
            pil = "PIL read it"
        except Exception as e:  # noqa: BLE001 - any refusal is what we record
            pil = "%s: %s" % (type(e).__name__, str(e).replace(OUT + os.sep, ""))
        golden["broken"].append({"file": f, "kind": kind, "pil": pil})

    # Direct PIL resizes: up, down, one axis only, to 1x1, far down.
    golden["resize"] = []
    for f, w, h in [("rgb8_37x23.png", 50, 3), ("rgb8_37x23.png", 13, 7), ("rgb8_37x23.png", 37, 60),
                    ("rgb8_37x23.png", 80, 23), ("rgb8_37x23.png", 1, 1), ("rgb8_37x23.png", 90, 55),
                    ("checker_97x61.png", 32, 19), ("checker_97x61.png", 9, 5), ("wide_300x40.png", 64, 9),
                    ("tall_29x211.png", 7, 300), ("photo_q90_64x48.jpg", 33, 25), ("tiny_3x5.png", 2, 64),
                    ("one_1x1.png", 5, 3), ("gray16_23x15.png", 40, 11)]:
        out = np.array(Image.open(os.path.join(OUT, f)).convert("RGB").resize((w, h), Image.BICUBIC))
        golden["resize"].append({"file": f, "w": w, "h": h, "rgb": put("resize/%s_%dx%d" % (f, w, h), out)})

    # Full preprocessing. Small pixel budgets keep the goldens small; a few cases use the released defaults.
    small = (1024, 4096)
    cases = [("rgb8_37x23.png", small, True), ("rgb8_64x48.png", (1024, 8192), False),
             ("checker_97x61.png", (1024, 2048), True), ("wide_300x40.png", small, False),
             ("tall_29x211.png", (1024, 16384), False), ("gray16_23x15.png", small, True),
             ("pal4_25x19.png", small, False), ("rgba8_33x27.png", small, False), ("ga16_13x7.png", small, False),
             ("rgb8_interlaced_37x29.png", small, False), ("photo_q90_64x48.jpg", (1024, 3072), False),
             ("cmyk_24x16.jpg", small, False), ("gray_40x24.jpg", small, False),
             ("tiny_3x5.png", (DEFAULT_MIN, DEFAULT_MAX), False), ("one_1x1.png", (DEFAULT_MIN, DEFAULT_MAX), False),
             ("rgb8_37x23.png", (DEFAULT_MIN, DEFAULT_MAX), False)]
    golden["preprocess"] = []
    for i, (f, (mn, mx), full) in enumerate(cases):
        pv, grid, resized, src, diff = preprocess_ref(Image.open(os.path.join(OUT, f)), mn, mx)
        e = {"file": f, "min_pixels": mn, "max_pixels": mx, "resized_h": int(resized.shape[0]),
             "resized_w": int(resized.shape[1]), "grid": list(grid), "tokens": int(pv.shape[0] // (MERGE * MERGE)),
             "source": src}
        if resized.shape[0] * resized.shape[1] <= 8192:  # larger ones are checked through pv_sampled
            e["resized"] = put("pre/%d/resized" % i, resized)
        if diff is not None:
            e["transcription_max_abs_diff"] = diff
        if full:
            e["pixel_values"] = put("pre/%d/pixel_values" % i, pv)
        else:  # the last row; first, last and one between when the resized image is not stored
            n = pv.shape[0]
            rows = [n - 1] if "resized" in e else sorted({0, n - 1, int(rng.randint(0, n))})
            e["pv_rows"] = rows
            e["pv_sampled"] = put("pre/%d/pv_sampled" % i, pv[rows])
        golden["preprocess"].append(e)

    golden["smart_resize"] = smart_resize_cases()
    h5.close()
    text = json.dumps(golden, indent=1)
    text = re.sub(r"\[[-\d,\s]+\]", lambda m: "[" + ", ".join(m.group(0)[1:-1].split()).replace(",,", ",") + "]",
                  text)  # one line per list of numbers
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        f.write(text + "\n")
    total = sum(os.path.getsize(os.path.join(OUT, n)) for n in os.listdir(OUT))
    print("wrote %d images, %d broken files, goldens from %s; %s total %.0f KB" % (
        len(files), len(broken), golden["preprocess"][0]["source"], OUT, total / 1024), file=sys.stderr)


if __name__ == "__main__":
    main()
