"""Pretrained weights read shard by shard: each rank reads only the bytes of the slices it holds.

Under ``empty_parameters()`` (``empty_init.py``), a Hugging Face ``from_pretrained`` of a folder of
safetensors files (one file, or shards with their ``model.safetensors.index.json``) builds the
model as usual (config, dtype, attention implementation, tied weights, weight renamings) but reads
no tensor that lands unchanged in a parameter: each such parameter records *where* its value is
(``SafetensorsTensor``: file, byte offset, dtype, shape) and is read once the model is split, for
the rows or columns of this rank's shard only (``read_shard``). Tensors that transformers converts
on loading (experts stored one per file entry and fused in the module, or the reverse) and
persistent buffers are read whole by transformers' own loader, as one device would read them.
Peak host memory per rank is then its share of the model plus the largest tensor it converts.

A safetensors file is an 8-byte header length, a JSON header (``dtype``, ``shape``,
``data_offsets`` of each tensor) and the tensors row-major, back to back. A box of a tensor (a range
per dimension) is a set of contiguous byte runs: one ``pread`` per run, so a row split reads one
run and a column split one run per row. ``BYTES_READ`` counts what this process read.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generator, Optional, Sequence

import torch

from lightning_parallel.tensor_parallel.shard import TPShard, padded_size

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
BYTES_READ = [0]  # bytes this process read from safetensors files through this module


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a safetensors file, read lazily (``dtype`` is the parameter's: values are cast)."""

    path: str
    start: int  # absolute byte offset of the tensor's data
    stored: torch.dtype
    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, box: Optional[Sequence[range]] = None) -> torch.Tensor:
        """The values in ``box`` (a range per dimension; None: the whole tensor)."""
        box = [range(n) for n in self.shape] if box is None else list(box)
        out_shape = [len(r) for r in box]
        item = torch.empty((), dtype=self.stored).element_size()
        if 0 in out_shape:
            return torch.empty(out_shape, dtype=self.dtype)
        # the innermost dimension that is not read whole: every run covers it and all dims after it
        cut = max((d for d, r in enumerate(box) if len(r) != self.shape[d]), default=0)
        inner = math.prod(self.shape[cut + 1:])
        run = len(box[cut]) * inner * item
        strides = [math.prod(self.shape[d + 1:]) for d in range(len(self.shape))]
        buffer = bytearray(run * math.prod(out_shape[:cut]))
        with open(self.path, "rb") as f:
            fd, at = f.fileno(), 0
            for index in itertools.product(*box[:cut]):
                offset = sum(i * s for i, s in zip(index, strides)) + box[cut].start * inner
                chunk = os.pread(fd, run, self.start + offset * item)
                if len(chunk) != run:
                    raise OSError(f"{self.path} ends inside tensor data (read {len(chunk)} of {run} bytes)")
                buffer[at:at + run] = chunk
                at += run
        BYTES_READ[0] += len(buffer)
        values = torch.frombuffer(buffer, dtype=self.stored) if buffer else torch.empty(0, dtype=self.stored)
        if sys.byteorder != "little":
            values = values.byteswap()  # safetensors stores little-endian
        return values.reshape(out_shape).to(self.dtype)

    def with_dtype(self, dtype: torch.dtype) -> "SafetensorsTensor":
        return SafetensorsTensor(self.path, self.start, self.stored, self.shape, dtype)


def read_header(path: str) -> dict[str, SafetensorsTensor]:
    """Every tensor of one safetensors file, as lazy sources (reads the header only)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    return {
        key: SafetensorsTensor(path, base + entry["data_offsets"][0], _DTYPES[entry["dtype"]], tuple(entry["shape"]),
                               _DTYPES[entry["dtype"]])
        for key, entry in header.items() if key != "__metadata__"
    }


def read_shard(source: SafetensorsTensor, shard: Optional[TPShard], rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s TP shard of ``source`` (equal to ``tensor_parallel.shard.slice_shard`` of the
    whole tensor), reading only its bytes; the whole tensor when ``shard`` is None."""
    if shard is None or size == 1:
        return source.read()
    dim = shard.dim % len(source.shape)
    length = source.shape[dim]
    padded = padded_size(length, size) if shard.full_size is not None else length
    block = padded // shard.fused
    step = -(-block // size)  # torch.chunk's chunk length
    parts = []
    for b in range(shard.fused):
        start = b * block + min(rank * step, block)
        stop = b * block + min((rank + 1) * step, block)
        real = range(min(start, length), min(stop, length))
        box = [range(n) for n in source.shape]
        box[dim] = real
        part = source.read(box)
        if stop - start > len(real):  # rows past the vocabulary: the padding slice_shard adds (zeros)
            pad = list(part.shape)
            pad[dim] = stop - start - len(real)
            part = torch.cat([part, torch.zeros(pad, dtype=part.dtype)], dim=dim)
        parts.append(part)
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]


# ---- from_pretrained under empty init ---------------------------------------------------------
def _renamer(model: Any, load_config: Any) -> Optional[Callable[[str, dict], tuple[str, Optional[str]]]]:
    """transformers' own checkpoint-key renaming for ``model`` (None where this transformers has none)."""
    try:
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return None
    mapping = getattr(load_config, "weight_mapping", None) or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)

    def rename(key: str, meta: dict) -> tuple[str, Optional[str]]:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:  # as transformers does: only the prefix may be needed
            renamed, pattern = rename_source_key(key, [], [], prefix, meta)
        return renamed, pattern

    return rename


def _eligible(state_dict: Any, files: Optional[list], load_config: Any) -> bool:
    on_cpu = getattr(load_config, "device_map", None) in (None, {"": "cpu"}, {"": torch.device("cpu")})
    return (state_dict is None and bool(files) and all(str(f).endswith(".safetensors") for f in files)
            and getattr(load_config, "hf_quantizer", None) is None and on_cpu
            and getattr(load_config, "device_mesh", None) is None)


def _deferring(original: Callable, defer: Callable[[torch.nn.Parameter, SafetensorsTensor], bool]) -> Callable:
    """transformers' ``_load_pretrained_model``, leaving every plainly renamed parameter that ``defer``
    accepts to be read later."""

    def load(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        rename = _renamer(model, load_config)
        if rename is None or not _eligible(state_dict, checkpoint_files, load_config):
            return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        meta = model.state_dict()
        params = dict(model.named_parameters(remove_duplicate=False))
        deferred, eager = {}, {}
        for path in checkpoint_files:
            for key, source in read_header(path).items():
                name, converted = rename(key, meta)
                param = params.get(name)
                if (converted is None and param is not None and tuple(param.shape) == source.shape
                        and defer(param, source.with_dtype(param.dtype))):
                    deferred[name] = source
                    param._is_hf_initialized = True  # loaded: transformers must not initialise it
                else:  # converted, a buffer, unexpected or mismatched: transformers handles and reports it
                    eager[key] = source.read()
        info = original(model, eager, None, load_config, *args, **kwargs)
        loading = info[0] if isinstance(info, tuple) else info
        loading.missing_keys.difference_update(deferred)
        return info

    load.__wrapped__ = original
    return load


@contextmanager
def deferred_pretrained_reads(defer: Callable[[torch.nn.Parameter, SafetensorsTensor], bool]) -> Generator[None, None, None]:
    """While active, Hugging Face models loaded with ``from_pretrained`` hand each parameter's source to
    ``defer`` (which returns whether it will read it later) instead of reading it; a no-op where
    transformers is not imported."""
    if "transformers" not in sys.modules:
        yield
        return
    try:
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        yield
        return
    original = PreTrainedModel.__dict__.get("_load_pretrained_model")
    if not isinstance(original, staticmethod):  # a transformers whose loader this module does not know
        with _kernels_on_host(PreTrainedModel):
            yield
        return
    PreTrainedModel._load_pretrained_model = staticmethod(_deferring(original.__func__, defer))
    try:
        with _kernels_on_host(PreTrainedModel):
            yield
    finally:
        PreTrainedModel._load_pretrained_model = original


@contextmanager
def _kernels_on_host(model_class: type) -> Generator[None, None, None]:
    """transformers (5.25 on) swaps layers for hub kernels at the end of ``from_pretrained``, choosing
    them for the device the parameters are on, and refuses the meta device. Here the parameters are on
    meta only until they are read; kernels are chosen for the device eager construction would have
    used: the accelerator when there is one, the host otherwise. The swap changes no parameter."""
    original = model_class.__dict__.get("set_use_kernels")
    if original is None:  # a transformers without hub kernels
        yield
        return

    def set_use_kernels(self, use_kernels, *args, **kwargs):
        if use_kernels and getattr(self, "_kernels_device", None) is None and self.device.type == "meta":
            self._kernels_device = "cuda" if torch.cuda.is_available() else "cpu"
        return original(self, use_kernels, *args, **kwargs)

    model_class.set_use_kernels = set_use_kernels
    try:
        yield
    finally:
        model_class.set_use_kernels = original

