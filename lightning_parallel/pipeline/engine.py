"""Run one Lightning step of an unchanged LightningModule as a pipeline of stages.

``PipelineEngine`` is what the strategy drives: ``partition(example)`` once in ``setup`` (before
the optimizers exist; the example batch shows in which order the model's modules run, see
``order``), then ``training_step`` / ``validation_step`` / ... per batch, and
``sync_tied_grads`` before clipping and the optimizer step. Each training step splits the batch
into micro-batches (fewer when the batch has fewer samples) and executes this rank's action list
from ``schedules`` (GPipe, 1F1B or interleaved 1F1B). Forwards draw random numbers from the stage's
own stream (``randomness``). A forward action calls the user's own ``training_step`` on the micro-batch; the
stand-ins of ``stage_modules`` make it compute only this stage's blocks and stop at the stage
boundary. A backward action back-propagates the received gradient (or, on the last stage, the
loss scaled once by ``loss_scale`` times the micro-batch's share of the batch). After a forward
output is sent its storage is released, keeping only the autograd graph (Megatron-LM's
``deallocate_output_tensor``), and backward then runs through the autograd engine directly. The
hidden-state receives of the next exchange are posted as soon as their shapes are known (``p2p``),
and a rank's last backward sends its input gradient before computing its weight gradients
(``_backward``), which shortens the flush at the end of the step.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_parallel.compat import autograd_engine
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.pipeline.broadcast import broadcast_object
from lightning_parallel.pipeline.errors import PipelineConfigError, PipelineIncompatibleModel
from lightning_parallel.pipeline.isolation import untouched
from lightning_parallel.pipeline.logs import LogCapture, replay
from lightning_parallel.pipeline.meta_trace import meta_batch, meta_device
from lightning_parallel.pipeline.memory import ActivationMeter
from lightning_parallel.pipeline.microbatch import signature, split_batch
from lightning_parallel.pipeline.order import RunOrder, trace_run_order, traced_conditions
from lightning_parallel.pipeline.p2p import StageLink
from lightning_parallel.pipeline.partition import plan_stages, shared_parameters
from lightning_parallel.pipeline.schedules import (
    SCHEDULES,
    all_ranks,
    communication_runs,
    last_input_backward,
    schedule_forward_only,
    send_completion_points,
    validate,
)
from lightning_parallel.pipeline.randomness import StageRandomness
from lightning_parallel.pipeline.simulator import Interval
from lightning_parallel.pipeline.stage_modules import StageExit, StageRuntime, apply_stage_plan


def _floating(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _floating(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _floating(v)]
    return []


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to rounding: the stage runs the very operations of the traced forward; a value taken
    from a stand-in instead differs at the scale of the values themselves."""
    low = want.dtype in (torch.float16, torch.bfloat16)
    return got.shape == want.shape and torch.allclose(got.float().cpu(), want.float().cpu(), rtol=3e-2 if low else 1e-3,
                                                      atol=1e-3 if low else 1e-5)


class PipelineEngine:
    """Pipeline execution of ``module`` over the pipeline group of ``mesh``.

    Args:
        module: the LightningModule, identical on every rank until ``partition()``.
        mesh: the process mesh; its groups must exist before ``partition()``.
        micro_batches: micro-batches per step (each batch is split along dim 0).
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved_1f1b"``.
        virtual_stages: model chunks per rank (interleaved_1f1b only).
        blocks: path of the block list (e.g. ``"model.layers"``); found automatically if None.
        layout: blocks per stage (``pipeline_parallel x virtual_stages`` entries); balanced by
            parameter count if None.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: ParallelMesh,
        micro_batches: int,
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        blocks: Optional[str] = None,
        layout: Optional[list[int]] = None,
    ):
        if schedule not in SCHEDULES:
            raise PipelineConfigError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise PipelineConfigError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.module, self.mesh = module, mesh
        self.micro_batches, self.schedule_name, self.virtual_stages = micro_batches, schedule, virtual_stages
        validate(all_ranks(schedule, mesh.pp_size, micro_batches, virtual_stages), micro_batches)
        self.layout = layout
        self.plan = plan_stages(module, mesh.pp_size, virtual_stages, blocks, layout)
        self.runtime = StageRuntime()
        self.capture = LogCapture(module)
        self.tied: list[tuple[nn.Parameter, Any, tuple[int, ...]]] = []
        self.meter: Optional[ActivationMeter] = None
        self.timeline: Optional[list[Interval]] = None
        self.link: Optional[StageLink] = None
        self.randomness: Optional[StageRandomness] = None
        self.input_grad_first = True  # see _backward
        self._schedules: dict[tuple[int, bool], tuple] = {}

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
        order is assumed and checked while training.
        """
        mesh, rank = self.mesh, self.mesh.pp_rank
        order = None
        on_meta = any(p.is_meta for p in self.module.parameters())
        if example is not None:
            micro = split_batch(example, self.micro_batches)[0][0]
            step_fn = getattr(self.module, step)
            order = self._trace(micro, step_fn, on_meta)
            if order is not None:
                self.plan = plan_stages(self.module, mesh.pp_size, self.virtual_stages, self.plan.blocks_path,
                                        self.layout, order)
        shared = shared_parameters(self.module, self.plan)
        params = dict(self.module.named_parameters())
        groups = mesh.stage_groups([ranks for _, ranks in shared])  # this pipeline's ranks only
        self.tied.extend((params[name], groups[ranks], ranks) for name, ranks in shared if rank in ranks)
        apply_stage_plan(self.module, self.plan, rank, self.runtime)
        device = next(self.module.parameters()).device
        self.link = StageLink(lambda s: mesh.stage_rank(s % mesh.pp_size), self.plan.num_stages, mesh.pp_group, device)
        self._seed = torch.initial_seed()
        if order is not None:
            with meta_device(self.module, on_meta):
                self._probe(order, meta_batch(micro) if on_meta else micro, step_fn, on_meta)

    def _trace(self, micro: Any, step_fn: Callable, on_meta: bool) -> Optional[RunOrder]:
        """``order.trace_run_order`` on ``micro``, on the meta device for a meta-device model; None where
        a meta-device run fails for any reason but the model's being unsplittable."""
        run = lambda: step_fn(meta_batch(micro) if on_meta else micro, 0)  # noqa: E731
        try:
            with untouched(self.module), self.capture.suppressed(), meta_device(self.module, on_meta):
                order = trace_run_order(self.module, self.plan.blocks_path, run)
        except PipelineIncompatibleModel:
            raise
        except Exception:  # noqa: BLE001 - data-dependent code (.item()) cannot run on meta tensors
            if not on_meta:
                raise
            return None
        return dataclasses.replace(order, deterministic=False) if on_meta else order  # no values to compare

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
                got = [out[0]] if stage < last else [t for t in _floating(out)]
                want = [order.inputs[blocks.stop]] if stage < last else list(order.results)
                what = f"the input of block {blocks.stop}" if stage < last else "the step's result"
                if len(got) != len(want) or not all(_close(g.detach(), w) for g, w in zip(got, want)):
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

    def _schedule(self, micro_batches: int, training: bool) -> tuple:
        """This rank's actions for a step of ``micro_batches``, with the points where its sends are known
        delivered and can be freed, its runs of communication actions and its last input backward."""
        key = (micro_batches, training)
        if key not in self._schedules:
            mesh, rank = self.mesh, self.mesh.pp_rank
            if training:
                if self.schedule_name == "interleaved_1f1b" and micro_batches % mesh.pp_size:
                    raise PipelineConfigError(
                        f"a batch split into {micro_batches} micro-batches (fewer samples than micro_batches="
                        f"{self.micro_batches}) cannot run interleaved_1f1b, which needs a multiple of the "
                        f"{mesh.pp_size} stages; use DataLoader(drop_last=True) or schedule='1f1b'"
                    )
                every = all_ranks(self.schedule_name, mesh.pp_size, micro_batches, self.virtual_stages)
            else:
                every = [schedule_forward_only(mesh.pp_size, micro_batches, r, self.virtual_stages)
                         for r in range(mesh.pp_size)]
            self._schedules[key] = (every[rank], send_completion_points(every)[rank], communication_runs(every[rank]),
                                    last_input_backward(every[rank]) if training else None)
        return self._schedules[key]

    # ---- the strategy's calls ---------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the batch's mean loss on every rank."""
        return self._run(self.module.training_step, batch, (batch_idx,), loss_scale)

    def validation_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._run(self.module.validation_step, batch, (batch_idx, *args), None)

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._run(self.module.test_step, batch, (batch_idx, *args), None)

    def predict_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        return self._run(self.module.predict_step, batch, (batch_idx, *args), None)

    def sync_tied_grads(self) -> None:
        """Sum the gradients of parameters held by several stages over those stages.

        A stage that did not use such a parameter contributes zeros; if no stage produced a
        gradient it stays ``None``, as on one device (optimizers then skip it).
        """
        for param, group, _ in self.tied:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            flat = torch.cat([grad.reshape(-1), torch.ones(1, dtype=grad.dtype, device=grad.device) * (param.grad is not None)])
            dist.all_reduce(flat, group=group)
            param.grad = flat[:-1].view_as(param) if flat[-1] > 0 else None

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
        micro, weights = split_batch(batch, self.micro_batches)
        training = loss_scale is not None
        schedule = self._schedule(len(micro), training)
        if self.randomness is None:  # on the device the stage computes on (known after materialising)
            self.randomness = StageRandomness(self._seed, self.mesh.pp_rank, self.link.device)
        # equal on every stage, which all see the same batch: micro-batches with one key give one shape
        keys = [(w, signature(m), training) for w, m in zip(weights, micro)]
        self.link.new_step()
        last = self.plan.num_stages - 1
        inputs: dict = {}  # (mb, stage) -> received hidden state
        conventions: dict = {}
        outputs: dict = {}  # (mb, stage) -> output kept for backward (storage released after send)
        out_meta: dict = {}
        grads: dict = {}  # (mb, stage) -> gradient of the output, received
        input_grads: dict = {}
        results: dict = {}  # mb -> what the user's step returned on the last stage
        actions, delivered_by, runs, split_at = schedule
        weight_pass = None  # the rest of the step's last backward, run after its input gradient is sent
        run_at = {start: n for n, (start, _) in enumerate(runs)}
        sending: dict = {}  # action index of a send -> (its works, bytes it keeps alive)
        with self.capture.recording():
            i = 0
            while i < len(actions):
                for index in [k for k in sending if delivered_by.get(k, len(actions)) < i]:
                    self._release(*sending.pop(index))
                if i in run_at:
                    n = run_at[i]
                    self._communicate(actions, *runs[n], outputs, out_meta, conventions, input_grads, inputs, grads,
                                      sending, keys.__getitem__)
                    if n + 1 < len(runs):
                        start, stop = runs[n + 1]
                        ahead = [(a.microbatch, a.stage) for a in actions[start:stop] if a.op == "recv_f"]
                        self.link.receive_ahead(ahead, keys.__getitem__)
                    i = runs[n][1]
                    continue
                a = actions[i]
                t0 = time.perf_counter()
                key = (a.microbatch, a.stage)
                if a.op == "F":
                    self.capture.weight = weights[a.microbatch]
                    received = inputs.get(key) if training else inputs.pop(key, None)  # kept for backward
                    out = self._forward(a.stage, micro[a.microbatch], step_fn, step_args, received,
                                        conventions.get(key), training)
                    if a.stage == last:
                        results[a.microbatch] = out
                    else:
                        outputs[key], conventions[(a.microbatch, a.stage + 1)] = out
                        out_meta[key] = (outputs[key].shape, outputs[key].dtype)
                        if self.meter:
                            self.meter.add(outputs[key].untyped_storage().nbytes())
                else:
                    received = inputs.pop(key) if a.stage > 0 else None
                    grad, weight_pass = self._backward(a.stage == last, results, outputs, grads, key,
                                                       weights[a.microbatch] * loss_scale, received if i == split_at else None)
                    if received is not None:
                        if grad is None:
                            grad = received.grad if received.grad is not None else torch.zeros_like(received)
                        input_grads[key] = grad
                self._record(a.op, a.microbatch, a.stage, t0)
                i += 1
            if weight_pass is not None:
                t0 = time.perf_counter()
                weight_pass()
                self._record("W", actions[split_at].microbatch, actions[split_at].stage, t0)
            for works, nbytes in sending.values():
                self._release(works, nbytes)
            self.runtime.forget_substitutions()
        return self._finish(results, weights, loss_scale is not None)

    def _forward(self, stage, micro_batch, step_fn, step_args, received, convention, training):
        if received is not None and training:
            received.requires_grad_()
        last = stage == self.plan.num_stages - 1
        self.runtime.device = self.link.device
        self.runtime.begin(self.plan.stage_blocks[stage], not last, received, convention or 0, training)
        tracking = self.meter.tracking() if self.meter and training else nullcontext()
        try:
            with tracking, self.randomness.active() if self.randomness else nullcontext():
                result = step_fn(micro_batch, *step_args)
        except StageExit as exit_:
            return exit_.hidden, self.runtime.convention
        finally:
            self.runtime.end()
        if not last:
            raise RuntimeError(
                f"forward completed on pipeline stage {stage} of {self.plan.num_stages}: the block after it "
                f"({self.plan.stage_blocks[stage].stop}) was never called"
            )
        return result

    def _record(self, op: str, microbatch: int, stage: int, start: float) -> None:
        if self.timeline is not None:
            # perf_counter is the system's monotonic clock, comparable across local processes
            self.timeline.append(Interval(self.mesh.pp_rank, op, microbatch, stage, start, time.perf_counter()))

    def _backward(self, is_last, results, outputs, grads, key, scale, received=None):
        """Back-propagate one micro-batch; returns ``(input_grad, weight_pass)``, both None unless split.

        Given ``received`` (the stage input, for the rank's last backward only), the gradient of the
        input is computed first, with the graph kept, and returned with the full backward as
        ``weight_pass``, which the caller runs once that gradient is on its way. The previous stage
        starts its own last backward that much earlier, so the cool-down of the flush shrinks by
        the weight-gradient work of every later stage, the idea of the backward split in Qi et al.
        2023 (Zero Bubble Pipeline Parallelism, arXiv 2401.10241). The weight pass repeats the
        input-gradient chain (and, under tensor parallelism, its collectives); it runs while the
        rank would otherwise wait for the earlier stages to finish the step.
        """
        if is_last:
            result = results[key[0]]
            loss = result["loss"] if isinstance(result, dict) else result
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                raise PipelineConfigError(
                    "training_step must return a loss tensor that requires grad (or a dict with 'loss') under "
                    f"pipeline parallelism, got {type(result).__name__}"
                )
            root = loss * scale
            roots, root_grads = (root,), (torch.ones_like(root),)
            results[key[0]] = loss.detach()  # the graph's nodes would keep tensors alive until the step ends
        else:
            # the output's storage was released after sending; run the engine on its graph directly
            roots, root_grads = (outputs.pop(key),), (grads.pop(key),)
        engine = autograd_engine()

        def full_backward() -> None:
            engine.run_backward(roots, root_grads, False, False, (), True, True)

        if received is not None and self.input_grad_first:
            try:
                (grad,) = engine.run_backward(roots, root_grads, True, False, (received,), True, False)
            except RuntimeError:  # e.g. reentrant activation checkpointing, which allows only .backward()
                self.input_grad_first = False
            else:
                return (grad if grad is not None else torch.zeros_like(received)), full_backward
        full_backward()
        return None, None

    def _communicate(self, actions, start, stop, outputs, out_meta, conventions, input_grads, inputs, grads, sending,
                     key_of):
        sends_f, sends_b, recvs_f, recvs_b = [], [], [], []
        send_f_at, send_b_at = [], []
        for index in range(start, stop):
            a = actions[index]
            key = (a.microbatch, a.stage)
            if a.op == "send_f":
                out = outputs[key] if outputs[key].requires_grad else outputs.pop(key)  # evaluation keeps nothing
                sends_f.append((a.microbatch, a.stage, out, conventions[(a.microbatch, a.stage + 1)]))
                send_f_at.append(index)
            elif a.op == "send_b":
                sends_b.append((a.microbatch, a.stage, input_grads.pop(key)))
                send_b_at.append(index)
            elif a.op == "recv_f":
                recvs_f.append(key)
            else:
                recvs_b.append((a.microbatch, a.stage, *out_meta.pop(key)))
        received, received_grads, works = self.link.exchange(sends_f, sends_b, recvs_f, recvs_b, key_of)
        for key, (tensor, convention) in received.items():
            inputs[key], conventions[key] = tensor, convention
        grads.update(received_grads)
        sent = [(out, True) for _, _, out, _ in sends_f] + [(grad, False) for _, _, grad in sends_b]
        for index, (tensor, is_output), send_works in zip(send_f_at + send_b_at, sent, works):
            nbytes = tensor.untyped_storage().nbytes()
            if is_output and tensor.requires_grad:
                # keep only the graph; the send holds the storage until it is waited on
                tensor.data = torch.empty(1, dtype=tensor.dtype, device=tensor.device)
            sending[index] = (send_works, nbytes if is_output else 0)

    def _release(self, works, nbytes: int) -> None:
        """Wait for a delivered send, so its buffer is freed."""
        for work in works:
            work.wait()
        if self.meter and nbytes:
            self.meter.add(-nbytes)

    def _finish(self, results: dict, weights: list[float], training: bool) -> Any:
        """Broadcast the last stage's loss (or outputs) and log records; replay the logs everywhere."""
        mesh = self.mesh
        payload: Any = None
        if mesh.is_last_stage:
            records = self.capture.records()
            if training:
                # at least float32 (a bf16 loss is summed in float32), float64 under ``64-true``
                value = sum(w * results[mb].to(torch.promote_types(results[mb].dtype, torch.float32)).cpu()
                            for mb, w in enumerate(weights))
            else:
                value = [results[mb] for mb in sorted(results)]
            payload = (value, records)
        if mesh.pp_size > 1:
            payload = broadcast_object(payload, mesh.stage_rank(mesh.pp_size - 1), mesh.pp_group, self.link.device,
                                       mesh.is_last_stage)
        value, records = payload
        replay(self.module, records)
        if training:
            return value.to(next(self.module.parameters()).device)
        if all(v is None for v in value):
            return None
        return value[0] if len(value) == 1 else value
