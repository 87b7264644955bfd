"""``ReplicaGroups``: this launch's place in a run of several replica groups, and the step it wraps.

Each rank holds a ``torchft.Manager``. The managers of one group share the group's own rendezvous
store (the one its process group was made from); rank 0's manager speaks for the group to the quorum
server. Rank ``r`` of every group is linked to rank ``r`` of the others by a cross-group process group
that torchft rebuilds whenever the quorum changes, so a rank averages its gradients (its TP shard, its
pipeline stage, already averaged over the group's own data-parallel ranks) with the ranks holding the
same part of the model in the other groups.

One training step (``step``), inside Lightning's optimizer step:

1. quorum: the groups alive agree on who takes part; a group behind (restarted) copies the live
   state from a group at the newest step first (``state.py``), before its forward;
2. the forward and backward (Lightning's closure) and the group's own gradient finalisation;
3. the gradients averaged over the groups in the quorum;
4. commit: the optimizer steps only if every group of the quorum got through the step; a step that
   lost a group midway is discarded by all of them, and the next quorum goes on without it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from lightning_parallel.errors import ConfigurationError
from lightning_parallel.fault_tolerance import require_torchft
from lightning_parallel.fault_tolerance.state import load_trainer_state, trainer_state

log = logging.getLogger(__name__)


def refuse_unsupported_training(trainer: Any) -> None:
    """One quorum and one commit per optimizer step: refuse what would take several, before any quorum."""
    module = trainer.lightning_module
    problems = []
    if not module.automatic_optimization:
        problems.append("manual optimisation (automatic_optimization=False): use automatic optimisation")
    if len(trainer.optimizers) != 1:
        problems.append(f"{len(trainer.optimizers)} optimizers: return one optimizer from configure_optimizers")
    if trainer.accumulate_grad_batches != 1:
        problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: use 1 and a larger batch")
    if problems:
        raise ConfigurationError("replica groups commit one optimizer step per batch, which rules out "
                                 + "; ".join(problems))


class ReplicaGroups:
    """This rank's torchft manager, the state a restarted group copies, and the fault-tolerant step."""

    def __init__(self, manager: Any, trainer: Any) -> None:
        self.manager = manager
        self.trainer = trainer
        manager.register_state_dict_fn("trainer", lambda state: load_trainer_state(trainer, state),
                                       lambda: trainer_state(trainer))

    @classmethod
    def join(cls, strategy: Any, trainer: Any) -> "ReplicaGroups":
        """Start this rank's manager (rank 0's registers the group with the quorum server)."""
        torchft = require_torchft()
        refuse_unsupported_training(trainer)
        options, environment = strategy.options, strategy.cluster_environment
        cross_group = torchft.ProcessGroupNCCL() if strategy.root_device.type == "cuda" else torchft.ProcessGroupGloo()
        manager = torchft.Manager(
            pg=cross_group,
            load_state_dict=None,
            state_dict=None,
            # the quorum server's --min-replicas decides how few groups may train; a quorum it forms commits
            min_replica_size=1,
            # the quorum before the forward, so a restarted group takes the live state before computing
            use_async_quorum=False,
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            store_addr=environment.main_address,
            store_port=environment.main_port,
            lighthouse_addr=options.lighthouse,
            replica_id=f"replica_group_{options.replica_group}",
        )
        return cls(manager, trainer)

    @property
    def participants(self) -> int:
        """Replica groups in the current step's quorum (this one included)."""
        return self.manager.num_participants()

    def step(self, closure: Callable[[], Any], optimizer_step: Callable[[Callable[[], Any]], Any]) -> Any:
        """One fault-tolerant step: quorum, ``closure`` (forward, backward), the gradients averaged over the
        groups, and ``optimizer_step(closure_result)`` only if the step commits."""
        self.manager.start_quorum()  # a restarted group copies the live state here
        result = closure()
        self._average_gradients()
        if not self.manager.should_commit():  # discarded by every group of the quorum
            error = self.manager.errored()
            log.warning(f"step {self.trainer.global_step} not committed across replica groups, the optimizer "
                        "does not step: " + (repr(error.original_exception) if error else "another group failed it"))
            return result
        return optimizer_step(lambda: result)

    def _average_gradients(self) -> None:
        """Average this rank's gradients with the same rank of every group in the quorum, one flat buffer
        per dtype; torchft divides by the number of groups in the quorum."""
        grads = [p.grad for optimizer in self.trainer.optimizers for group in optimizer.param_groups
                 for p in group["params"] if p.grad is not None]
        for dtype in sorted({g.dtype for g in grads}, key=str):
            same = [g for g in grads if g.dtype == dtype]
            flat = _flatten_dense_tensors(same)
            self.manager.allreduce(flat).wait()
            for grad, averaged in zip(same, _unflatten_dense_tensors(flat, same)):
                grad.copy_(averaged)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
