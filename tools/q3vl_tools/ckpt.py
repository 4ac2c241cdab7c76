"""Reading q3vl HDF5 checkpoints (include/q3vl/io/checkpoint.hpp): root attributes format "q3vl-checkpoint",
format_version, step, tokens_seen, world_size, deck, state_json, build and hf_config_json (the model's
config.json; absent in older checkpoints); datasets model/<hf name>, optim/exp_avg/<hf name>,
optim/exp_avg_sq/<hf name> (fp32, full shape, MoE experts in the compute layout gate_up [E,2Im,H] /
down [E,H,Im]), each with a uint64 attribute "checksum"."""
import os
import re
import tomllib

import h5py
import numpy as np

from . import ToolError

FORMAT = "q3vl-checkpoint"
ATTRS = ["format", "format_version", "step", "tokens_seen", "world_size", "deck", "state_json", "build"]  # required
MOMENTS = ["optim/exp_avg/", "optim/exp_avg_sq/"]
CHUNK = 1 << 24  # elements read at a time


def open_checkpoint(path):
    """The open h5py.File of a q3vl checkpoint, or ToolError saying why it is not one."""
    if not os.path.isfile(path):
        raise ToolError(f"{path}: no such file")
    if not h5py.is_hdf5(path):
        raise ToolError(f"{path}: not an HDF5 file (not a checkpoint)")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise ToolError(f"{path}: damaged or truncated HDF5 file ({e})")
    fmt = attr(f, "format")
    if fmt != FORMAT:
        f.close()
        raise ToolError(f"{path}: not a q3vl checkpoint (root attribute format is {fmt!r}, not {FORMAT!r})")
    return f


def attr(f, name):
    """A root attribute as int or str, or None if absent."""
    if name not in f.attrs:
        return None
    v = f.attrs[name]
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.integer):
        return int(v)
    return v


def datasets(f):
    """Names of every dataset in the file, in order."""
    out = []
    f.visititems(lambda name, obj: out.append(name) if isinstance(obj, h5py.Dataset) else None)
    return out


def deck_of(f):
    """The resolved deck (a dict), or None if it does not parse."""
    try:
        return tomllib.loads(attr(f, "deck") or "")
    except tomllib.TOMLDecodeError:
        return None


def part(hf_name):
    """Which train.tune_* flag covers a tensor (params.cpp: the main merger is its own part)."""
    if hf_name.startswith("model.visual.merger."):
        return "tune_merger"
    return "tune_vision" if hf_name.startswith("model.visual.") else "tune_llm"


def trainable(deck, hf_name):
    if (deck or {}).get("lora", {}).get("rank", 0) > 0:  # LoRA: the adapters only, whatever train.tune_* say
        return ".lora_A." in hf_name or ".lora_B." in hf_name
    return bool((deck or {}).get("train", {}).get(part(hf_name), True))


def mix64(x):
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def chunks(ds):
    """(flat begin, fp32 values) of a dataset, in row-major pieces of about CHUNK elements."""
    if ds.shape == ():
        yield 0, np.asarray(ds[()], dtype=np.float32).reshape(1)
        return
    row = int(np.prod(ds.shape[1:], dtype=np.int64))
    rows = max(1, CHUNK // max(row, 1))
    for r in range(0, ds.shape[0], rows):
        yield r * row, np.asarray(ds[r:r + rows], dtype=np.float32).ravel()


def checksum(flat, begin=0):
    """checkpoint.cpp's checksum of fp32 elements [begin, begin + flat.size): the sum of
    mix64(mix64(flat index) + fp32 bits), mod 2^64."""
    total = 0
    with np.errstate(over="ignore"):
        for b in range(0, flat.size, CHUNK):
            v = flat[b:b + CHUNK]
            idx = np.arange(begin + b, begin + b + v.size, dtype=np.uint64)
            total += int(np.sum(mix64(mix64(idx) + v.view(np.uint32).astype(np.uint64)), dtype=np.uint64))
    return total % (1 << 64)


def scan(ds):
    """One pass over a dataset: (L2 norm, count of NaN, count of Inf, checksum)."""
    sq, nans, infs, total = 0.0, 0, 0, 0
    for begin, v in chunks(ds):
        finite = np.isfinite(v)
        nan = int(np.isnan(v).sum())
        nans, infs = nans + nan, infs + int((~finite).sum()) - nan
        sq += float(np.dot(v[finite].astype(np.float64), v[finite].astype(np.float64)))
        total += checksum(v, begin)
    return sq ** 0.5, nans, infs, total % (1 << 64)


def stored_problem(ds, file_size):
    """Why a dataset's bytes are not all in the file ("" if they are)."""
    n = int(np.prod(ds.shape, dtype=np.int64))
    stored = ds.id.get_storage_size()
    off = ds.id.get_offset()
    if stored != n * ds.dtype.itemsize or (n and (off is None or off + stored > file_size)):
        return "is not fully stored in the file (truncated?)"
    return ""


def step_from_name(path):
    m = re.fullmatch(r"step_(\d+)\.h5", os.path.basename(path))
    return int(m.group(1)) if m else None
