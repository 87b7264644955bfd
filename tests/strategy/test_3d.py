"""DP x TP x PP on one mesh (2 x 2 x 2 = 8 processes) reproduces one device, step by step.

Tolerances: the split run computes the same float32 arithmetic in another association (row-parallel
partial sums, micro-batch means, tied-gradient sums across stages, the DP mean), so losses agree to
~1e-6; after AdamW, parameters whose gradient is almost zero (attention key biases, rare-token
embedding rows) can move by rounding noise amplified by Adam's 1/sqrt(v), measured up to ~3e-5. A
real error (a shard or replica not reduced, a tied weight not summed, a clip on the local norm)
moves losses by >1e-3 and parameters by about the learning rate.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from tests.data_parallel.test_dp import HFCausalLM
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    TensorDataset,
    assert_close_series,
    assert_param_close,
    fit_and_record,
    mean_over_ranks,
)

LOSS_TOL = LOSS_BOUND  # the documented float32 parity bound (tests/helpers/parity.py)
PARAM_TOL = PARAM_BOUND


def token_data(n: int = 64, vocab: int = 64, seq: int = 16) -> TensorDataset:
    offsets = torch.randint(0, vocab, (n, 1), generator=torch.Generator().manual_seed(0))
    tokens = (offsets + torch.arange(seq + 1) * 3) % vocab  # learnable: the loss must fall
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def gather_records(records: list[dict]) -> dict:
    """Full parameters from one replica's records (stage 0 tp 0, tp 1, stage 1 tp 0, tp 1)."""
    from lightning_parallel.tensor_parallel.shard import merge_shards

    full: dict[str, torch.Tensor] = {}
    for name in {n for r in records for n in r["params"]}:
        holders = [r for r in records if name in r["params"]]
        shard = holders[0].get("shards", {}).get(name)
        tensors = [r["params"][name] for r in holders]
        full[name] = merge_shards(tensors[:2], shard) if shard is not None else tensors[0]
    return full


class ShardRecorder(L.Callback):
    """Store each parameter's TP layout beside its value, so the test can merge shards."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        shards = {n: p.tp_shard for n, p in pl_module.named_parameters(remove_duplicate=False) if getattr(p, "tp_shard", None)}
        torch.save(shards, f"{self.out_dir}/shards{trainer.global_rank}.pt")


def fit_3d(module, data, tmp_path, **kwargs):
    strategy = ParallelStrategy(data_parallel=2, tensor_parallel=2, pipeline_parallel=2, micro_batches=2,
                                start_method="fork", **{k: kwargs.pop(k) for k in ("zero_stage",) if k in kwargs})
    recs = fit_and_record(module, data, batch_size=4, out_dir=str(tmp_path / "3d"), devices=8, strategy=strategy,
                          callbacks=[ShardRecorder(str(tmp_path))], **kwargs)
    for r, rec in enumerate(recs):
        rec["shards"] = torch.load(str(tmp_path / f"shards{r}.pt"), weights_only=False)
    return recs


def assert_3d_matches(ref: dict, recs: list[dict]) -> None:
    # rank = (pp * 2 + dp) * 2 + tp; every rank of a pipeline returns its replica's loss
    assert_close_series(mean_over_ranks([recs[0], recs[2]]), ref["losses"], atol=LOSS_TOL)
    assert ref["losses"][-1] < ref["losses"][0]
    full = gather_records([recs[0], recs[1], recs[4], recs[5]])  # replica 0: both stages, both shards
    assert set(full) == set(ref["params"])
    for name, expected in ref["params"].items():
        assert_param_close(full[name], expected, atol=PARAM_TOL, name=name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("clip", [None, 0.1])
def test_dp2_tp2_pp2_gpt_matches_single_device(tmp_path, clip):
    L.seed_everything(0)
    module = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, lr=1e-2)
    data = token_data()
    kwargs = dict(max_steps=3, gradient_clip_val=clip)
    ref = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "ref"), emulate_replicas=2, **kwargs)[0]
    assert_3d_matches(ref, fit_3d(module, data, tmp_path, **kwargs))


@pytest.mark.timeout(180)
def test_dp2_tp2_pp2_hf_llama_matches_single_device(tmp_path):
    L.seed_everything(0)
    module = HFTokens()
    data = token_data()
    ref = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "ref"), emulate_replicas=2, max_steps=3)[0]
    assert_3d_matches(ref, fit_3d(module, data, tmp_path, max_steps=3))


@pytest.mark.timeout(180)
def test_dp2_tp2_pp2_with_zero1_matches_single_device(tmp_path):
    L.seed_everything(0)
    module = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, lr=1e-2)
    data = token_data()
    ref = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "ref"), emulate_replicas=2,
                         max_steps=3, gradient_clip_val=0.1)[0]
    assert_3d_matches(ref, fit_3d(module, data, tmp_path, max_steps=3, gradient_clip_val=0.1, zero_stage=1))


class HFTokens(HFCausalLM):
    """The Hugging Face Llama module, fed the inputs of an (x, y) batch (it shifts labels itself)."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch[0], batch_idx)
