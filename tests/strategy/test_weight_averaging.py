"""Lightning's weight-averaging callbacks average the split model as one device averages the whole one.

``EMAWeightAveraging`` and ``StochasticWeightAveraging`` (refused under PP: ``test_trainer_flags.py``) on
DP at ZeRO-1 and ZeRO-3, TP and TP x PP, each rank averaging the part it holds
(``strategy/averaging.py``), against one process reading the same global batches (what Lightning's
``ddp`` computes; under ZeRO-3 also against ``ddp`` itself). The averaged weights are read after the
callback's ``on_train_end`` has copied them into the module. Resumed from a split model's checkpoint,
which holds each rank's part of the average and of the module's weights, both end as in one
uninterrupted run.

Tolerance. The averaged weights are convex combinations of the weights after each step (EMA with
decay 0.5; SWA's running mean), which agree with one device within the float32 parity bound for
parameters after several AdamW steps (1e-4; README, docs/guarantees.md), and a convex combination
of values each within a bound stays within it, plus the rounding of a few multiply-adds (~1e-7).
Averaging the wrong part, skipping it or averaging the copy made before the split moves weights by
about the learning rate times the steps (1e-2); the test also checks the average is not the final
weights.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, StochasticWeightAveraging
from lightning.pytorch.strategies import DDPStrategy

from lightning_parallel import ParallelStrategy
from tests.helpers.parity import assert_param_close, fit_and_record, whole
from tests.strategy.test_3d import gather_records, token_data
from tests.strategy.test_zero_layouts import tiny_gpt

PARAM_TOL = 1e-4
PER_RANK_BATCH = 4

#: name -> (data_parallel, tensor_parallel, pipeline_parallel, zero_stage). DP x TP x PP at ZeRO-3 (8
#: processes), DP x TP at ZeRO-2 and DP at ZeRO-0/2 match too; the suite keeps one layout per kind of part
LAYOUTS = {
    "dp_zero1": (2, 1, 1, 1),
    "dp_zero3": (2, 1, 1, 3),
    "tp": (1, 2, 1, 0),
    "tp_pp": (1, 2, 2, 0),
}


class AveragedRecord(Callback):
    """Per rank, once the averaging callback before it has copied its average into the module: the
    parameters (ZeRO-2/3 rows gathered over the replicas) and their TP layouts."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        named = list(pl_module.named_parameters(remove_duplicate=False))
        torch.save({"params": {n: whole(p).detach().cpu().clone() for n, p in named},
                    "shards": {n: p.tp_shard for n, p in named if getattr(p, "tp_shard", None) is not None}},
                   os.path.join(self.out_dir, f"averaged{trainer.global_rank}.pt"))


def ema() -> Callback:
    return EMAWeightAveraging(decay=0.5)


def swa() -> Callback:
    return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)


#: Trainer arguments per callback: EMA updates after every step, SWA once per epoch from the second
RUNS = {ema: dict(max_steps=4), swa: dict(max_steps=-1, max_epochs=3, limit_train_batches=2)}


def fit(tmp_path, name: str, averaging, strategy=None, devices: int = 1, replicas: int = 1,
        **trainer_args) -> list[dict]:
    """Fit the tiny GPT with ``averaging()`` on ``devices`` processes (one process reading the global
    batches of ``replicas`` replicas when ``strategy`` is None); the averaged parameters of each rank
    (``params``) and the module's own (``final``). ``trainer_args`` replace the callback's ``RUNS``."""
    out = str(tmp_path / name)
    L.seed_everything(0, verbose=False)
    model = tiny_gpt()
    one_device = strategy is None
    records = fit_and_record(model, token_data(), batch_size=PER_RANK_BATCH * (replicas if one_device else 1),
                             out_dir=out, devices=devices, strategy=strategy or "auto",
                             emulate_replicas=replicas if one_device else 0,
                             callbacks=[averaging(), AveragedRecord(out)], **{**RUNS[averaging], **trainer_args})
    averaged = [torch.load(os.path.join(out, f"averaged{r}.pt"), weights_only=False) for r in range(devices)]
    for record, average in zip(records, averaged):
        record["final"], record["params"], record["shards"] = record["params"], average["params"], average["shards"]
    return records


def one_replica(records: list[dict], dp: int, tp: int, pp: int, key: str = "params") -> dict[str, torch.Tensor]:
    """The whole averaged model (``key="final"``: the module's own weights) from data-parallel replica 0's
    ranks (stage by stage, shard by shard)."""
    replica = [{**records[(p * dp) * tp + t], "params": records[(p * dp) * tp + t][key]}
               for p in range(pp) for t in range(tp)]
    if tp > 1:
        return gather_records(replica)
    return {name: value for record in replica for name, value in record["params"].items()}


def assert_same_average(actual: dict[str, torch.Tensor], reference: dict) -> None:
    assert set(actual) == set(reference["params"])
    for name, expected in reference["params"].items():
        assert_param_close(actual[name], expected, atol=PARAM_TOL, name=name)
    # the average is not the final weights: a callback that averaged nothing would fail above
    moved = max((reference["params"][n] - reference["final"][n]).abs().max() for n in reference["params"])
    assert moved > 10 * PARAM_TOL


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout, averaging", [
    ("dp_zero1", ema), ("tp_pp", ema), ("dp_zero3", swa), ("tp", swa),
], ids=["dp_zero1-ema", "tp_pp-ema", "dp_zero3-swa", "tp-swa"])
def test_weight_averaging_of_each_ranks_part_matches_one_device(tmp_path, layout, averaging):
    dp, tp, pp, stage = LAYOUTS[layout]
    reference = fit(tmp_path, "ref", averaging, replicas=dp)[0]
    strategy = ParallelStrategy(data_parallel=dp, tensor_parallel=tp, pipeline_parallel=pp, zero_stage=stage,
                                micro_batches=2 if pp > 1 else None, start_method="fork")
    records = fit(tmp_path, layout, averaging, strategy, devices=dp * tp * pp)
    assert_same_average(one_replica(records, dp, tp, pp), reference)


@pytest.mark.timeout(120)
def test_ema_under_zero3_equals_lightning_ddp_average(tmp_path):
    ddp = fit(tmp_path, "ddp", ema, DDPStrategy(start_method="fork"), devices=2)
    zero3 = fit(tmp_path, "zero3", ema, ParallelStrategy(data_parallel=2, zero_stage=3, start_method="fork"),
                devices=2)
    for record in zero3:
        assert_same_average(record["params"], ddp[0])


#: epochs of two steps; the default ModelCheckpoint saves at the end of each
EPOCHS = dict(max_steps=-1, limit_train_batches=2)
#: per callback, the epochs before the checkpoint and in all: EMA updates after every step, SWA averages
#: at the end of the second epoch and the third
RESUMED = {ema: (1, 2), swa: (2, 3)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout, averaging", [("dp_zero3", ema), ("tp", ema), ("dp_zero3", swa), ("tp_pp", ema)],
                         ids=["dp_zero3-ema", "tp-ema", "dp_zero3-swa", "tp_pp-ema"])
def test_checkpoint_of_a_split_average_resumes_the_uninterrupted_run(tmp_path, layout, averaging):
    """The checkpoint holds each rank's part of the average and of the module's weights
    (``checkpoint/module_states.py``): resumed from it, both continue as in one uninterrupted run. A part
    written once, as metadata, does not load on the other ranks; one lost resumes the module from the
    average (or SWA's average from nothing), which moves it by about lr x steps."""
    dp, tp, pp, stage = LAYOUTS[layout]
    first, epochs = RESUMED[averaging]
    reference = fit(tmp_path, "ref", averaging, replicas=dp, max_epochs=epochs, **EPOCHS)[0]

    def split_fit(name: str, **trainer_args) -> list[dict]:
        strategy = ParallelStrategy(data_parallel=dp, tensor_parallel=tp, pipeline_parallel=pp, zero_stage=stage,
                                    micro_batches=2 if pp > 1 else None, start_method="fork")
        return fit(tmp_path, name, averaging, strategy, devices=dp * tp * pp, **EPOCHS, **trainer_args)

    split_fit("first", max_epochs=first, enable_checkpointing=True, default_root_dir=str(tmp_path / "first"))
    (checkpoint,) = (tmp_path / "first" / "checkpoints").iterdir()
    records = split_fit("resumed", max_epochs=epochs, ckpt_path=str(checkpoint))
    assert_same_average(one_replica(records, dp, tp, pp), reference)
    final = one_replica(records, dp, tp, pp, key="final")
    for name, expected in reference["final"].items():
        assert_param_close(final[name], expected, atol=PARAM_TOL, name=name)
