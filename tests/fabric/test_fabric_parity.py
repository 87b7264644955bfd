"""An unchanged Fabric loop (HF Llama, clipping by the global norm, save and load mid-run) under the
parallel strategies equals Fabric on one device, within the documented bound (``tests/helpers/parity.py``)."""

from __future__ import annotations

import pytest

from lightning_parallel.fabric import FabricParallelStrategy
from tests.fabric.loop import STEPS, distributed, one_device
from tests.helpers.parity import LOSS_BOUND, PARAM_BOUND, assert_close_series, assert_params_close

_REFERENCES: dict = {}


def reference(tmp_path_factory, replicas: int, per_rank: int, **kwargs) -> dict:
    """The one-device run reading the global batches of ``replicas`` ranks of ``per_rank`` samples (cached)."""
    key = (replicas, per_rank, tuple(sorted(kwargs.items())))
    if key not in _REFERENCES:
        folder = tmp_path_factory.mktemp("reference")
        _REFERENCES[key] = one_device(replicas, per_rank, checkpoint=str(folder / "ref.pt"), **kwargs)
    return _REFERENCES[key]


def assert_matches(records: list, ref: dict) -> None:
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    assert all(n > 0.5 for n in ref["norms"])  # clipping (max_norm=0.5) acts in every step
    for record in records:
        assert_close_series(record["losses"], ref["losses"], atol=LOSS_BOUND)
        assert_close_series(record["norms"], ref["norms"], atol=LOSS_BOUND, rtol=LOSS_BOUND)
        assert_params_close(record["params"], ref["params"], atol=PARAM_BOUND)


# (strategy, data-parallel replicas, samples per rank): TP ranks of one replica read the whole batch
LAYOUTS = {
    "dp2": (lambda: FabricParallelStrategy(), 2, 4),
    "tp2": (lambda: FabricParallelStrategy(tensor_parallel=2), 1, 8),
    "zero3": (lambda: FabricParallelStrategy(zero_stage=3), 2, 4),
    "lp_tp": ("lp_tp", 1, 8),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fabric_loop_matches_one_device(layout, tmp_path, tmp_path_factory):
    strategy, replicas, per_rank = LAYOUTS[layout]
    records = distributed(strategy, 2, per_rank, checkpoint=str(tmp_path / "ckpt"))
    ref = reference(tmp_path_factory, replicas, per_rank)
    assert_matches(records, ref)
    whole = sum(t.numel() for t in ref["params"].values())
    assert [r["held"] < whole for r in records] == [layout != "dp2"] * 2  # TP and ZeRO-3 split the model
    assert (tmp_path / "ckpt" / ".metadata").is_file()  # a Distributed Checkpoint directory
    # collectives: a sum counts each replica once (not each TP rank); broadcasts come from rank 0
    assert [r["replicas"] for r in records] == [float(replicas)] * 2
    assert [r["broadcast"] for r in records] == [7, 7]


@pytest.mark.timeout(300)
def test_meta_init_and_accumulation_match_one_device(tmp_path_factory):
    """``init_module(empty_init=True)`` materialises the values one device builds; ``no_backward_sync``
    accumulates two micro-batches per step, reduced once."""
    records = distributed(lambda: FabricParallelStrategy(zero_stage=1), 2, 2, empty_init=True, accumulate=2)
    ref = reference(tmp_path_factory, 2, 2, accumulate=2)
    assert all(r["meta"] for r in records) and not ref["meta"]
    assert len(ref["losses"]) == len(records[0]["losses"]) == STEPS
    for record in records:
        assert_close_series(record["norms"], ref["norms"], atol=LOSS_BOUND, rtol=LOSS_BOUND)
        assert_params_close(record["params"], ref["params"], atol=PARAM_BOUND)


@pytest.mark.timeout(300)
def test_checkpoint_resumes_on_another_layout(tmp_path, tmp_path_factory):
    """A directory saved by two TP ranks mid-run resumes in one process (the shards read back whole):
    the rest of the run equals one device's."""
    checkpoint = str(tmp_path / "ckpt")
    distributed(lambda: FabricParallelStrategy(tensor_parallel=2), 2, 8, checkpoint=checkpoint, save_at=1)
    resumed = distributed(lambda: FabricParallelStrategy(), 1, 8, resume=checkpoint)[0]
    ref = reference(tmp_path_factory, 1, 8)
    assert_close_series(resumed["losses"], ref["losses"][2:], atol=LOSS_BOUND)
    assert_params_close(resumed["params"], ref["params"], atol=PARAM_BOUND)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_litgpt_model_matches_one_device(zero_stage, tmp_path, tmp_path_factory):
    """LitGPT's ``GPT`` in the same loop (its loss from the logits) at DP=2, and under ZeRO-3."""
    records = distributed(lambda: FabricParallelStrategy(zero_stage=zero_stage), 2, 4,
                          checkpoint=str(tmp_path / "ckpt"), model_name="litgpt")
    assert_matches(records, reference(tmp_path_factory, 2, 4, model_name="litgpt"))


@pytest.mark.timeout(300)
def test_expert_parallel_matches_one_device(tmp_path, tmp_path_factory):
    """A Mixtral's experts placed over two data-parallel ranks (EP=2), clipped by the global norm."""
    records = distributed(lambda: FabricParallelStrategy(expert_parallel=2), 2, 4,
                          checkpoint=str(tmp_path / "ckpt"), model_name="mixtral")
    ref = reference(tmp_path_factory, 2, 4, model_name="mixtral")
    assert_matches(records, ref)
    assert all(r["held"] < sum(t.numel() for t in ref["params"].values()) for r in records)  # half the experts


@pytest.mark.timeout(300)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_pipeline_matches_one_device(accumulate, tmp_path, tmp_path_factory):
    """PP=2 (1F1B over two micro-batches): the loop hands its loss function to the model, whose call runs
    the schedule; every stage reports the batch's loss, and each holds only its blocks. With two batches
    per step, ``loss_scale=1/2`` and ``no_backward_sync``."""
    per_rank = 8 // accumulate
    records = distributed(lambda: FabricParallelStrategy(pipeline_parallel=2), 2, per_rank,
                          checkpoint=str(tmp_path / "ckpt"), pipelined=True,
                          accumulate=accumulate)
    ref = reference(tmp_path_factory, 1, per_rank, **({"accumulate": 2} if accumulate == 2 else {}))
    assert_matches(records, ref)
    held = [set(r["params"]) for r in records]
    assert held[0] and held[1] and held[0] != held[1] and held[0] | held[1] == set(ref["params"])


@pytest.mark.timeout(300)
def test_context_parallel_matches_one_device(tmp_path, tmp_path_factory):
    """CP=2: each call of the model runs with its sequences split at the blocks (the loss on the gathered
    sequence, as the loop computes it), and so does the backward."""
    records = distributed(lambda: FabricParallelStrategy(context_parallel=2), 2, 8, checkpoint=str(tmp_path / "ckpt"))
    ref = reference(tmp_path_factory, 1, 8)
    assert_matches(records, ref)
    assert ref["lengths"] == [16] and [r["lengths"] for r in records] == [[8], [8]]  # half a sequence per rank


@pytest.mark.timeout(300)
def test_pretrained_model_built_on_meta_matches_one_device(tmp_path, tmp_path_factory):
    """``from_pretrained`` inside ``init_module(empty_init=True)`` at TP=2: each rank reads only its shards
    of the weights (as under the Trainer), and trains as one device that read them whole."""
    from tests.helpers.pretrained import save_tiny_llama

    name = "pretrained:" + save_tiny_llama(tmp_path_factory.mktemp("hf") / "llama", layers=2)
    records = distributed(lambda: FabricParallelStrategy(tensor_parallel=2), 2, 8, empty_init=True, model_name=name)
    ref = one_device(1, 8, model_name=name)
    assert all(r["meta"] for r in records) and not ref["meta"]
    assert_matches(records, ref)
