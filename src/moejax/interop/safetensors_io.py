"""A minimal safetensors reader/writer on NumPy + ml_dtypes.

The format is an 8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, then raw little-endian bytes. Reading through
``np.memmap`` keeps large checkpoints off the heap until a tensor is used, and ml_dtypes
gives NumPy the BF16/FP8 types that safetensors' own NumPy backend cannot decode.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from moejax.atomic_file import atomic_writer

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _header(raw: np.ndarray, path: str | Path) -> tuple[dict, int]:
    """The JSON header and the offset of the data after it, checked against the file size."""
    (header_len,) = struct.unpack("<Q", raw[:8].tobytes())
    if 8 + header_len > raw.size:
        raise ValueError(f"{path}: the header needs bytes [8, {8 + header_len}), the file has "
                         f"{raw.size}; is it truncated?")
    return json.loads(raw[8:8 + header_len].tobytes()), 8 + header_len


def _check_extent(path: str | Path, name: str, info: dict, data_size: int) -> None:
    """A tensor's data_offsets must hold exactly its shape's bytes, inside the file."""
    start, end = info["data_offsets"]
    needed = math.prod(info["shape"]) * _DTYPES[info["dtype"]].itemsize
    if end - start != needed:
        raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {info['shape']}) needs "
                         f"{needed} bytes, its data_offsets [{start}, {end}] hold {end - start}")
    if not 0 <= start <= end <= data_size:
        raise ValueError(f"{path}: tensor {name!r} needs data bytes [{start}, {end}), the file "
                         f"has {data_size} data bytes; is it truncated?")


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file, as read-only memory-mapped arrays."""
    size = Path(path).stat().st_size
    if size < 8:  # np.memmap refuses an empty file naming nothing
        raise ValueError(f"{path}: {size} bytes, too short for the 8-byte header length")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    header, base = _header(raw, path)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        _check_extent(path, name, info, raw.size - base)
        start, end = info["data_offsets"]
        flat = raw[base + start:base + end].view(_DTYPES[info["dtype"]])
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes tensors (C order, little-endian) to one safetensors file, atomically."""
    header: dict[str, dict] = {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        array = np.asarray(tensors[name], order="C")  # ascontiguousarray makes 0-d arrays 1-d
        if array.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}, not storable")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    with atomic_writer(path) as f:  # a crash mid-write keeps the previous file whole
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())
