"""Run one Lightning step of an unchanged LightningModule as a pipeline of stages.

``PipelineEngine`` is what the strategy drives: ``partition(example)`` once in ``setup`` (before
the optimizers exist; the example batch shows in which order the model's modules run, see
``order``), then ``training_step`` / ``validation_step`` / ... per batch, and
``sync_tied_grads`` before clipping and the optimizer step. Each training step splits the batch
into micro-batches (fewer when the batch has fewer samples) and executes this rank's action list
from ``schedules`` (GPipe, 1F1B, interleaved 1F1B, or ZB-H1, ZB-V and DualPipeV of
``schedules.zero_bubble``; ``schedules.RankPlan`` says what else executing it needs), keeping what
the actions hand each other in a ``step_state.StepState``. Forwards draw random numbers from the stage's
own stream (``randomness``). A forward action calls the user's own ``training_step`` on the micro-batch; the
stand-ins of ``stage_modules`` make it compute only this stage's blocks and stop at the stage
boundary. A backward action back-propagates the received gradient (or, on the last stage, the
loss scaled once by ``loss_scale`` times the micro-batch's share of the batch: of its targets where
the loss is a cross-entropy mean over targets of the batch, see ``targets``, else of its samples). After a forward
output is sent its storage is released, keeping only the autograd graph (Megatron-LM's
``deallocate_output_tensor``), and backward then runs through the autograd engine directly. The
receives of the next exchange are posted as soon as their shapes are known (``p2p``).
Where the schedule has a weight pass ``W`` for a micro-batch, its backward ``B`` computes only the
input gradient and ``W`` the weight gradients, nothing twice (``backward_split``); schedules
without weight passes get one for the rank's last backward, so its input gradient leaves before
its weight gradients are computed. Neighbouring stages on one rank (the bottom of a V) hand the
hidden state and its gradient over in memory. An evaluation step that calls ``generate()`` is not
scheduled: it runs on every rank with each of its forwards relayed through the stages (``relay``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, ContextManager, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.compat import autograd_engine, tree_map
from lightning_parallel.mesh import ParallelMesh, local_part
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline.backward_split import SplitUnsupported, backward_input
from lightning_parallel.pipeline.broadcast import broadcast_object
from lightning_parallel.pipeline.compare import close, floating_tensors
from lightning_parallel.pipeline.errors import PipelineConfigError, PipelineIncompatibleModel
from lightning_parallel.pipeline.generation import generating_steps, refuse_generating_training
from lightning_parallel.pipeline.isolation import untouched
from lightning_parallel.pipeline.logs import LogCapture, replay
from lightning_parallel.pipeline.memory import ActivationMeter
from lightning_parallel.pipeline.meta_trace import meta_batch, meta_device
from lightning_parallel.pipeline.microbatch import signature, split_batch, whole_batch_values
from lightning_parallel.pipeline.order import RunOrder, trace_run_order, traced_conditions
from lightning_parallel.pipeline.p2p import Message, StageLink
from lightning_parallel.pipeline.partition import plan_stages, shared_parameters
from lightning_parallel.pipeline.randomness import StageRandomness
from lightning_parallel.pipeline.relay import Relay
from lightning_parallel.pipeline.schedules import (
    Action,
    Interval,
    Op,
    RankPlan,
    placement_of,
    schedule_spec,
    step_schedules,
    validate_schedule,
)
from lightning_parallel.pipeline.stage_modules import StageExit, StageRuntime, apply_stage_plan
from lightning_parallel.pipeline.step_state import PendingSend, StepState
from lightning_parallel.pipeline.targets import CrossEntropyCalls, TargetCount, learn, padding_hint, unfit


class PipelineEngine:
    """Pipeline execution of ``module`` over the pipeline group of ``mesh``.

    Args:
        module: the LightningModule, identical on every rank until ``partition()``.
        mesh: the process mesh; its groups must exist before ``partition()``.
        options: the layout's pipeline options: micro-batches per step (each batch is split along dim
            0; default one per stage), schedule (one of ``schedules.SCHEDULES``), model chunks per rank,
            the block list (found if None) and blocks per stage (balanced by parameter count if None).
    """

    def __init__(self, module: nn.Module, mesh: ParallelMesh, options: ParallelOptions):
        schedule, micro_batches = options.schedule_name, options.micro_batches or mesh.pp_size
        schedule_spec(schedule)  # refuses an unknown name
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise PipelineConfigError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.module, self.mesh = module, mesh
        self.micro_batches, self.schedule_name, self.virtual_stages = micro_batches, schedule, options.chunks
        validate_schedule(schedule, mesh.pp_size, micro_batches, self.virtual_stages)
        self.layout, self.placement = options.pipeline_layout, placement_of(schedule)
        self.plan = plan_stages(module, mesh.pp_size, self.virtual_stages, options.pipeline_blocks, self.layout,
                                placement=self.placement)
        self.runtime = StageRuntime()
        self.capture = LogCapture(module)
        # torchmetrics a step updates before the model runs would count each sample on every stage; only
        # the last stage's updates stay (the others' states are put back after each forward)
        self.metrics = [m for m in module.modules() if type(m).__module__.startswith("torchmetrics.")]
        self.tied: list[tuple[nn.Parameter, Any, tuple[int, ...]]] = []
        self.meter: Optional[ActivationMeter] = None
        self.timeline: Optional[list[Interval]] = None
        self.link: Optional[StageLink] = None
        self.randomness: Optional[StageRandomness] = None
        self.split_backward = True  # see _backward
        # entered, with the stage, around the action that last adds to the weight gradients of each of
        # this rank's stages in a training step (its last W or whole B), for overlapping the data-parallel
        # reduction of those gradients with the rest of the step; a weight two local stages share (a tied
        # embedding in a V) gets its last addition in the later of the two
        self.final_weight_context: Callable[[int], ContextManager] = lambda stage: nullcontext()
        self._schedules: dict[tuple[int, bool], RankPlan] = {}
        # per step name: where its loss's targets are in the batch, or why that is unknown (``targets``);
        # learnt from the setup trace, or from the first real forward on the last stage
        self.targets: dict[str, Union[TargetCount, str]] = {}
        # shape and dtype of each block's input in the setup trace, and how blocks return the hidden state
        # (``RunOrder.arity``); None without a trace. Not the trace itself: its results hold the graph
        self.traced_inputs: Optional[tuple[tuple[tuple[torch.Size, torch.dtype], ...], int]] = None
        # evaluation steps that call generate(): run relayed (``relay``), not pipelined; known at ``partition``
        self.generating: frozenset[str] = frozenset()
        self.relay: Optional[Relay] = None

    # ---- setup -----------------------------------------------------------------------------
    def partition(self, example: Any = None, step: str = "training_step") -> None:
        """Drop what this rank does not own and create the tied-weight groups (all ranks call it).

        ``example``: a batch as the module's ``step`` receives it. Its first micro-batch runs once
        through the whole model first, to learn which modules run before and after the blocks and
        to refuse, identically on every rank, a model that cannot be split (``order``). The run
        leaves the module as it was (``isolation``: metric states, plain attributes; ``self.log``
        is suppressed). A model whose parameters are still on the meta device
        (``trainer.init_module(empty_init=True)``) runs it on the meta device (``meta_trace``); where
        that fails (data-dependent code such as ``.item()``), and without an example, registration
        order is assumed and checked while training. The same run shows over which targets the loss
        is a mean (``targets``; on the meta device, learnt from the first real step instead).
        A ``step`` that generates (``generation``) is not traced: registration order stands.
        """
        mesh, rank = self.mesh, self.mesh.pp_rank
        refuse_generating_training(self.module)
        self.generating = generating_steps(self.module)
        order = None
        on_meta = any(p.is_meta for p in self.module.parameters())
        if example is not None and step not in self.generating:  # a decoding loop is no trace: order as registered
            whole = whole_batch_values(example)
            if whole and rank == 0:
                warnings.warn(
                    f"the batch holds 0-dim tensors ({', '.join(whole)}); under pipeline parallelism each of the "
                    f"{self.micro_batches} micro-batches receives them whole and its loss counts by its share of the "
                    "samples. If one is a count over the whole batch that divides a summed loss, the loss comes out "
                    "micro_batches times too small: return a mean over the samples instead",
                    stacklevel=2,
                )
            micro = split_batch(example, self.micro_batches)[0][0]
            step_fn = getattr(self.module, step)
            order = self._trace(micro, step_fn, on_meta, example)
            if order is not None:
                self.traced_inputs = tuple((t.shape, t.dtype) for t in order.inputs), order.arity
                self.plan = plan_stages(self.module, mesh.pp_size, self.virtual_stages, self.plan.blocks_path,
                                        self.layout, order, self.placement)
        shared = shared_parameters(self.module, self.plan)
        params = dict(self.module.named_parameters())
        groups = mesh.stage_groups([ranks for _, ranks in shared])  # this pipeline's ranks only
        self.tied.extend((params[name], groups[ranks], ranks) for name, ranks in shared if rank in ranks)
        apply_stage_plan(self.module, self.plan, rank, self.runtime)
        device = next(self.module.parameters()).device
        plan = self.plan
        self.link = StageLink(lambda s: mesh.stage_rank(plan.rank_of_stage(s)), plan.num_stages, mesh.pp_group, device)
        self._seed = torch.initial_seed()
        if order is not None:
            with meta_device(self.module, on_meta):
                self._probe(order, meta_batch(micro) if on_meta else micro, step_fn, on_meta)

    def run_stages(self, batch: Any, step: str) -> None:
        """Run each of this rank's stages forward once on the first micro-batch of ``batch`` (a batch as
        ``step`` receives it, like the one ``partition`` traced) in the modules' current modes, leaving
        nothing behind: for setup checks that watch what a stage's modules receive
        (``checks/verify_split.py``). A stage after the first starts from a random hidden state shaped as
        the traced one, the same on every rank of the stage (such a check compares two runs on the same
        input, whatever its values). Runs nothing where the setup trace did not run."""
        if self.traced_inputs is None:
            return
        inputs, arity = self.traced_inputs
        micro = split_batch(batch, self.micro_batches)[0][0]
        for stage in self.plan.stages_of_rank(self.mesh.pp_rank):
            received = None
            if stage > 0:
                shape, dtype = inputs[self.plan.stage_blocks[stage].start]
                received = torch.randn(shape, generator=torch.Generator().manual_seed(stage)).to(self.link.device, dtype)
            with untouched(self.module), traced_conditions(self.module), self.capture.suppressed():
                self._forward(stage, micro, getattr(self.module, step), (0,), received, arity, False)

    def _trace(self, micro: Any, step_fn: Callable, on_meta: bool, example: Any) -> Optional[RunOrder]:
        """``order.trace_run_order`` on ``micro``, on the meta device for a meta-device model; None where
        a meta-device run fails for any reason but the model's being unsplittable. Learns the loss's
        targets from the same run where its values are real."""
        results = []

        def run() -> Any:
            results.append(step_fn(meta_batch(micro) if on_meta else micro, 0))
            return results[0]

        losses = CrossEntropyCalls()
        try:
            with untouched(self.module), self.capture.suppressed() as logged, meta_device(self.module, on_meta), losses:
                order = trace_run_order(self.module, self.plan.blocks_path, run)
        except PipelineIncompatibleModel:
            raise
        except Exception:  # noqa: BLE001 - data-dependent code (.item()) cannot run on meta tensors
            if not on_meta:
                raise
            return None
        if not on_meta or unfit(losses.calls):  # on the meta device only the kind of loss shows, not its targets
            self._learn(step_fn.__name__, losses.calls, micro, results[0], logged, [example], self.mesh.pp_rank == 0)
        return dataclasses.replace(order, deterministic=False) if on_meta else order  # no values to compare

    def _learn(self, name: str, calls: list, micro: Any, result: Any, logged: list, batches: list, warn: bool) -> None:
        """Learn over which targets step ``name``'s loss is a mean from one run of it on ``micro``, one of
        ``batches`` or of their micro-batches (``targets``); where that cannot be known but the batch looks as if
        it matters, warn (where ``warn``, on one TP and DP rank: once per run)."""
        loss = None
        if name == "training_step":
            loss = result["loss"] if isinstance(result, dict) else result
            loss = loss if isinstance(loss, torch.Tensor) else None
        found = self.targets[name] = learn(calls, micro, loss, logged, batches)
        hint = None
        if isinstance(found, str) and (calls or name == "training_step"):
            hint = next((h for h in map(padding_hint, batches) if h), None)
        if hint and warn and self.mesh.tp_rank == 0 and self.mesh.dp_rank == 0:
            warnings.warn(
                f"{name}'s loss: {found}. Under pipeline parallelism each micro-batch's loss then counts by its share "
                f"of the batch's samples, which equals one device's loss only when every sample has as many targets; "
                f"{hint}, so the loss, its gradients and logged means may differ from one device's. For a mean over "
                "real tokens that stays exact, compute the loss with one torch.nn.functional.cross_entropy (or a "
                "Hugging Face model's labels=) on labels taken from the batch, reduction='mean' and an ignore_index",
                stacklevel=3,
            )

    def _probe(self, order: RunOrder, micro: Any, step_fn: Callable, on_meta: bool = False) -> None:
        """Run each stage of this rank once on the traced example and refuse, on every rank alike, a split
        that does not reproduce the whole model.

        A stage starts from the traced input of its first block. It must run without error; where the
        caller reuses that block's input (``h = h + block(h)``), the caller's own copy must equal the
        received state (see ``stage_modules``); and, when the example drew no random numbers, the
        stage's output (the next stage's input, or the step's result) must equal the traced one.
        This catches what the trace cannot see: values passed outside autograd, attributes a stand-in
        lacks. One all-gather of the findings lets every rank raise the same error before training.
        On a meta-device model only the first check applies (no values to compare).
        """
        problems = []
        last = self.plan.num_stages - 1
        for stage in self.plan.stages_of_rank(self.mesh.pp_rank):
            blocks = self.plan.stage_blocks[stage]
            received = order.inputs[blocks.start].to(self.link.device) if stage > 0 else None
            self.runtime.probing, self.runtime.caller_matches = True, None
            try:
                with untouched(self.module), traced_conditions(self.module), self.capture.suppressed():
                    out = self._forward(stage, micro, step_fn, (0,), received, order.arity, True)
            except Exception as err:  # noqa: BLE001 - reported on every rank below
                problems.append(f"pipeline stage {stage} fails on the example batch: {type(err).__name__}: {err}")
                continue
            finally:
                self.runtime.probing = False
            if stage > 0 and blocks.start in order.reused and not on_meta and not self.runtime.caller_matches:
                problems.append(
                    f"the caller keeps its own copy of the hidden state across block {blocks.start} (as in "
                    f"h = h + block(h)), and on the stage starting there that copy does not equal the state the "
                    "previous stage sends: the caller's update between blocks does not start from zeros. Move the "
                    "update into the blocks, choose another pipeline_layout, or train with pipeline_parallel=1"
                )
            elif order.deterministic:
                got = [out[0]] if stage < last else floating_tensors(out)
                want = [order.inputs[blocks.stop]] if stage < last else list(order.results)
                what = f"the input of block {blocks.stop}" if stage < last else "the step's result"
                # equal up to rounding: the stage runs the very operations of the traced forward; a value
                # taken from a stand-in instead differs at the scale of the values themselves
                if len(got) != len(want) or not all(close(g.detach(), w, rtol=1e-3) for g, w in zip(got, want)):
                    problems.append(
                        f"pipeline stage {stage} computes {what} differently from the whole model on the example "
                        "batch: a value other than the hidden state reaches a later stage outside autograd (a "
                        "Python number, an integer tensor, an attribute set during forward). Train this model with "
                        "pipeline_parallel=1, or set pipeline_blocks to a block list between which only the hidden "
                        "state flows"
                    )
        every: list = [None] * self.mesh.pp_size
        dist.all_gather_object(every, problems, group=self.mesh.pp_group)
        found = [p for ranks in every for p in ranks]
        if found:
            raise PipelineIncompatibleModel(found[0])

    def _schedule(self, micro_batches: int, training: bool) -> RankPlan:
        """This rank's plan for a step of ``micro_batches`` (``RankPlan``: its actions, with the points where
        its sends are known delivered and can be freed, its runs of communication actions, and for each of
        its stages the action that last adds to its weight gradients), worked out once per step shape."""
        key = (micro_batches, training)
        if key not in self._schedules:
            every = step_schedules(self.schedule_name, self.mesh.pp_size, micro_batches, self.virtual_stages,
                                   training, short=micro_batches < self.micro_batches)
            self._schedules[key] = RankPlan.of(every, self.mesh.pp_rank)
        return self._schedules[key]

    # ---- the strategy's calls ---------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the batch's mean loss on every rank (with the
        other keys of a dict ``training_step`` returns, merged over the micro-batches)."""
        return self._run(self.module.training_step, batch, (batch_idx,), loss_scale)

    def validation_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate(self.module.validation_step, batch, (batch_idx, *args))

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate(self.module.test_step, batch, (batch_idx, *args))

    def predict_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._evaluate(self.module.predict_step, batch, (batch_idx, *args))

    def _evaluate(self, step_fn: Callable, batch: Any, step_args: tuple) -> Any:
        if step_fn.__name__ in self.generating:
            return self._relayed(step_fn, batch, step_args)
        return self._run(step_fn, batch, step_args, None)

    def _relayed(self, step_fn: Callable, batch: Any, step_args: tuple) -> Any:
        """The user's step on the whole batch, on every rank, each forward run by all the pipeline's ranks
        together (``relay``): every rank returns, and logs, what one device's step would. Torchmetrics
        updates stay on the last stage's rank, as in a pipelined step."""
        if self.link is None:
            raise RuntimeError("PipelineEngine.partition() must run before the first step")
        if self.relay is None or self.relay.device != self.link.device:
            self.relay = Relay(self.plan, self.mesh, self.link.device)
        relay = self.relay
        relay.agree_on_randomness()
        hooks = [self.module.get_submodule(name).register_forward_hook(relay.share(owner, values))
                 for names, owner, values in ((self.plan.pre, self.plan.rank_of_stage(0), False),
                                              (self.plan.post, relay.holder, True))
                 for name in names]
        self.runtime.device, self.runtime.relay = self.link.device, relay
        try:
            with ExitStack() as kept:
                if not relay.is_holder:
                    for metric in self.metrics:
                        kept.enter_context(untouched(metric))
                return step_fn(batch, *step_args)
        finally:
            self.runtime.relay = None
            relay.end()
            for hook in hooks:
                hook.remove()

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of parameters held by several stages over those stages.

        A stage that did not use such a parameter contributes zeros; if no stage produced a
        gradient it stays ``None``, as on one device (optimizers then skip it). A parameter sharded
        over the data-parallel replicas (ZeRO-2/3) is summed shard by shard: every stage of a
        pipeline shards it alike.
        """
        for param, group, _ in self.tied:
            grad = local_part(param.grad) if param.grad is not None else torch.zeros_like(local_part(param))
            flat = torch.cat([grad.reshape(-1), torch.ones(1, dtype=grad.dtype, device=grad.device) * (param.grad is not None)])
            dist.all_reduce(flat, group=group)
            if flat[-1] == 0:
                param.grad = None
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            local_part(param.grad).copy_(flat[:-1].view_as(grad))

    def replace_parameters(self, replaced: dict[nn.Parameter, nn.Parameter]) -> None:
        """Name ``replaced[p]`` wherever the engine named ``p`` (ZeRO-2/3 replaces the stage's parameters
        by sharded ones after ``partition``)."""
        self.tied = [(replaced.get(param, param), group, ranks) for param, group, ranks in self.tied]

    def is_counted_once(self, param: nn.Parameter) -> bool:
        """Whether this rank counts ``param`` in a global gradient norm (tied copies count once)."""
        for tied, _, ranks in self.tied:
            if tied is param:
                return self.mesh.pp_rank == ranks[0]
        return True

    # ---- execution --------------------------------------------------------------------------
    def _run(self, step_fn: Callable, batch: Any, step_args: tuple, loss_scale: Optional[float]) -> Any:
        if self.link is None:
            raise RuntimeError("PipelineEngine.partition() must run before the first step")
        micro, shares = split_batch(batch, self.micro_batches)
        training = loss_scale is not None
        rank_plan = self._schedule(len(micro), training)
        if self.randomness is None:  # on the device the stage computes on (known after materialising)
            self.randomness = StageRandomness(self._seed, self.mesh.pp_rank, self.link.device)
        # equal on every stage, which all see the same batch: micro-batches with one key give one shape
        keys = [(w, signature(m), training) for w, m in zip(shares, micro)]
        self.link.new_step()
        actions = rank_plan.actions
        step = StepState(micro, shares, step_fn, step_args, loss_scale, rank_plan.split)
        if self.mesh.pp_rank == self.plan.rank_of_stage(self.plan.num_stages - 1) and step.name in self.targets:
            # the targets' counts reach the host now, before this step's kernels queue behind the read
            self._loss_shares(step)
        run_at = {start: n for n, (start, _) in enumerate(rank_plan.runs)}
        with self.capture.recording():
            i = 0
            while i < len(actions):
                for index in [k for k in step.sending if rank_plan.delivered_by.get(k, len(actions)) < i]:
                    self._release(step.sending.pop(index))
                if i in run_at:
                    n = run_at[i]
                    self._communicate(actions, *rank_plan.runs[n], step, keys.__getitem__)
                    if n + 1 < len(rank_plan.runs):
                        start, stop = rank_plan.runs[n + 1]
                        self.link.receive_ahead(self._receives_ahead(actions[start:stop], step), keys.__getitem__)
                    i = rank_plan.runs[n][1]
                    continue
                final = rank_plan.completes_weights(i, self.split_backward) if training else None
                with self.final_weight_context(final) if final is not None else nullcontext():
                    self._compute(actions[i], step)
                i += 1
            for pending in step.sending.values():
                self._release(pending)
            self.runtime.forget_substitutions()
        return self._finish(step)

    def _compute(self, a: Action, step: StepState) -> None:
        """Run compute action ``a``: a forward, a backward (the input gradient alone where a W follows), a W."""
        last = self.plan.num_stages - 1
        t0 = time.perf_counter()
        slot = step.slot(a.microbatch, a.stage)
        if a.op is Op.F:
            self.capture.microbatch = a.microbatch
            received = slot.input
            if not step.training:
                slot.input = None  # kept for backward only
            learning = a.stage == last and step.name not in self.targets
            with CrossEntropyCalls() if learning else nullcontext() as losses:
                out = self._forward(a.stage, step.micro[a.microbatch], step.step_fn, step.step_args, received,
                                    slot.convention, step.training)
            if learning:
                self._learn(step.name, losses.calls, step.micro[a.microbatch], out, self.capture.logged(a.microbatch),
                            step.micro, True)
            if a.stage == last:
                step.results[a.microbatch] = out
            else:
                slot.output, step.slot(a.microbatch, a.stage + 1).convention = out
                slot.output_like = (out[0].shape, out[0].dtype)
                if self.meter:
                    self.meter.add(out[0].untyped_storage().nbytes())
        elif a.op is Op.B:
            received, slot.input = slot.input, None
            grad, slot.weight_pass = self._backward(a, step, received)
            if received is not None:
                slot.input_grad = grad
        else:
            weight_pass, slot.weight_pass = slot.weight_pass, None  # none where the backward could not be split
            if weight_pass is not None:
                weight_pass()
        self._record(a, t0)

    def _forward(self, stage, micro_batch, step_fn, step_args, received, convention, training):
        if received is not None and training:
            received.requires_grad_()
        last = stage == self.plan.num_stages - 1
        self.runtime.device = self.link.device
        self.runtime.begin(self.plan.stage_blocks[stage], not last, received, convention or 0, training)
        self.runtime.stage = stage
        tracking = self.meter.tracking() if self.meter and training else nullcontext()
        try:
            with tracking, self.randomness.active() if self.randomness else nullcontext(), ExitStack() as kept:
                if not last:
                    for metric in self.metrics:
                        kept.enter_context(untouched(metric))
                result = step_fn(micro_batch, *step_args)
        except StageExit as exit_:
            return exit_.hidden, self.runtime.convention
        finally:
            self.runtime.end()
        if not last and not self.runtime.blocks_started:
            raise PipelineConfigError(
                f"{getattr(step_fn, '__name__', 'the step')} returned {type(result).__name__} on pipeline stage "
                f"{stage} before the model's blocks ran. Under pipeline parallelism every stage runs every "
                "micro-batch through its blocks, so a step cannot be skipped by returning early (Lightning's "
                "return None); filter such batches in the DataLoader (a collate_fn or sampler) instead"
            )
        if not last:
            raise RuntimeError(
                f"forward completed on pipeline stage {stage} of {self.plan.num_stages}: the block after it "
                f"({self.plan.stage_blocks[stage].stop}) was never called"
            )
        return result

    def _record(self, a: Action, start: float) -> None:
        if self.timeline is not None:
            # perf_counter is the system's monotonic clock, comparable across local processes
            self.timeline.append(Interval(self.mesh.pp_rank, a.op, a.microbatch, a.stage, start, time.perf_counter()))

    def _backward(self, a: Action, step: StepState, received: Optional[torch.Tensor]):
        """Back-propagate micro-batch ``a.microbatch`` through stage ``a.stage``; returns ``(input_grad, weight_pass)``.

        Where a W follows (``step.split``), compute only the input gradient now and return the weight pass
        (``backward_split``; on the first stage, which has no input gradient, the weight pass is
        the whole backward). A graph that refuses a partial backward (reentrant activation
        checkpointing), or that recomputes forwards during backward (non-reentrant checkpointing,
        which would recompute once more in the weight pass), makes this and every later backward
        whole; W then has nothing left to do.
        """
        mb, slot = a.microbatch, step.slot(a.microbatch, a.stage)
        if a.stage == self.plan.num_stages - 1:
            result = step.results[mb]
            loss = result["loss"] if isinstance(result, dict) else result
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise PipelineConfigError(
                    "training_step must return a loss tensor that requires grad (or a dict with 'loss') under "
                    f"pipeline parallelism, got {type(result).__name__}"
                )
            root = loss * (self._loss_shares(step)[mb] * step.loss_scale)
            roots, root_grads = (root,), (torch.ones_like(root),)
            step.results[mb] = loss.detach()  # the graph's nodes would keep tensors alive until the step ends
            if isinstance(result, dict) and len(result) > 1:  # on_train_batch_end sees them, as on one device
                step.extras[mb] = tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v,
                                           {k: v for k, v in result.items() if k != "loss"})
        else:
            # the output's storage was released after sending; run the engine on its graph directly
            roots, root_grads = (slot.output,), (slot.output_grad,)
            slot.output = slot.output_grad = None
        if a.unit in step.split and self.split_backward:
            try:
                grad, weight_pass = backward_input(roots, root_grads, received)
            except SplitUnsupported:
                self.split_backward = False
            else:
                self.split_backward = not weight_pass.recomputed
                return grad, weight_pass
        autograd_engine().run_backward(roots, root_grads, False, False, (), True, True)
        if received is None:
            return None, None
        return (received.grad if received.grad is not None else torch.zeros_like(received)), None

    def _communicate(self, actions: list[Action], start: int, stop: int, step: StepState, key_of) -> None:
        """Post one run of communication actions; a neighbouring stage on this rank gets its tensor directly."""
        here, messages, sends = self.mesh.pp_rank, [], []
        for index in range(start, stop):
            a = actions[index]
            slot = step.slot(a.microbatch, a.stage)
            if a.op is Op.SEND_F:
                out, nxt = slot.output, step.slot(a.microbatch, a.stage + 1)
                if not out.requires_grad:  # evaluation keeps nothing
                    slot.output = None
                if self.plan.rank_of_stage(a.stage + 1) == here:
                    nxt.input = out.detach()
                    if self.meter:  # from now on the next stage's saved tensors count it
                        self.meter.add(-out.untyped_storage().nbytes())
                    continue
                sends.append((index, Message(a, out, nxt.convention)))
            elif a.op is Op.SEND_B:
                grad, slot.input_grad = slot.input_grad, None
                if self.plan.rank_of_stage(a.stage - 1) == here:
                    step.slot(a.microbatch, a.stage - 1).output_grad = grad
                    continue
                sends.append((index, Message(a, grad)))
            elif a.op is Op.RECV_F:
                if self.plan.rank_of_stage(a.stage - 1) != here:
                    messages.append(Message(a))
            else:
                like, slot.output_like = slot.output_like, None
                if self.plan.rank_of_stage(a.stage + 1) != here:
                    messages.append(Message(a, like=like))
        messages += [m for _, m in sends]
        self.link.exchange(messages, key_of)
        for m in messages:
            slot = step.slot(m.action.microbatch, m.action.stage)
            if m.action.op is Op.RECV_F:
                slot.input, slot.convention = m.tensor, m.convention
            elif m.action.op is Op.RECV_B:
                slot.output_grad = m.tensor
        for index, m in sends:
            tensor, is_output = m.tensor, m.action.op is Op.SEND_F
            nbytes = tensor.untyped_storage().nbytes()
            if is_output and tensor.requires_grad:
                # keep only the graph; the send holds the storage until it is waited on
                tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device)
            step.sending[index] = PendingSend(m.works, nbytes if is_output else 0)

    def _receives_ahead(self, actions: list[Action], step: StepState) -> list[Message]:
        """The receives from another rank among ``actions`` (the next run of communication) that could be
        posted now: hidden states, and the gradients of outputs already computed."""
        here, messages = self.mesh.pp_rank, []
        for a in actions:
            if a.op is Op.RECV_F and self.plan.rank_of_stage(a.stage - 1) != here:
                messages.append(Message(a))
            elif a.op is Op.RECV_B and self.plan.rank_of_stage(a.stage + 1) != here:
                like = step.slot(a.microbatch, a.stage).output_like
                if like is not None:
                    messages.append(Message(a, like=like))
        return messages

    def _release(self, pending: PendingSend) -> None:
        """Wait for a delivered send, so its buffer is freed."""
        for work in pending.works:
            work.wait()
        if self.meter and pending.nbytes:
            self.meter.add(-pending.nbytes)

    def _loss_shares(self, step: StepState) -> list[float]:
        """Each micro-batch's weight in the batch's loss: its share of the targets where the loss is learnt to
        be a cross-entropy mean over targets of the batch (``targets``), else of the samples. Asked on the
        last stage only, after its first forward of the step (which learns it if the setup could not)."""
        if step.loss_shares is None:
            learnt = self.targets.get(step.name)
            step.loss_shares = (learnt.shares(step.micro) if isinstance(learnt, TargetCount) else None) or step.shares
        return step.loss_shares

    def _finish(self, step: StepState) -> Any:
        """Broadcast the last stage's loss (or outputs) and log records; replay the logs everywhere.

        Training returns the batch's loss, or ``{"loss": ..., **extras}`` where ``training_step``
        returned more keys; evaluation returns the step's outputs merged over the micro-batches
        (``microbatch.merge_outputs``: what one call on the whole batch would have returned). The loss,
        and the logged values learnt to be the loss, combine with the loss's shares; other logged means
        with the samples' shares.
        """
        mesh, training = self.mesh, step.training
        payload: Any = None
        holder = self.plan.rank_of_stage(self.plan.num_stages - 1)  # the rank of the last stage
        if mesh.pp_rank == holder:
            learnt = self.targets.get(step.name)
            as_loss = learnt.logged if isinstance(learnt, TargetCount) else frozenset()
            loss_shares = self._loss_shares(step)
            records = self.capture.records(lambda name, mb: (loss_shares if name in as_loss else step.shares)[mb])
            if training:
                payload = (step.batch_loss(loss_shares), records, step.merged_extras())
            else:
                payload = (step.merged_results(), records, None)
        if mesh.pp_size > 1:
            payload = broadcast_object(payload, mesh.stage_rank(holder), mesh.pp_group, self.link.device,
                                       mesh.pp_rank == holder)
        value, records, extras = payload
        replay(self.module, records)
        if not training:
            return value
        device = next(self.module.parameters()).device
        loss = value.to(device)
        if extras is None:
            return loss
        return {"loss": loss, **tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, extras)}
