"""Safetensors by hand: 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw little-endian data
(offsets relative to the start of the data). Reads one file or a directory (model.safetensors, or the shards
named by model.safetensors.index.json); writes a sharded directory with its index."""
import json
import os
import struct

import numpy as np

from . import ToolError

# Stored dtype name -> numpy dtype; BF16 is kept as its raw uint16 bits.
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "BOOL": "?"}


class Entry:
    def __init__(self, name, dtype, shape, file, offset, nbytes):
        self.name, self.dtype, self.shape = name, dtype, shape
        self.file, self.offset, self.nbytes = file, offset, nbytes

    def raw(self):
        """The stored values as numpy (BF16 as uint16 bits)."""
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.nbytes)
        if len(data) != self.nbytes:
            raise ToolError(f"{self.file}: tensor {self.name} is truncated")
        return np.frombuffer(data, dtype=DTYPES[self.dtype]).reshape(self.shape)

    def f32(self):
        a = self.raw()
        if self.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)


def read_header(path):
    """{name: Entry} of one file; every tensor's bytes must lie inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ToolError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ToolError(f"{path}: not a safetensors file (header length {n} exceeds the file)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ToolError(f"{path}: not a safetensors file (header is not JSON)")
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t.get("dtype") not in DTYPES:
            raise ToolError(f"{path}: tensor {name}: unsupported dtype {t.get('dtype')}")
        b, e = t["data_offsets"]
        if 8 + n + e > size:
            raise ToolError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
        count = int(np.prod(t["shape"], dtype=np.int64))
        if e - b != count * np.dtype(DTYPES[t["dtype"]]).itemsize:
            raise ToolError(f"{path}: tensor {name}: {e - b} bytes for shape {t['shape']} {t['dtype']}")
        out[name] = Entry(name, t["dtype"], list(t["shape"]), path, 8 + n + b, e - b)
    return out


def open_dir(path):
    """{name: Entry} of a safetensors file or a HF model directory."""
    if os.path.isfile(path):
        return read_header(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError):
            raise ToolError(f"{index}: not a safetensors index (no weight_map)")
        out = {}
        for shard in sorted(set(weight_map.values())):
            entries = read_header(os.path.join(path, shard))
            for name, e in entries.items():
                if weight_map.get(name) != shard:
                    raise ToolError(f"{index}: tensor {name} is in {shard} but the index says {weight_map.get(name)}")
            out.update(entries)
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise ToolError(f"{index}: {len(missing)} tensor(s) named in the index are in no shard, e.g. {missing[0]}")
        return out
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return read_header(single)
    raise ToolError(f"{path}: no model.safetensors or model.safetensors.index.json")


def to_bf16_bits(a):
    """fp32 -> bf16 bits, round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def write_file(path, tensors, dtype):
    """One safetensors file of (name, shape, callable returning the fp32 array), stored as dtype "F32" or "BF16";
    returns the bytes of tensor data."""
    size = 4 if dtype == "F32" else 2
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape, get in tensors:
            a = np.asarray(get(), dtype=np.float32)
            if list(a.shape) != list(shape):
                raise ToolError(f"tensor {name}: shape {list(a.shape)}, expected {list(shape)}")
            f.write((to_bf16_bits(a) if dtype == "BF16" else a.astype("<f4")).tobytes())
    return off


def write_sharded(out_dir, tensors, dtype, shard_bytes):
    """Writes tensors as model-0000i-of-0000n.safetensors (stored as dtype "F32" or "BF16", at most
    shard_bytes of data each unless one tensor is larger) and model.safetensors.index.json. `tensors` is a
    list of (name, shape, callable returning the fp32 array): only one tensor is in memory at a time."""
    size = 4 if dtype == "F32" else 2
    shards, cur, cur_bytes = [], [], 0
    for name, shape, get in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * size
        if cur and cur_bytes + nbytes > shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape, get, nbytes))
        cur_bytes += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_file(os.path.join(out_dir, fname), [(n, s, g) for n, s, g, _ in shard], dtype)
        weight_map.update({name: fname for name, _, _, _ in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")
    return len(shards)
