"""ZeRO stages 2 and 3: parameters, gradients and optimizer state sharded over the data-parallel group.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020,
arXiv 1910.02054), stages 2 (P_os+g) and 3 (P_os+g+p), on torch's FSDP2
(``torch.distributed.fsdp.fully_shard``; Zhao et al. 2023, "PyTorch FSDP", arXiv 2304.11277) over the
``dp`` dimension of the mesh. Every parameter becomes a DTensor of which data-parallel rank ``r``
keeps rows ``[r*c, (r+1)*c)`` of dim 0 (``c = ceil(rows / dp)``, ``shard_rows``); the optimizer,
created afterwards, steps on those rows only, and their averaged gradient arrives by reduce-scatter.
Under tensor parallelism a parameter is this rank's TP shard, a plain tensor: it is sharded further,
so a rank keeps ``1/(tp*dp)`` of a sharded weight.

**Units.** Each module of ``units`` (the strategy passes every module of the model's repeated block
type) is gathered by one all-gather before its forward, and its gradients leave by one reduce-scatter
after its backward. Everything else (embeddings, final norm, head, the LightningModule's own
parameters) is the root unit, gathered by ``gather_root`` when a step starts: those modules may run
anywhere in the user's step, outside any forward FSDP could hook.

**Stage 3** frees a unit's gathered parameters after its forward and gathers them again for its
backward. **Stage 2** keeps them from the forward to the end of the backward (FSDP's
``reshard_after_forward=False``, FSDP1's ``SHARD_GRAD_OP``): one all-gather and one reduce-scatter
per step, the bytes of one all-reduce, where the paper's stage 2 all-gathers the updated parameters
after the step instead. At both stages parameters are sharded between steps.

**Gradient accumulation** (``no_sync``): backward accumulates whole gradients; the last backward of
the window reduce-scatters them.

**Pipeline parallelism** (``keep_gathered``): a stage runs forward and backward of every micro-batch
itself, the input and weight gradients of a micro-batch apart under zero-bubble schedules. Gathering
per micro-batch would cost ``2M`` all-gathers of the stage per step; instead the stage's parameters
are gathered at its first forward of the step and kept, gradients accumulate whole, and ``finish``
reduce-scatters them once (torchtitan's choice with pipelining). Memory during a step is then
ZeRO-1's (the stage's whole parameters and gradients), between steps stage 3's.

**Hybrid sharding** (HSDP; Zhao et al. 2023, §3.2.2): over the 2-D ``(dp_replicate, dp_shard)`` mesh
(``mesh.ParallelMesh.zero_mesh``) FSDP2 shards every parameter over ``dp_shard`` alone and keeps the same
rows on every ``dp_replicate`` peer: a rank keeps ``1/dp_shard`` of the parameters, the all-gathers stay
inside a shard group (a node), and a unit's gradients are reduce-scattered inside the shard group, then
all-reduced across the replicate group (``1/dp_shard`` of the bytes of a whole all-reduce crossing
nodes), averaged over all ``dp`` replicas. The helpers below read a DTensor's shards from the mesh
dimension its placement shards over, so they serve both meshes.

**Parameters no replica used.** FSDP2 reduce-scatters a unit's gradients as one buffer, so every
replica sends every parameter (zeros where it had no gradient); a flag per parameter, summed over
the replicas with one small all-reduce per step, then gives ``grad=None`` to a parameter no replica
used, as one device would leave it (an optimizer skips it: no weight decay, no moment update).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_parallel.compat import (
    before_fsdp_post_backward,
    fsdp_group_parameters,
    fsdp_has_unsharded_grad,
    fsdp_param_groups,
    fsdp_reduce_now,
    fsdp_reduces,
    fsdp_reshard,
)


def shard_rows(rows: int, replicas: int, rank: int) -> tuple[int, int]:
    """``(first row, row count)`` of dim 0 that data-parallel ``rank`` keeps of a tensor with ``rows``
    rows: ``torch.chunk``'s cut, which FSDP2 uses (the last ranks may keep fewer rows, or none)."""
    per_rank = -(-rows // replicas)
    start = min(rank * per_rank, rows)
    return start, min(rows, start + per_rank) - start


def shard_coordinate(like: DTensor) -> tuple[int, int]:
    """``(shards, this rank's shard)`` of a DTensor sharded by rows over one dimension of its mesh (the
    ``dp`` mesh, or HSDP's ``dp_shard`` dimension; it is replicated over any other)."""
    mesh = like.device_mesh
    dim = next(i for i, placement in enumerate(like.placements) if placement.is_shard())
    return mesh.size(dim), mesh.get_local_rank(dim)


def local_slice(param: DTensor) -> tuple[int, int]:
    """``(begin, length)`` of the elements of the flattened whole tensor that this rank's shard of
    ``param`` holds (its rows are consecutive in row-major order)."""
    start, count = shard_rows(param.shape[0], *shard_coordinate(param))
    per_row = param[0].numel() if param.dim() > 1 else 1
    return start * per_row, count * per_row


def rows_of(rows: torch.Tensor, like: DTensor) -> DTensor:
    """The DTensor sharded as ``like`` whose local part is ``rows``: this rank's rows (flat or shaped), on
    ``like``'s device (where ``rows`` are when ``like`` is still on the meta device)."""
    _, count = shard_rows(like.shape[0], *shard_coordinate(like))
    local = rows.reshape(count, *like.shape[1:]).to(rows.device if like.is_meta else like.device)
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                              run_check=False)


def sharded_like(value: torch.Tensor, like: DTensor) -> DTensor:
    """The DTensor that shards ``value`` (a whole tensor shaped like ``like``) as ``like`` is sharded;
    only this rank's rows are copied."""
    start, count = shard_rows(value.shape[0], *shard_coordinate(like))
    return rows_of(value.narrow(0, start, count).clone(), like)


class FullySharded:
    """ZeRO stage 2 or 3 of ``module`` over the data-parallel ``mesh``: 1-D (shard over every replica) or
    the 2-D ``(dp_replicate, dp_shard)`` mesh of hybrid sharding.

    Args:
        module: the (possibly TP-split, pipeline-partitioned) LightningModule; on the meta device or
            with values. Its parameters are replaced by sharded DTensors (``replaced``: old -> new),
            which keep the old parameters' attributes (``tp_shard``, ...).
        units: the modules gathered one at a time (see the module docstring).
        stage: 2 or 3.
        keep_gathered: gather once per step and reduce in ``finish`` (pipeline parallelism).
        mp_policy: FSDP2's mixed precision (parameters gathered in ``param_dtype``, gradients reduced in
            ``reduce_dtype``), None for none.

    Call ``ready()`` once every parameter has its value (after materialising a meta model).
    """

    def __init__(self, module: nn.Module, units: Sequence[nn.Module], mesh: DeviceMesh, stage: int,
                 keep_gathered: bool = False, mp_policy: Optional[MixedPrecisionPolicy] = None):
        if stage not in (2, 3):
            raise ValueError(f"FullySharded shards at ZeRO stage 2 or 3, got {stage}")
        before = dict(module.named_parameters(remove_duplicate=False))
        policy = mp_policy or MixedPrecisionPolicy()
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3 and not keep_gathered, mp_policy=policy)
        # the root's parameters are gathered by gather_root for the whole step
        fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
        module.set_reduce_scatter_unused_params(True)
        self.module, self.mesh, self.keep_gathered = module, mesh, keep_gathered
        self.replaced = {before[name]: new for name, new in module.named_parameters(remove_duplicate=False)}
        self._attributes = {name: dict(vars(old)) for name, old in before.items() if vars(old)}
        self._keep_attributes()
        move = module._apply  # ``module.to(device)`` swaps each DTensor parameter's contents and attributes

        def apply_keeping_attributes(*args, **kwargs):
            result = move(*args, **kwargs)
            self._keep_attributes()
            return result

        module._apply = apply_keeping_attributes
        self._groups: list = []  # FSDP's parameter groups, one per unit, in one order on every replica
        self._params: list = []  # FSDP's records of every parameter, in the same order
        self._used: set = set()  # those that had a gradient in this window on this replica
        self._reduced: set = set()  # the groups whose gradients left in this window's last backward

    def _keep_attributes(self) -> None:
        """Give the sharded parameters the attributes of those they replaced (``tp_shard``, ...)."""
        for name, param in self.module.named_parameters(remove_duplicate=False):
            for key, value in self._attributes.get(name, {}).items():
                param.__dict__.setdefault(key, value)

    def ready(self) -> None:
        """Make the LightningModule FSDP's root and watch every group's gradients (all values set)."""
        self._groups = fsdp_param_groups(self.module)
        for group in self._groups:
            before_fsdp_post_backward(group, self._note_gradients)
        self._params = [fsdp_param for group in self._groups for fsdp_param in fsdp_group_parameters(group)]
        if self.keep_gathered:
            self._set_accumulating(True)

    def _note_gradients(self, group) -> None:
        self._used.update(p for p in fsdp_group_parameters(group) if fsdp_has_unsharded_grad(p))
        if fsdp_reduces(group):
            self._reduced.add(group)

    def _set_accumulating(self, accumulating: bool) -> None:
        """Backwards that accumulate whole gradients and keep parameters gathered (or the window's last)."""
        self.module.set_requires_gradient_sync(not accumulating)
        self.module.set_reshard_after_backward(not accumulating)
        self.module.set_is_last_backward(not accumulating)

    # ---- step-time ----------------------------------------------------------------------------
    def gather_root(self) -> None:
        """All-gather the root unit's parameters (no-op when gathered already)."""
        self.module.unshard()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates whole gradients; the next one outside reduce-scatters."""
        if self.keep_gathered:  # accumulates until ``finish`` anyway
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish(self) -> None:
        """After the window's last backward: reduce-scatter what is left (everything when
        ``keep_gathered``; otherwise nothing, unless no unit ran FSDP's end-of-backward, as for a model that
        is one root unit), then drop the gradients of parameters no replica used."""
        pending = [group for group in self._groups if group not in self._reduced]
        if pending:
            if self.keep_gathered:
                self._set_accumulating(False)
            fsdp_reduce_now(self.module, pending)
            if self.keep_gathered:
                self._set_accumulating(True)
        self._reduced.clear()
        if not self._params:
            return
        used = torch.tensor([p in self._used for p in self._params], dtype=torch.int32,
                            device=self._params[0].sharded_param.device)
        for dim in range(self.mesh.ndim):  # over every replica: both dimensions of a hybrid mesh
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.mesh.get_group(dim))
        for fsdp_param, anywhere in zip(self._params, used.tolist()):
            if not anywhere:
                fsdp_param.sharded_param.grad = None
        self._used.clear()

    def reshard(self) -> None:
        """Free every gathered parameter (after an evaluation step, before a checkpoint); gradients
        accumulated in an unfinished window stay."""
        for group in self._groups:
            fsdp_reshard(group)
