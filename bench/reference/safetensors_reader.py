"""A safetensors reader written from the format's specification
(huggingface/safetensors, "Format"), so that the references read Hugging
Face directories without the safetensors package or shardtrain's code.

The format: an 8-byte little-endian header length N, N bytes of JSON
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{str: str}}), then the data buffer the offsets index, with no holes.
"""

from __future__ import annotations

import json
import struct
from typing import Dict, Tuple

import numpy as np

DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"),
          "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
          "U8": np.dtype("u1")}


def read_safetensors(path: str) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Every tensor of `path` as float32 (BF16 widened exactly) and the
    header's metadata. ValueError naming the file when it breaks the
    format."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError(f"{path}: header of {n} bytes past the end")
    header = blob[8:8 + n]
    if not header.startswith(b"{"):
        raise ValueError(f"{path}: header does not start with '{{'")
    entries = json.loads(header.decode("utf-8"))
    data = blob[8 + n:]
    metadata = entries.pop("__metadata__", {})
    tensors, covered = {}, []
    for name, e in entries.items():
        if e["dtype"] not in DTYPES:
            raise ValueError(f"{path}: {name}: dtype {e['dtype']} is not read")
        dtype = DTYPES[e["dtype"]]
        begin, end = e["data_offsets"]
        count = int(np.prod(e["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize or end > len(data):
            raise ValueError(f"{path}: {name}: offsets {begin}..{end} do not "
                             f"hold {e['shape']} of {e['dtype']}")
        raw = np.frombuffer(data[begin:end], dtype=dtype)
        if e["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = raw.reshape(e["shape"]).astype(np.float32)
        covered.append((begin, end))
    position = 0
    for begin, end in sorted(covered):
        if begin != position:
            raise ValueError(f"{path}: a hole or overlap at byte {begin}")
        position = end
    if position != len(data):
        raise ValueError(f"{path}: {len(data) - position} bytes after the tensors")
    return tensors, metadata
