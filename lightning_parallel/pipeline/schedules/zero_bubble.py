"""Zero-bubble pipeline schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241).

A backward is split into ``B``, the input gradient the previous stage waits for, and ``W``, the
weight gradients nobody waits for (``backward_split``). ``B`` alone is on the critical path, and
each ``W`` can be moved into a gap where the rank would otherwise idle. With ``F``, ``B`` and
``W`` of equal cost:

* ``zb_h1`` (the paper's ZB-H1, §2.1): 1F1B with the ``W`` of rank ``r`` running ``r``
  micro-batches behind its ``B``. Every rank then keeps ``P`` micro-batches in flight, the number
  1F1B keeps on rank 0, so the peak over ranks is 1F1B's (the paper's "same as 1F1B"; the
  gradients a waiting ``W`` keeps come on top, see ``backward_split``); the bubble drops from
  ``(P - 1)(F + B + W)`` to ``(P - 1)(F + B - W)`` per rank, a third of it.
* ``zbv`` (ZB-V, §4): two chunks per rank in a V (rank ``r`` holds stages ``r`` and ``2P - 1 - r``,
  see ``placement``), so the first and last stage sit on one rank and a micro-batch's backward
  starts on the rank its forward began on. With at least ``2P - 1`` micro-batches its bubble is
  close to zero at 1F1B's activation memory (``2P`` half-stage chunks in flight on rank 0).
* ``dualpipev`` (DeepSeek-AI 2024, DeepSeek-V3 report arXiv 2412.19437 §3.2.1, and the DualPipeV
  "cut-in-half" variant of deepseek-ai/DualPipe): the same V placement, a steady state that pairs
  the forward of one chunk with the backward of the other (made to overlap computation with the
  all-to-all of expert parallelism on a GPU; here the pair runs one after the other) and whole
  backwards there, and split backwards only in the ramps, their weight passes taken in order
  from one queue. Needs at least ``2P`` micro-batches.

``defer_last_weight_pass`` applies the same split to the one backward of any schedule that no
other action waits behind: the last of a rank.
"""

from __future__ import annotations

from lightning_parallel.pipeline.errors import PipelineConfigError
from lightning_parallel.pipeline.schedules.actions import (
    Action,
    Op,
    backward_actions,
    check_sizes,
    forward_actions,
)


def schedule_zb_h1(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B's warm-up and steady state on ``B``; each ``W`` lags its ``B`` by ``rank`` micro-batches."""
    check_sizes(stages, micro_batches, rank)
    warmup = min(stages - rank - 1, micro_batches)
    acts: list[Action] = []
    deferred: list[int] = []  # micro-batches whose B ran and whose W has not

    def backward(mb: int, lag: int) -> None:
        nonlocal acts
        acts += backward_actions(mb, rank, stages)
        deferred.append(mb)
        if len(deferred) > lag:
            acts.append(Action(Op.W, deferred.pop(0), rank))

    # warm-up: fill the pipeline, as 1F1B
    for mb in range(warmup):
        acts += forward_actions(mb, rank, stages)
    # steady state: one forward, one input-gradient pass, the weight pass of `rank` micro-batches ago
    for i in range(micro_batches - warmup):
        acts += forward_actions(warmup + i, rank, stages)
        backward(i, rank)
    # cool-down: the remaining input gradients, each followed by a deferred weight pass that fills
    # the wait for the next gradient; then the weight passes still owed
    for mb in range(micro_batches - warmup, micro_batches):
        backward(mb, 0)
    acts += [Action(Op.W, mb, rank) for mb in deferred]
    return acts


def schedule_zbv(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """ZB-V on ``stages`` ranks holding ``2 * stages`` stages in a V.

    The order follows the paper's Figure 8 with ``F = B = W``: chunk 0 (stage ``rank``) is filled
    first, deeper on the ranks that start the V; chunk 1 (stage ``2P - 1 - rank``) then alternates
    with it, one forward, one input gradient and one weight pass per chunk in the steady state; the
    cool-down sends the remaining input gradients first and fills the waits with weight passes.
    Fewer than ``2P - 1`` micro-batches: the order of ``2P - 1`` with the missing ones left out.
    """
    check_sizes(stages, micro_batches, rank, 2)
    total = 2 * stages
    down, up = rank, total - 1 - rank
    padded = max(micro_batches, 2 * stages - 1)
    done = {(op, s): 0 for op in (Op.F, Op.B, Op.W) for s in (down, up)}  # how many of each op each chunk has run
    order: list[tuple[Op, int]] = []

    def run(op: Op, stage: int) -> None:
        order.append((op, stage))
        done[(op, stage)] += 1

    for _ in range(2 * (stages - rank) - 1):  # warm-up, chunk 0 only
        run(Op.F, down)
    for _ in range(rank):  # chunk 1's first micro-batches arrive: alternate
        run(Op.F, up)
        run(Op.F, down)
    for _ in range(stages - rank):  # chunk 1 turns around at the V's bottom: its backward starts
        for op in (Op.F, Op.B, Op.W):
            run(op, up)
    while done[(Op.F, up)] < padded:  # steady state
        if done[(Op.F, down)] < padded:
            run(Op.F, down)
        for op in (Op.B, Op.W):
            run(op, down)
        for op in (Op.F, Op.B, Op.W):
            run(op, up)
    for _ in range(rank):  # cool-down: input gradients first
        run(Op.B, down)
        run(Op.B, up)
    for _ in range(stages - rank):
        run(Op.B, down)
        run(Op.W, down)
    for stage in (up, down):
        while done[(Op.W, stage)] < done[(Op.B, stage)]:
            run(Op.W, stage)
    return _with_messages(order, micro_batches, total)


def _with_messages(order: list[tuple[Op, int]], micro_batches: int, total: int) -> list[Action]:
    """Compute ops ``(op, stage)`` in order, each on that stage's next micro-batch, with their receives
    and sends; micro-batches from ``micro_batches`` on are left out. A ``W`` names its micro-batch
    (``(op, stage, mb)``) where weight passes leave the order of their backwards."""
    acts: list[Action] = []
    count: dict = {}
    for op, stage, *given in order:
        mb = given[0] if given else count.get((op, stage), 0)
        count[(op, stage)] = mb + 1
        if mb >= micro_batches:
            continue
        if op is Op.F:
            acts += forward_actions(mb, stage, total)
        elif op is Op.B:
            acts += backward_actions(mb, stage, total)
        else:
            acts.append(Action(Op.W, mb, stage))
    return acts


def schedule_dualpipev(stages: int, micro_batches: int, rank: int) -> list[Action]:
    """DualPipeV on ``stages`` ranks holding ``2 * stages`` stages in a V (rank r: r and 2P - 1 - r).

    Eight phases, as in DeepSeek's DualPipeV: fill chunk 0; alternate the chunks' forwards; start
    chunk 1's backwards with split ones (their weight passes fill gaps); the steady state of
    (forward chunk 0, whole backward chunk 1) and (forward chunk 1, whole backward chunk 0) pairs;
    drain chunk 0's forwards; then the backwards of both chunks, split from the middle of the rank's
    share on, with the queued weight passes filling the waits of the cool-down.
    """
    check_sizes(stages, micro_batches, rank, 2)
    if micro_batches < 2 * stages:
        raise PipelineConfigError(
            f"dualpipev needs at least 2 x {stages} pipeline stages = {2 * stages} micro-batches, got "
            f"{micro_batches}; use micro_batches={2 * stages} or schedule='zbv'"
        )
    total = 2 * stages
    down, up = rank, total - 1 - rank
    order: list[tuple] = []
    backwards = {down: 0, up: 0}
    queue: list[tuple[int, int]] = []  # (stage, micro-batch) whose weight pass is still owed, oldest first

    def forward(stage: int) -> None:
        order.append((Op.F, stage))

    def backward(stage: int, split: bool) -> None:
        order.append((Op.B, stage))
        if split:
            queue.append((stage, backwards[stage]))
        backwards[stage] += 1

    def weight_pass() -> None:
        if queue:
            stage, mb = queue.pop(0)
            order.append((Op.W, stage, mb))

    for _ in range(2 * (stages - rank - 1)):  # 1: chunk 0 fills the V's first half
        forward(down)
    for _ in range(rank + 1):  # 2: both chunks' forwards, alternating
        forward(down)
        forward(up)
    for _ in range(stages - rank - 1):  # 3: chunk 1's backwards begin, split
        backward(up, True)
        weight_pass()
        forward(up)
    for _ in range(micro_batches - total + rank + 1):  # 4: steady state, forward and backward paired
        forward(down)
        backward(up, False)
        forward(up)
        backward(down, False)
    for _ in range(stages - rank - 1):  # 5: chunk 0 has no forward left
        backward(up, False)
        forward(up)
        backward(down, False)
    split = False
    for i in range(rank + 1):  # 6: both chunks' backwards; split from the middle of this phase on
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(up, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(down, split)
    for _ in range(stages - rank - 1):  # 7: chunk 0's last backwards, weight passes in the waits
        weight_pass()
        backward(down, split)
    while queue:  # 8: the weight passes still owed
        weight_pass()
    return _with_messages(order, micro_batches, total)


def defer_last_weight_pass(actions: list[Action]) -> list[Action]:
    """A schedule without weight passes, with its rank's last backward split: ``W`` at the very end.

    Where the last backward has an input gradient to send (stage > 0), its ``B`` now computes only
    that gradient, which leaves before the weight gradients are computed, so the earlier stages
    start their own last backward that much sooner and the flush at the end of the step shrinks
    by the weight-gradient work of every later stage (the backward split of Qi et al. 2023, arXiv
    2401.10241, applied to the one backward no other action waits behind).
    """
    if any(a.op is Op.W for a in actions):
        return actions
    last = max((i for i, a in enumerate(actions) if a.op is Op.B), default=None)
    if last is None or actions[last].stage == 0:
        return actions
    return actions + [Action(Op.W, actions[last].microbatch, actions[last].stage)]
