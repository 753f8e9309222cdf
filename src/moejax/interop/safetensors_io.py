"""A minimal safetensors reader/writer on NumPy + ml_dtypes.

The format is an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then raw little-endian bytes. Reading through
``np.memmap`` keeps large checkpoints off the heap until a tensor is used, and ml_dtypes
gives NumPy the BF16/FP8 types that safetensors' own NumPy backend cannot decode.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file, as read-only memory-mapped arrays."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    (header_len,) = struct.unpack("<Q", raw[:8].tobytes())
    header = json.loads(raw[8:8 + header_len].tobytes())
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        flat = raw[base + start:base + end].view(_DTYPES[info["dtype"]])
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes tensors (C order, little-endian) to one safetensors file."""
    header: dict[str, dict] = {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}, not storable")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())
