"""Models larger than one device: create parameters without memory, then materialise each rank's part.

Under ``empty_parameters()`` (what the strategy's ``tensor_init_context(empty_init=True)`` enters,
so ``trainer.init_module(empty_init=True)`` uses it) every parameter a module registers goes to the
meta device and no init function runs; buffers, metric states and other tensors stay real, so the
values a constructor computes for them (causal masks, rotary tables) survive. The strategy then
records the unsplit model (``UnsplitModel.of``), applies tensor and pipeline parallelism to the
meta model, and ``materialize`` gives each rank real values for exactly the parameters it holds.

Initial values do not depend on the layout. Each module that owns parameters is initialised on
its own, from a generator seeded with (seed, module name), the way its constructor and the model
would have done it: ``module.reset_parameters()`` first, then the model's ``_init_weights(module)``
(Hugging Face and nanoGPT style; the nearest enclosing module that defines it). The full tensor of
one module exists only for that moment; each rank keeps its TP shard of it. A single device
materialises through the same function, so it starts from the very same values.

The rule to know: initialisation written as a loop after construction (nanoGPT's scaling of
``c_proj`` weights by ``1/sqrt(2 * n_layer)``) is not replayed; put it in ``_init_weights`` or in
the module's ``reset_parameters``. A parameter that neither sets is an error naming it.

A model built with real values (no ``empty_init``) is split in host memory instead: rank 0's
initial values are broadcast while it is still on the CPU it was built on (``broadcast_on_host``),
tensor and pipeline parallelism split it there, and only this rank's stage and shards then move to
the accelerator. Every rank already holds the whole model in host memory at that point (it built
it), so the broadcast costs no extra memory anywhere. It is needed for exactness: processes that
each run the script (``start_method="popen"``, torchrun) build different random values unless the
script seeds them alike, and the strategy's own seeding happens after the model exists.
"""

from __future__ import annotations

import copy
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, ClassVar, Generator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_parallel.compat import _sync_module_states_over
from lightning_parallel.tensor_parallel.shard import slice_shard

_BUCKET_BYTES = 250 * 1024 * 1024  # the bucket Lightning's and DDP's initial broadcast use


class _SkipInit(TorchFunctionMode):
    """Makes ``torch.nn.init`` functions no-ops: their targets are about to become meta tensors."""

    _skipped: ClassVar[set] = {f for name, f in vars(nn.init).items() if callable(f) and name.endswith("_")}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._skipped:
            return args[0] if args else next(iter(kwargs.values()))
        return func(*args, **(kwargs or {}))


@contextmanager
def empty_parameters() -> Generator[None, None, None]:
    """Inside, modules register their parameters on the meta device (no memory, no init)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        with _SkipInit():
            yield
    finally:
        nn.Module.register_parameter = register


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def on_host(module: nn.Module) -> bool:
    """Whether every parameter and buffer of ``module`` is in CPU memory (where a model is built)."""
    return all(t.device.type == "cpu" for t in (*module.parameters(), *module.buffers()))


def broadcast_on_host(module: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, sent between CPU tensors (``module`` is ``on_host``).

    Uses the default process group when it is gloo (CPU runs: the numbers are those of Lightning's
    ``_sync_module_states``), otherwise a gloo group over all ranks made for this one broadcast, as
    NCCL sends only accelerator tensors. Collective: every rank calls it.
    """
    group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    _sync_module_states_over(module, group, _BUCKET_BYTES, src=0, params_and_buffers_to_ignore=ignored)
    if group is not dist.group.WORLD:
        dist.destroy_process_group(group)


@dataclass
class _Owner:
    name: str
    module: nn.Module  # the original object, kept even if tensor parallelism replaces it
    init_weights: Optional[Callable[[nn.Module], None]]


@dataclass
class UnsplitModel:
    """Who owns each parameter in the model before it is split (recorded on the meta model).

    owners: modules that hold parameters directly, in registration order.
    owner_of: every parameter name (tied aliases included) -> (index into owners, attribute).
    """

    owners: list[_Owner]
    owner_of: dict[str, tuple[int, str]]

    @classmethod
    def of(cls, model: nn.Module) -> "UnsplitModel":
        owners: list[_Owner] = []
        first: dict[int, tuple[int, str]] = {}
        init_of: dict[str, Optional[Callable]] = {}  # the nearest _init_weights of a module or its ancestors
        for name, module in model.named_modules(remove_duplicate=False):
            own = getattr(module, "_init_weights", None)
            init_of[name] = own if callable(own) else (init_of[name.rpartition(".")[0]] if name else None)
            direct = [(attr, p) for attr, p in module._parameters.items() if p is not None]
            if direct:
                owners.append(_Owner(name, module, init_of[name]))
                for attr, p in direct:
                    first.setdefault(id(p), (len(owners) - 1, attr))
        owner_of = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        return cls(owners, owner_of)


def module_seed(seed: int, name: str) -> int:
    """A seed for module ``name`` that every process derives alike (Python's ``hash`` is salted)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _unset(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """NaN where floating point, so a value no init function wrote is detected."""
    empty = torch.empty(p.shape, dtype=p.dtype, device=device)
    return empty.fill_(float("nan")) if empty.is_floating_point() else empty


def _initialised(owner: _Owner, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Full-size values of ``owner``'s own parameters, initialised as its constructor and the model would."""
    scratch = copy.copy(owner.module)
    scratch._parameters = {
        attr: None if p is None else nn.Parameter(_unset(p, device), p.requires_grad)
        for attr, p in owner.module._parameters.items()
    }
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(module_seed(seed, owner.name))
        if hasattr(scratch, "reset_parameters"):
            scratch.reset_parameters()
        if owner.init_weights is not None:
            owner.init_weights(scratch)
    values = {attr: p.detach() for attr, p in scratch._parameters.items() if p is not None}
    for attr, p in values.items():
        if p.is_floating_point() and torch.isnan(p).any():
            raise ValueError(
                f"{owner.name + '.' if owner.name else ''}{attr} cannot be materialised from the meta device: neither "
                f"{type(owner.module).__name__}.reset_parameters() nor the model's _init_weights() sets it; define "
                "one of them, or create the model without empty_init"
            )
    return values


@torch.no_grad()
def materialize(model: nn.Module, unsplit: UnsplitModel, tp_rank: int, tp_size: int, device: torch.device,
                seed: int) -> None:
    """Give every meta parameter left on ``model`` (this rank's stage and shards) its initial value.

    Parameters keep their identity (``torch.utils.swap_tensors``), so the tied-weight and gradient
    hooks set up on the meta model keep working; their ``tp_shard`` and other attributes stay.
    """
    todo: dict[int, list[tuple[str, nn.Parameter]]] = {}
    done: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and id(p) not in done:
            done.add(id(p))
            index, attr = unsplit.owner_of[name]
            todo.setdefault(index, []).append((attr, p))
    for index in sorted(todo):
        values = _initialised(unsplit.owners[index], device, seed)
        for attr, param in todo[index]:
            value = values[attr]
            shard = getattr(param, "tp_shard", None)
            if shard is not None:
                value = slice_shard(value, shard, tp_rank, tp_size)
            real = nn.Parameter(value, requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, real)
            param.__dict__.update(real.__dict__)  # the swap moved the attributes (tp_shard, ...) to ``real``
