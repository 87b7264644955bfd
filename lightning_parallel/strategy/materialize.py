"""Models larger than one device: each rank materialises only its part of a model built on meta.

Under ``empty_parameters()`` (``empty_init.py``: what the strategy's ``tensor_init_context`` enters
for ``trainer.init_module(empty_init=True)`` and for ``configure_model`` under it) every parameter
is created on the meta device with a record of how construction set it. The strategy then records
the unsplit model (``UnsplitModel.of``), applies tensor and pipeline parallelism to the meta model,
and ``materialize`` gives each rank real values for exactly the parameters it holds.

Values do not depend on the layout. Each module that owns parameters is materialised on its own,
with the default generator seeded from (seed, module name): its parameters' recorded values and
in-place operations are replayed in the order construction made them (a value loaded from a file
is read for this rank's slice only, ``checkpoint/pretrained.py``). The full tensor of one module
exists only for that moment; each rank keeps its TP shard of it. A single device materialises
through the same function, so it starts from the very same values. A parameter created on meta
outside ``empty_parameters()`` has no record: it gets ``module.reset_parameters()`` and then the
model's ``_init_weights(module)`` (Hugging Face and nanoGPT style). One construction could not
record (``History.unknown``), or that nothing sets, is refused with its name.

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
import gc
import hashlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from lightning_parallel.checkpoint.pretrained import SafetensorsTensor, read_shard
from lightning_parallel.compat import _sync_module_states_over
from lightning_parallel.data_parallel.fully_sharded import sharded_like
from lightning_parallel.errors import IncompatibleModelError
from lightning_parallel.strategy.empty_init import History, empty_parameters, history_of, unset  # noqa: F401 - re-exported
from lightning_parallel.tensor_parallel.shard import TPShard, slice_shard

_BUCKET_BYTES = 250 * 1024 * 1024  # the bucket Lightning's and DDP's initial broadcast use


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


def builds_later(module: nn.Module) -> bool:
    """Whether a LightningModule builds its network in a hook Lightning calls after the strategy's
    ``setup_environment`` and before its ``setup``: ``configure_model``, or ``setup`` when the module
    holds no parameter yet."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not isinstance(module, LightningModule):
        return False
    return is_overridden("configure_model", module, LightningModule) or not any(True for _ in module.parameters())


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Three numbers that differ between two tensors of different values (sums over all and over a
    stride of the elements, and the count), computed without a copy of the tensor."""
    flat = tensor.detach().reshape(-1)
    if flat.is_complex() or flat.dtype == torch.bool:
        flat = flat.view(torch.uint8) if flat.dtype == torch.bool else torch.view_as_real(flat).reshape(-1)
    return torch.stack([flat.sum(dtype=torch.float64), flat[::97].sum(dtype=torch.float64),
                        torch.tensor(float(flat.numel()), dtype=torch.float64)])


def broadcast_recorded_values(model: nn.Module) -> int:
    """Rank 0's construction, where ranks differ, for a meta-built model: the generator states its random
    calls drew from (processes of a popen or torchrun launch draw alike only if the script seeds them
    alike), the values recorded for its parameters (``nn.Parameter(torch.randn(...))``) and its
    buffers. Values read from one file agree and stay. One broadcast of the generator states, one
    all-reduce of fingerprints, then a broadcast of only the tensors that differ; collective over all
    ranks. Values that construction computed from others and recorded calls write (``empty_init.py``)
    are compared and sent like the recorded values. Returns how many tensors were broadcast."""
    histories = list({id(h): h for p in model.parameters() if (h := history_of(p)) is not None}.values())
    group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    drawn = [op for h in histories for op in h.ops if op.rng is not None]
    if drawn:
        states = torch.stack([op.rng for op in drawn])
        dist.broadcast(states, src=0, group=group)
        for op, state in zip(drawn, states):
            op.rng = state.clone()  # a generator takes a state that starts its own storage
    values = [h for h in histories if isinstance(h.initial, torch.Tensor)]
    # tensors the recorded calls write (rows drawn from the old rows' statistics by resize_token_embeddings)
    written = [t for h in histories for op in h.ops for t in tree_flatten((op.args, op.kwargs))[0]
               if isinstance(t, torch.Tensor) and not t.is_meta]
    tensors = [h.initial for h in values] + [b for b in model.buffers() if not b.is_meta] + written
    prints = torch.stack([_fingerprint(t.cpu()) for t in tensors]) if tensors else torch.zeros(0, 3, dtype=torch.float64)
    highest, lowest = prints.clone(), prints.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=group)
    differ = [i for i in range(len(tensors)) if not torch.equal(highest[i], lowest[i])]
    for i in differ:
        value = tensors[i].detach().cpu().contiguous()
        dist.broadcast(value, src=0, group=group)
        if i < len(values):
            values[i].initial = value
        else:
            with torch.no_grad():
                tensors[i].copy_(value)
    if group is not dist.group.WORLD:
        dist.destroy_process_group(group)
    return len(differ)


@dataclass
class _Owner:
    name: str
    module: nn.Module  # the original object, kept even if tensor parallelism replaces it
    init_weights: Optional[Callable[[nn.Module], None]]
    # its parameters as built (whole, with their records), kept even if tensor parallelism replaces them
    # in place on the same module (the experts of a Mixture-of-Experts layer)
    params: dict[str, Optional[nn.Parameter]]


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
                owners.append(_Owner(name, module, init_of[name], dict(module._parameters)))
                for attr, p in direct:
                    first.setdefault(id(p), (len(owners) - 1, attr))
        owner_of = {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
        return cls(owners, owner_of)


def module_seed(seed: int, name: str) -> int:
    """A seed for module ``name`` that every process derives alike (Python's ``hash`` is salted)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _owner_values(owner: _Owner, wanted: dict[str, Optional[TPShard]], device: torch.device, seed: int,
                  tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """This rank's values (TP shards where ``wanted`` gives one) of the ``wanted`` parameters of ``owner``.

    Every parameter of the module is replayed, wanted or not, in registration order, so the module's
    generator gives each the same numbers on every layout; a value read from a file consumes none, and
    is read only where wanted, for the wanted shard only.
    """
    params = {attr: p for attr, p in owner.params.items() if p is not None}
    values: dict[str, torch.Tensor] = {}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(module_seed(seed, owner.name))
        if any(history_of(p) is None for p in params.values()):
            values.update(_initialised_by_the_module(owner, device))
        for attr, param in params.items():
            history = history_of(param)
            if history is not None and not _read_only(history):
                values[attr] = _replayed(history, param, device, _full_name(owner, attr))
    out = {}
    for attr, shard in wanted.items():
        value = values.get(attr)
        if value is None:  # a file read with nothing replayed after it: this rank's slice only
            out[attr] = read_shard(history_of(params[attr]).initial, shard, tp_rank, tp_size).to(device)
            continue
        if value.is_floating_point() and torch.isnan(value).any():
            raise IncompatibleModelError(
                f"{_full_name(owner, attr)} cannot be materialised from the meta device: nothing sets its value "
                f"during construction ({type(owner.module).__name__}.reset_parameters(), the model's _init_weights() "
                "or any other init call); set it in the constructor, or create the model without empty_init"
            )
        out[attr] = value if shard is None else slice_shard(value, shard, tp_rank, tp_size)
    return out


def _read_only(history: History) -> bool:
    """A value read from a file and nothing done to it afterwards (it can be read in slices)."""
    return isinstance(history.initial, SafetensorsTensor) and not history.ops and history.unknown is None


def _full_name(owner: _Owner, attr: str) -> str:
    return f"{owner.name}.{attr}" if owner.name else attr


def _replayed(history: History, param: nn.Parameter, device: torch.device, name: str) -> torch.Tensor:
    """The whole value construction gave ``param``: its initial value with the recorded operations applied."""
    if history.unknown is not None:
        raise IncompatibleModelError(
            f"{name} cannot be materialised from the meta device: during construction {history.unknown}, "
            "which cannot be replayed once the model is split; create the model without empty_init"
        )
    return history.replay(param, device)


def _initialised_by_the_module(owner: _Owner, device: torch.device) -> dict[str, torch.Tensor]:
    """Values of the parameters of ``owner`` that have no record, as its own init functions set them."""
    scratch = copy.copy(owner.module)
    scratch._parameters = {
        attr: None if p is None else nn.Parameter(unset(p, device), p.requires_grad)
        for attr, p in owner.params.items()
    }
    if hasattr(scratch, "reset_parameters"):
        scratch.reset_parameters()
    if owner.init_weights is not None:
        owner.init_weights(scratch)
    return {attr: p.detach() for attr, p in scratch._parameters.items()
            if p is not None and history_of(owner.params[attr]) is None}


@torch.no_grad()
def materialize(model: nn.Module, unsplit: UnsplitModel, tp_rank: int, tp_size: int, device: torch.device,
                seed: int) -> None:
    """Give every meta parameter left on ``model`` (this rank's stage and shards) its initial value.

    A parameter that ZeRO-2/3 shards over the data-parallel replicas (a DTensor) keeps only this rank's
    rows of it (``data_parallel.fully_sharded``): the whole value exists only while its module is done.

    Parameters keep their identity (``torch.utils.swap_tensors``), so the tied-weight and gradient
    hooks set up on the meta model keep working; their ``tp_shard`` and other attributes stay. A swap
    needs no other reference to the parameter: the autograd graph of the pipeline's setup trace, left
    in a reference cycle, can still hold one until the garbage collector runs, so it runs first.
    """
    gc.collect()
    todo: dict[int, list[tuple[str, nn.Parameter]]] = {}
    done: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and id(p) not in done:
            done.add(id(p))
            index, attr = unsplit.owner_of[name]
            todo.setdefault(index, []).append((attr, p))
    rnns = [m for m in model.modules() if isinstance(m, nn.RNNBase)]
    for rnn in rnns:  # they keep weak references to their weights, which a swap may not leave behind
        rnn._flat_weight_refs = []
    for index in sorted(todo):
        wanted = {attr: getattr(param, "tp_shard", None) for attr, param in todo[index]}
        values = _owner_values(unsplit.owners[index], wanted, device, seed, tp_rank, tp_size)
        for attr, param in todo[index]:
            value = values[attr]
            if isinstance(param, DTensor):  # sharded over the data-parallel replicas (ZeRO-2/3): keep this rank's rows
                value = sharded_like(value, param)
            real = nn.Parameter(value, requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, real)
            param.__dict__.update(real.__dict__)  # the swap moved the attributes (tp_shard, ...) to ``real``
    for rnn in rnns:
        rnn._init_flat_weights()
