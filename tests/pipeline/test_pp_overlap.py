"""What keeps a pipelined step short: shapes learned once, receives posted ahead, the last input
gradient sent before the weight gradients. Each must leave training equal to one device."""

import warnings

import pytest
import torch

from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import Op, PipelineEngine, p2p
from tests.helpers.parity import assert_param_close
from tests.helpers.processes import make_mesh, run_distributed
from tests.pipeline.test_pp_training import (
    LOSS_TOL,
    PARAM_TOL,
    batches,
    gpt,
    single_device,
    train_pipeline,
)


def _mixed_shapes():
    """Two steps of 10 x 16 tokens (micro-batches 3, 3, 2, 2), then one of 10 x 8."""
    return batches(steps=2, batch=10) + [tuple(t[:, :8].contiguous() for t in batches(steps=1, batch=10)[0])]


def _headers(rank, world):
    warnings.filterwarnings("ignore")
    received = []
    recv_op = p2p.StageLink._recv_op

    def recording(self, kind, buf, mb, stage):
        received.append(kind)
        return recv_op(self, kind, buf, mb, stage)

    p2p.StageLink._recv_op = recording
    data, per_step = _mixed_shapes(), []
    model = gpt()
    engine = PipelineEngine(model, make_mesh(rank, world, pp=world), ParallelOptions(micro_batches=4, schedule="1f1b"))
    engine.partition()
    opt = model.configure_optimizers()
    losses = []
    for i, batch in enumerate(data):
        opt.zero_grad()
        losses.append(engine.training_step(batch, i).item())
        engine.sync_tied_grads()
        opt.step()
        per_step.append(received.count(p2p._ACT_HEADER))
        received.clear()
    return losses, per_step


@pytest.mark.timeout(60)
def test_shapes_are_learned_once_per_micro_batch_shape_and_kept_across_steps():
    reference, _ = single_device(gpt, _mixed_shapes())
    first, last = run_distributed(_headers, 2)
    assert first[1] == [0, 0, 0]  # the first stage receives no hidden states
    assert last[1] == [2, 0, 2]  # sizes 3 and 2 once; nothing new in step 2; the new length once
    for losses, _ in (first, last):
        assert losses == pytest.approx(reference, abs=LOSS_TOL)


def _ahead(rank, world, post_ahead):
    warnings.filterwarnings("ignore")
    posted = []
    ahead = p2p.StageLink.receive_ahead

    def recording(self, *args):
        self.post_ahead = post_ahead
        before = len(self.posted)
        ahead(self, *args)
        posted.append(len(self.posted) - before)
        return None

    p2p.StageLink.receive_ahead = recording
    losses, params = train_pipeline(make_mesh(rank, world, pp=world), gpt, batches(), 4, "1f1b")
    return losses, params, sum(posted)


@pytest.mark.timeout(60)
def test_receives_posted_ahead_train_exactly_as_receives_posted_with_their_exchange():
    ahead, plain = run_distributed(_ahead, 2, True), run_distributed(_ahead, 2, False)
    # the first stage: the gradients of micro-batches 0-3, the last stage: hidden states 1-3 of 4, in 3 steps
    assert [posted for _, _, posted in ahead] == [12, 9]
    assert [posted for _, _, posted in plain] == [0, 0]
    for (losses, params, _), (plain_losses, plain_params, _) in zip(ahead, plain):
        assert losses == plain_losses
        assert all((params[k] == plain_params[k]).all() for k in params)


def _order(rank, world):
    """Events on each rank: sends of the last micro-batch's input gradient, weight-gradient arrivals."""
    warnings.filterwarnings("ignore")
    model = gpt()
    engine = PipelineEngine(model, make_mesh(rank, world, pp=world), ParallelOptions(micro_batches=4, schedule="1f1b"))
    engine.partition()
    events = []
    exchange = engine.link.exchange

    def recording(messages, *args, **kwargs):
        events.extend(f"send_b{m.action.microbatch}" for m in messages if m.action.op is Op.SEND_B)
        return exchange(messages, *args, **kwargs)

    engine.link.exchange = recording
    weight = next(p for name, p in model.named_parameters() if ".h." in name)
    weight.register_post_accumulate_grad_hook(lambda p: events.append("weight_grad"))
    engine.timeline = []
    engine.training_step(batches(steps=1)[0], 0)
    return events, [(i.op, i.microbatch) for i in engine.timeline]


@pytest.mark.timeout(30)
def test_last_stage_sends_its_last_input_gradient_before_computing_weight_gradients():
    (first, first_ops), (last, last_ops) = run_distributed(_order, 2)
    # the first stage has no input gradient: four backwards, nothing split
    assert first == ["weight_grad"] * 4 and (Op.W, 3) not in first_ops
    # the last stage: micro-batches 0-2 as usual, then micro-batch 3's gradient leaves before its weight gradient
    assert last == ["weight_grad", "send_b0", "weight_grad", "send_b1", "weight_grad", "send_b2", "send_b3", "weight_grad"]
    assert last_ops[-2:] == [(Op.B, 3), (Op.W, 3)]


class RefusesInputGradients(torch.autograd.Function):
    """Identity whose backward, like reentrant activation checkpointing, works only under .backward()."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("this backward supports only .backward()")
        return grad


def refusing_gpt():
    model = gpt()
    for block in model.transformer.h:
        block.mlp.register_forward_hook(lambda module, args, out: RefusesInputGradients.apply(out))
    return model


def train_noting_split(rank, world, make_model, schedule):
    """``train_pipeline`` on this rank, and whether its engine still splits backwards at the end."""
    warnings.filterwarnings("ignore")
    engines, partition = [], PipelineEngine.partition
    PipelineEngine.partition = lambda self, *args: (engines.append(self), partition(self, *args))[1]
    result = train_pipeline(make_mesh(rank, world, pp=world), make_model, batches(), 4, schedule)
    return result, engines[0].split_backward


def _refusing(rank, world):
    return train_noting_split(rank, world, refusing_gpt, "1f1b")


@pytest.mark.timeout(60)
def test_a_backward_that_refuses_the_input_gradient_pass_falls_back_to_one_full_backward():
    reference_losses, reference = single_device(refusing_gpt, batches())
    (first, first_splits), (last, last_splits) = run_distributed(_refusing, 2)
    assert first_splits and not last_splits  # the last stage tried the split once and gave it up
    for losses, params in (first, last):
        assert losses == pytest.approx(reference_losses, abs=LOSS_TOL)
        for name, value in params.items():
            assert_param_close(torch.from_numpy(value), reference[name], atol=PARAM_TOL, name=name)
