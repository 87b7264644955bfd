"""Write one safetensors file a tensor at a time.

``safetensors.torch.save_file`` takes every tensor of the file at once and copies each into a bytes
object before writing, so a file of N bytes costs about 2N of memory. The format is simple enough
to stream instead (https://github.com/huggingface/safetensors#format): an 8-byte little-endian
header length, a JSON header giving each tensor's dtype, shape and byte range, padded with spaces
to a multiple of 8 bytes, then the tensors' bytes in that order. The header needs only shapes and
dtypes, so each tensor is produced, written and released in turn.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Callable

import torch

Spec = tuple[tuple[int, ...], torch.dtype]

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def tensor_bytes(spec: Spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def write_safetensors(path: Path, specs: dict[str, Spec], produce: Callable[[str], torch.Tensor],
                      metadata: dict[str, str]) -> None:
    """Write the tensors ``specs`` names, in that order, calling ``produce(name)`` for each just before
    its bytes are written; a produced tensor must have the shape and dtype of its spec."""
    assert sys.byteorder == "little", "safetensors stores little-endian bytes"
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, (shape, dtype) in specs.items():
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: safetensors has no dtype {dtype}")
        size = tensor_bytes((shape, dtype))
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, (shape, dtype) in specs.items():
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {tuple(shape)} {dtype}")
            f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
