"""Broadcast a small Python object from one pipeline stage in a single collective.

``torch.distributed.broadcast_object_list`` sends the pickled size first and the bytes second:
two collectives, each a full round trip, at the end of every pipelined step, where every rank
waits for them. The step's loss and log records are a few kilobytes, so here they travel in one
fixed-size buffer that carries its own length; only a larger object needs a second broadcast.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

CAPACITY = 16 * 1024  # bytes in the first (often only) broadcast, length prefix included
_PREFIX = 8


def broadcast_object(obj: Any, src: int, group, device: torch.device, is_src: bool) -> Any:
    """``obj`` of the rank ``src`` (global rank) on every rank of ``group``; pass ``is_src`` there."""
    data = pickle.dumps(obj) if is_src else b""
    first = torch.zeros(CAPACITY, dtype=torch.uint8)
    if is_src:
        first[:_PREFIX] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        head = data[: CAPACITY - _PREFIX]
        first[_PREFIX : _PREFIX + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    first = first.to(device)
    dist.broadcast(first, src=src, group=group)
    size = int(first[:_PREFIX].cpu().view(torch.int64))
    rest = None
    if size > CAPACITY - _PREFIX:
        if is_src:
            rest = torch.frombuffer(bytearray(data[CAPACITY - _PREFIX :]), dtype=torch.uint8).to(device)
        else:
            rest = torch.empty(size - (CAPACITY - _PREFIX), dtype=torch.uint8, device=device)
        dist.broadcast(rest, src=src, group=group)
    if is_src:
        return obj
    body = first[_PREFIX : _PREFIX + min(size, CAPACITY - _PREFIX)].cpu().numpy().tobytes()
    if rest is not None:
        body += rest.cpu().numpy().tobytes()
    return pickle.loads(body)
