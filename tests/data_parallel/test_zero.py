"""ZeRO-1: optimizer state sharded over data-parallel ranks, with single-device parity.

Tolerances as in test_dp.py: only the order of float32 sums differs between the runs.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_parallel import DataParallelStrategy
from tests.data_parallel.test_dp import GatedNet, gated_data
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    assert_close_series,
    assert_params_close,
    fit_and_record,
    mean_over_ranks,
)


class StateBytes(L.Callback):
    """Save the bytes of optimizer state each rank holds after training."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        n = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
        torch.save(n, f"{self.out_dir}/state{trainer.global_rank}.pt")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_zero1_dp2_matches_single_device(tmp_path, clip):
    L.seed_everything(0)
    module = GatedNet("adamw")
    data = gated_data()
    kwargs = dict(max_steps=4, gradient_clip_val=clip)
    ref = fit_and_record(module, data, batch_size=16, out_dir=str(tmp_path / "ref"), emulate_replicas=2, **kwargs)[0]
    strategy = DataParallelStrategy(start_method="fork", zero_stage=1, bucket_size_mb=200 * 4 / 2**20)
    recs = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "z"), devices=2, strategy=strategy,
                          callbacks=[StateBytes(str(tmp_path))], **kwargs)
    assert_close_series(mean_over_ranks(recs), ref["losses"], atol=LOSS_BOUND)
    for rec in recs:
        assert_params_close(rec["params"], ref["params"], atol=PARAM_BOUND)
    # the parameter no replica used stays untouched by AdamW's weight decay, as on one device
    torch.testing.assert_close(recs[1]["params"]["unused.weight"], module.unused.weight.detach())
    # each rank holds about half of Adam's moments (2 x 4 bytes per trainable, used parameter)
    used = sum(p.numel() for n, p in module.named_parameters() if not n.startswith("unused"))
    state = [torch.load(str(tmp_path / f"state{r}.pt")) for r in range(2)]
    assert sum(state) <= 8 * used + 8 * 2 * 200  # all shards together: one copy (plus bucket padding)
    assert max(state) < 0.75 * 8 * used


def test_zero_stage_is_validated():
    with pytest.raises(ValueError, match="zero_stage must be 0"):
        DataParallelStrategy(zero_stage=4)


@pytest.mark.timeout(60)
def test_zero1_refuses_whole_tensor_optimizers_at_setup_before_training(tmp_path):
    class WithAdafactor(GatedNet):
        def configure_optimizers(self):
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)

    class Started(L.Callback):
        def on_train_start(self, trainer, pl_module):
            (tmp_path / "started").touch()

    L.seed_everything(0)
    strategy = DataParallelStrategy(start_method="fork", zero_stage=1)
    with pytest.raises(Exception, match="zero_stage=1 steps Adafactor on 1-D slices.*train it with zero_stage=0"):
        fit_and_record(WithAdafactor(), gated_data(), batch_size=8, out_dir=str(tmp_path), devices=2,
                       strategy=strategy, max_steps=1, callbacks=[Started()])
    assert not (tmp_path / "started").exists()
