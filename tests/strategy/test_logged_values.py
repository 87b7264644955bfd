"""What a module logs, and what its torchmetrics compute, equal one device's on every layout.

Counts and sums are the values a layout gets wrong without an error: a pipelined step that
averages ``reduce_fx="sum"`` values over its micro-batches reports a fraction of the count;
``sync_dist=True`` or a torchmetrics ``SumMetric`` reduced over every rank counts the identical
values of the TP ranks (and of the pipeline stages, which replay the last stage's logs) several
times. Tolerance 1e-5: the counts are exact small integers, and the mean and max of logits move by
~1e-7 when the split reorders sums (see test_tp_training.py).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_parallel import ParallelStrategy
from lightning_parallel.pipeline.logs import combine
from tests.helpers.parity import TensorDataset, fit_and_record


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Counts(L.LightningModule):
    """A token classifier that logs counts, sums and maxima, in steps and from torchmetrics."""

    def __init__(self, d: int = 32, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(128, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.head = nn.Linear(d, classes)
        self.seen = torchmetrics.SumMetric()

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.update(torch.tensor(float(len(x))))  # before the model: every pipeline stage runs this line
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log("samples", float(len(x)), reduce_fx="sum", sync_dist=True, on_step=False, on_epoch=True)
        self.log("correct", (logits.argmax(-1) == y).sum().float(), reduce_fx="sum", on_step=False, on_epoch=True)
        self.log("max_logit", logits.max(), reduce_fx="max", on_step=False, on_epoch=True)
        self.log("min_logit", logits.min(), reduce_fx="min", on_step=False, on_epoch=True)
        self.log("loss_synced", loss, sync_dist=True, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.log("seen", self.seen.compute())
        self.seen.reset()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data(n: int = 64):
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randint(0, 128, (n, 16), generator=g), torch.randint(0, 10, (n,), generator=g))


LAYOUTS = {
    "pp2": (2, dict(pipeline_parallel=2, micro_batches=4)),
    "tp2": (2, dict(tensor_parallel=2)),
    "tp2_pp2": (4, dict(tensor_parallel=2, pipeline_parallel=2, micro_batches=4)),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(0)
    return fit_and_record(Counts(), data(), 8, str(tmp_path_factory.mktemp("one")), max_steps=8, max_epochs=1)[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_counts_sums_and_maxima_logged_on_a_split_model_equal_one_device(layout, reference, tmp_path):
    devices, sizes = LAYOUTS[layout]
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="correct", mode="max", save_top_k=1)
    records = fit_and_record(Counts(), data(), 8, str(tmp_path / "run"), devices=devices,
                             strategy=ParallelStrategy(start_method="fork", timeout=60, **sizes),
                             max_steps=8, max_epochs=1, use_distributed_sampler=False, callbacks=[checkpoint],
                             enable_checkpointing=True)
    want = reference["metrics"]
    assert want["samples"] == want["seen"] == 64.0  # the check can fail: a quarter or twice is not 64
    for record in records:
        assert set(record["metrics"]) == set(want)
        for key, value in want.items():
            assert record["metrics"][key] == pytest.approx(value, abs=1e-5), key
    # ModelCheckpoint(monitor=...) agrees on every rank that the best improved, so a best checkpoint exists
    assert list((tmp_path / "ckpt").iterdir())


def test_micro_batch_values_combine_as_reduce_fx_says():
    values = [(0.25, torch.tensor(1.0)), (0.25, torch.tensor(3.0)), (0.5, torch.tensor(2.0))]
    assert combine(values, "mean") == 2.0  # weighted by each micro-batch's share of the batch
    assert combine(values, "sum") == combine(values, torch.sum) == 6.0
    assert combine(values, "max") == combine(values, torch.max) == 3.0
    assert combine(values, "min") == 1.0
    assert combine(values, lambda t: t.prod()) == 6.0
    assert combine([(0.5, 1), (0.5, 2)], "sum") == 3  # plain numbers too


class Gathers(Counts):
    def on_train_epoch_end(self):
        super().on_train_epoch_end()
        self.log("gathered", self.all_gather(torch.ones(2)).sum())  # one device: the tensor itself, 2


@pytest.mark.timeout(120)
def test_all_gather_gives_one_entry_per_replica_not_per_tensor_parallel_rank(tmp_path):
    torch.manual_seed(0)
    records = fit_and_record(Gathers(), data(), 8, str(tmp_path), devices=2,
                             strategy=ParallelStrategy(tensor_parallel=2, start_method="fork", timeout=60),
                             max_steps=2, max_epochs=1, use_distributed_sampler=False)
    assert [r["metrics"]["gathered"] for r in records] == [2.0, 2.0]  # not 4: each TP rank's copy once


class Returns(Counts):
    """Returns more than the loss from training_step, and logits from predict_step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        return {"loss": loss, "accuracy": (logits.argmax(-1) == y).float().mean(), "logits": logits}

    def predict_step(self, batch, batch_idx):
        logits = self(batch[0])
        return {"logits": logits, "mean": logits.mean()}


class SeenByCallbacks(L.Callback):
    def __init__(self, out):
        self.out, self.seen = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(("train", sorted(outputs), float(outputs["accuracy"]), tuple(outputs["logits"].shape),
                          float(outputs["logits"].sum())))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append(("predict", tuple(outputs["logits"].shape), float(outputs["logits"].sum()),
                          float(outputs["mean"])))

    def on_train_end(self, trainer, pl_module):  # fork-started workers keep nothing between Trainer calls
        torch.save(self.seen, self.out / f"train{trainer.global_rank}.pt")
        self.seen = []

    def on_predict_end(self, trainer, pl_module):
        torch.save(self.seen, self.out / f"predict{trainer.global_rank}.pt")


def _seen(tmp_path, devices, strategy):
    torch.manual_seed(0)
    callback = SeenByCallbacks(tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[callback])
    model, loader = Returns(), torch.utils.data.DataLoader(data(16), batch_size=8)
    trainer.fit(model, loader)
    trainer.predict(model, loader, return_predictions=False)
    return [torch.load(tmp_path / f"train{r}.pt") + torch.load(tmp_path / f"predict{r}.pt") for r in range(devices)]


@pytest.mark.timeout(120)
def test_callbacks_see_what_the_step_returned_for_the_whole_batch_under_pipeline_parallelism(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "pp").mkdir()
    (one,) = _seen(tmp_path / "one", 1, "auto")
    split = _seen(tmp_path / "pp", 2, ParallelStrategy(pipeline_parallel=2, micro_batches=4, start_method="fork",
                                                      timeout=60))
    assert [kind for kind, *_ in one] == ["train", "train", "predict", "predict"]
    for seen in split:  # every rank: the extra keys, logits of all 8 samples in order, their mean
        assert len(seen) == len(one)
        for got, want in zip(seen, one):
            assert got[:2] == want[:2] and (got[0] == "predict" or got[2:4] == want[2:4])
            assert got[-1] == pytest.approx(want[-1], abs=1e-4) and got[-2] == pytest.approx(want[-2], abs=1e-4)
