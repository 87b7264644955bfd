"""Weight each micro-batch's loss by its share of the batch's targets when the loss is a mean over targets.

One device averages a language model's cross-entropy over the batch's real targets: the tokens whose
label is not the ignore index (Hugging Face collators put -100 on padding, prompts, unmasked tokens).
Micro-batches of one batch hold different numbers of such targets, so the mean of their means,
weighted by samples, is not that loss; weighted by their shares of the targets ``n_i / N`` it is,
gradients included (``sum_i (n_i / N) (S_i / n_i) = S / N``, ``S_i`` the micro-batch's summed loss).

How the counts are found. One forward of the user's step, on one micro-batch with real values, runs
under ``CrossEntropyCalls``: a ``TorchFunctionMode`` that sees every ``F.cross_entropy`` and
``F.nll_loss`` call however the code reaches it (Hugging Face's loss functions,
``nn.CrossEntropyLoss``, the user's own call). When the step made exactly one such call, averaged
(``reduction="mean"``, no class weights), with integer targets equal to a tensor of the batch as it
is (masked LMs, labels shifted by the collator) or shifted by one position along its last dimension
(causal LMs that shift inside the model: Hugging Face pads then shifts, nanoGPT-style code slices),
``learn`` returns a ``TargetCount``: where that tensor is in the batch, the shift and the ignore
index. From then on each step counts every micro-batch's targets from the batch itself, before any
forward runs, as every schedule needs: under 1F1B the last stage runs micro-batch 1's backward
before micro-batch M's forward.

Where the rule cannot be learnt (several or no cross-entropy calls, a summed or class-weighted one,
targets computed inside the step), the pipeline keeps weighting by samples; ``padding_hint`` tells
when a batch looks as if that matters (ignore indices, a padding mask), for a warning at setup. A
model on the meta device runs its setup trace without values: there ``unfit`` tells from the calls
alone whether the loss can be counted, and the targets are learnt in the first real step.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode

from lightning_parallel.pipeline.microbatch import batch_size

_LOSSES = (F.cross_entropy, F.nll_loss)
IGNORE_INDEX = -100  # the Hugging Face and PyTorch default


@dataclasses.dataclass
class LossCall:
    """One ``cross_entropy`` / ``nll_loss`` call: its target, ignore index, reduction, class weights, result."""

    target: torch.Tensor
    ignore_index: int
    reduction: str
    weighted: bool
    output: torch.Tensor


class CrossEntropyCalls(TorchFunctionMode):
    """Inside, every ``F.cross_entropy`` / ``F.nll_loss`` call is recorded in ``calls`` (the call itself
    runs unchanged; calls nested inside one are not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[LossCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _LOSSES:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            reduction = a["reduction"]
            if a["size_average"] is not None or a["reduce"] is not None:  # the deprecated spelling
                reduction = _reduction.legacy_get_string(a["size_average"], a["reduce"])
            self.calls.append(LossCall(a["target"], a["ignore_index"], reduction, a["weight"] is not None, out))
        return out


@dataclasses.dataclass(frozen=True)
class TargetCount:
    """Where a step's cross-entropy targets are in its batch: the tensor at ``path`` (keys and indices from
    the batch down), from position ``shift`` of its last dimension on, entries other than ``ignore_index``.

    ``logged``: the names the step logs the loss under (their values equalled the loss when learnt), whose
    values combine over micro-batches like the loss.
    """

    path: tuple
    shift: int
    ignore_index: int
    logged: frozenset = frozenset()

    def targets(self, micro_batch: Any) -> torch.Tensor:
        """The number of targets in ``micro_batch`` (a 0-dim tensor where the batch is)."""
        labels = _at(micro_batch, self.path)
        return (labels[..., self.shift:] != self.ignore_index).sum()

    def shares(self, micro_batches: list) -> Optional[list[float]]:
        """Each micro-batch's share of the targets ``n_i / N``; None when the batch has none (one device's
        loss is then NaN, with zero gradients, and sample shares give the same)."""
        counts = torch.stack([self.targets(m) for m in micro_batches]).tolist()  # one copy to the host
        total = sum(counts)
        return [n / total for n in counts] if total else None


def learn(calls: list[LossCall], micro_batch: Any, loss: Optional[torch.Tensor], logged: list[tuple[str, Any]],
          batches: Optional[list] = None) -> Union[TargetCount, str]:
    """The ``TargetCount`` of a step from what it did on ``micro_batch``: its cross-entropy ``calls``, the
    ``loss`` it returned (None outside training) and the ``(name, value)`` pairs it logged; or, where the
    loss is not one cross-entropy mean over targets of the batch, why not (a phrase). ``batches`` (default:
    ``micro_batch``), batches of the same structure, decide between tensors that all match the targets."""
    reason = unfit(calls)
    if reason:
        return reason
    call = calls[0]
    found = _locate(call.target, call.ignore_index, micro_batch, batches or [micro_batch])
    if found is None:
        return ("its cross-entropy targets are no tensor of the batch (as they are, or shifted by one position "
                "along the last dimension)")
    if loss is not None and not _follows(loss, call.output):
        return "the loss it returns does not depend on its cross-entropy"
    value = call.output.detach()
    names = frozenset(name for name, v in logged
                      if _equal(v, value) or (loss is not None and _equal(v, loss.detach())))
    return TargetCount(*found, call.ignore_index, names)


def unfit(calls: list[LossCall]) -> Optional[str]:
    """Why ``calls`` do not show a loss averaged over targets (what a meta-device run can tell), or None."""
    if not calls:
        return "it computes no torch.nn.functional.cross_entropy or nll_loss"
    if len(calls) > 1:
        return f"it computes {len(calls)} cross-entropy losses (which one the loss is cannot be told)"
    call = calls[0]
    if call.reduction != "mean":
        return f"its cross-entropy is reduced with reduction={call.reduction!r} (normalised by the step itself)"
    if call.weighted:
        return "its cross-entropy weighs classes (weight=...)"
    if call.target.is_floating_point():
        return "its cross-entropy targets are probabilities"
    return None


def padding_hint(batch: Any) -> Optional[str]:
    """What in ``batch`` suggests micro-batches of uneven target counts: an integer tensor holding the
    ignore index -100, or a mask (a key with "mask" in its name) with zeros; None if nothing does."""
    for path, t in _leaves(batch):
        if t.is_floating_point() or t.is_complex() or t.dim() == 0:
            continue
        if t.dtype != torch.bool and bool((t == IGNORE_INDEX).any()):
            return f"{_name(path)} holds {IGNORE_INDEX}"
        if path and "mask" in str(path[-1]).lower() and bool((t == 0).any()):
            return f"{_name(path)} marks padding"
    return None


def _leaves(batch: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(batch, (tuple, list)):
        for i, value in enumerate(batch):
            yield from _leaves(value, path + (i,))


def _at(batch: Any, path: tuple) -> torch.Tensor:
    for key in path:
        batch = batch[key]
    return batch


def _name(path: tuple) -> str:
    return "batch" + "".join(f"[{key!r}]" for key in path)


def _locate(target: torch.Tensor, ignore_index: int, micro_batch: Any, batches: list) -> Optional[tuple[tuple, int]]:
    """``(path, shift)`` of the batch tensor ``target`` was made from: element for element equal to it as it
    is (shift 0), or from position 1 of its last dimension on, with or without the ignore index appended
    (shift 1).

    Several tensors match where the ignore index does not occur in ``micro_batch`` (``input_ids`` equals
    ``labels`` in a sample without padding). Then the one that holds the ignore index somewhere in
    ``batches`` is taken (token ids never equal it), else the last in the batch's order (targets follow
    inputs: ``(x, y)``, Hugging Face's ``labels`` after ``input_ids``).
    """
    found = list(_matches(target, ignore_index, micro_batch))
    if not found:
        return None
    holding = [f for f in found if any(bool((_at(b, f[0]) == ignore_index).any()) for b in batches)]
    return (holding or found)[-1]


def _matches(target: torch.Tensor, ignore_index: int, micro_batch: Any) -> Iterator[tuple[tuple, int]]:
    """Integer tensors of ``micro_batch`` with a row per sample (so that every micro-batch has its own rows
    there, not one sample's entry of a per-sample list) that ``target`` was made from, with their shift."""
    flat = target.reshape(-1)
    samples = batch_size(micro_batch)
    for path, t in _leaves(micro_batch):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool or t.dim() == 0 or t.shape[0] != samples:
            continue
        t = t.to(target.device)
        forms = [(0, t)]
        if t.dim() >= 2:
            forms += [(1, t[..., 1:]), (1, F.pad(t[..., 1:], (0, 1), value=ignore_index))]
        for shift, form in forms:
            if form.numel() == flat.numel() and torch.equal(form.reshape(-1).to(flat.dtype), flat):
                yield path, shift
                break


def _follows(loss: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether ``loss`` is ``output`` or computed from it (found in its autograd graph)."""
    if loss is output:
        return True
    if loss.grad_fn is None or output.grad_fn is None:  # no graph to search
        return _equal(loss.detach(), output.detach())
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        if node is output.grad_fn:
            return True
        seen.add(id(node))
        todo.extend(n for n, _ in node.next_functions)
    return False


def _equal(value: Any, reference: torch.Tensor) -> bool:
    """Whether a logged value (tensor or number) is the 0-dim ``reference``'s value."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.detach().reshape(()).to(reference) == reference)
    return isinstance(value, (int, float)) and float(value) == float(reference)
