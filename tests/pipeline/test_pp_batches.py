"""Short and uneven batches, per-stage random streams, and refusals reached on every rank.

Short batches. The last batch of an epoch without ``drop_last`` (17 samples in batches of 8: 8, 8,
1) has fewer samples than ``micro_batches`` and runs with one micro-batch per sample; an uneven
split (17 into 4: 5, 4, 4, 4) weights each micro-batch's mean loss by its share of samples, which
is the batch mean one device computes. Losses agree to ``test_pp_training``'s 1e-5, parameters to
3e-4 after six AdamW steps (see the test): the pipeline only reorders float32 sums, while an
unweighted mean of micro-batch means (the error this guards against) is off by ~1e-2 on these batches.

Randomness. Every pipeline rank starts from the same seed; stage ``r`` draws dropout masks from
``seed + 100 r`` (Megatron-LM's offset), so two stages draw different masks for same-shaped
tensors and a second run with the same seed repeats the first bit for bit.
"""

import os
import warnings

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine, PipelineIncompatibleModel
from tests.helpers.parity import TensorDataset, fit_and_record
from tests.helpers.processes import make_mesh, run_distributed
from tests.pipeline.test_pp_training import (
    LOSS_TOL,
    assert_records_match,
    pp_strategy,
    small_gpt,
)


def data(n=17, vocab=256):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, vocab, (n, 16), generator=g), torch.randint(0, vocab, (n, 16), generator=g))


# ---- short and uneven batches -------------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("batch_size,steps", [(8, 6), (17, 2)], ids=["last-batch-of-1", "17-into-4"])
def test_short_and_uneven_batches_train_to_the_single_device_mean(tmp_path, batch_size, steps):
    warnings.filterwarnings("ignore")
    module, dataset = small_gpt(), data()
    reference = fit_and_record(module, dataset, batch_size, str(tmp_path / "ref"), max_steps=steps)[0]
    records = fit_and_record(module, dataset, batch_size, str(tmp_path / "pp"), devices=2,
                             strategy=pp_strategy(micro_batches=4), max_steps=steps, use_distributed_sampler=False)
    # six AdamW steps, one on a single sample: Adam's 1/sqrt(v) lifts rounding of near-zero gradients to
    # ~1e-4 (measured 8.4e-5 on 1 of 4096 entries); a wrongly weighted micro-batch moves parameters by ~lr (3e-3)
    assert_records_match(reference, records, param_tol=3e-4)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "dualpipev"])
def test_a_short_last_batch_the_schedule_cannot_split_trains_in_gpipe_order(tmp_path, schedule):
    # 17 samples in batches of 8: the last batch's 1 micro-batch is no multiple of P=2 (interleaved 1F1B)
    # and fewer than 2P (DualPipeV); it runs forwards then backwards on the same stages (schedule_flush)
    warnings.filterwarnings("ignore")
    module, dataset = small_gpt(), data()
    reference = fit_and_record(module, dataset, 8, str(tmp_path / "ref"), max_steps=6)[0]
    records = fit_and_record(module, dataset, 8, str(tmp_path / "pp"), devices=2, max_steps=6,
                             strategy=pp_strategy(micro_batches=4, schedule=schedule, virtual_stages=2),
                             use_distributed_sampler=False)
    assert_records_match(reference, records, param_tol=3e-4)  # tolerance: see the test above


class _ValLoss(L.Callback):
    def __init__(self, out):
        self.out, self.values = out, []

    def on_validation_epoch_end(self, trainer, pl_module):
        self.values.append(float(trainer.callback_metrics["val_loss"]))

    def on_fit_end(self, trainer, pl_module):
        torch.save(self.values, os.path.join(self.out, f"rank{trainer.global_rank}.pt"))


def _validated(out, devices, strategy):
    os.makedirs(out, exist_ok=True)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[_ValLoss(out)])
    trainer.fit(small_gpt(), DataLoader(data(), batch_size=8), DataLoader(data(), batch_size=8))
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(devices)]


@pytest.mark.timeout(90)
def test_validation_set_of_17_in_batches_of_8_matches_single_device(tmp_path):
    """The last validation batch holds one sample; the epoch's val_loss is still the single-device one."""
    reference = _validated(str(tmp_path / "ref"), 1, "auto")[0]
    assert len(reference) == 2
    for values in _validated(str(tmp_path / "pp"), 2, pp_strategy(micro_batches=4)):
        assert values == pytest.approx(reference, abs=LOSS_TOL)


# ---- per-stage random streams -----------------------------------------------------------------------
class MaskRecorder(nn.Module):
    """A block that applies dropout to a tensor of fixed shape and records the mask it drew."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.masks = []

    def forward(self, x):
        mask = nn.functional.dropout(torch.ones(64), 0.5) > 0
        self.masks.append(mask)
        return self.lin(x)


class DropoutModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(MaskRecorder() for _ in range(4))

    def forward(self, x):
        x = self.emb(x)
        for blk in self.blocks:
            x = blk(x)
        return x

    def training_step(self, batch, batch_idx):
        return self(batch).pow(2).mean()


def _stage_masks(rank, world):
    torch.manual_seed(1234)  # the same seed on every rank, as seed_everything gives
    mesh = make_mesh(rank, world, pp=world)
    model = DropoutModel()
    engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=1, schedule="1f1b"))
    engine.partition()
    engine.training_step(torch.ones(2, 4), 0)
    owned = engine.plan.stage_blocks[rank]
    return {i: model.blocks[i].masks[0].numpy() for i in owned}


@pytest.mark.timeout(30)
def test_stages_draw_different_dropout_masks_for_same_shaped_tensors():
    first, second = run_distributed(_stage_masks, 2)
    # each stage's first block draws its stage's first mask: equal streams would make them equal
    assert not (first[0] == second[2]).all()
    assert not (first[1] == second[3]).all()


def dropout_gpt():
    torch.manual_seed(0)
    return GPT(n_layer=4, n_embd=32, n_head=2, block_size=16, dropout=0.2)


def _two_runs(rank, world):
    warnings.filterwarnings("ignore")
    mesh = make_mesh(rank, world, pp=world)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8, 16), generator=g))
               for _ in range(3)]
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        model = dropout_gpt()
        engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=4, schedule="1f1b"))
        engine.partition(batches[0])
        opt = model.configure_optimizers()
        losses = []
        for i, batch in enumerate(batches):
            opt.zero_grad()
            losses.append(engine.training_step(batch, i).item())
            engine.sync_tied_grads()
            opt.step()
        runs.append((losses, {k: v.numpy().copy() for k, v in model.state_dict().items()}))
    return runs


@pytest.mark.timeout(60)
def test_two_pipeline_runs_with_dropout_are_bit_identical():
    for (losses_a, params_a), (losses_b, params_b) in run_distributed(_two_runs, 2):
        assert losses_a == losses_b
        assert all((params_a[k] == params_b[k]).all() for k in params_a)


# ---- refusals reached at setup, identically on every rank -------------------------------------------
class SkipConnected(L.LightningModule):
    """A U-Net style skip: the state after block 0 is used again after block 2, which no stage boundary carries."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x = self.emb(batch)
        skip = None
        for i, blk in enumerate(self.blocks):
            x = torch.tanh(blk(x))
            skip = x if i == 0 else skip
            x = x + skip if i == 2 else x
        return self.head(x).mean()


class ShiftedResidual(SkipConnected):
    """``h = h + block(h) + 1``: the caller's update does not start from zeros on a later stage."""

    def training_step(self, batch, batch_idx):
        h = self.emb(batch)
        for blk in self.blocks:
            h = h + torch.tanh(blk(h)) + 1.0
        return self.head(h).mean()


class FloatCarried(SkipConnected):
    """Carries a Python float computed after block 0 to later blocks: invisible to autograd."""

    def training_step(self, batch, batch_idx):
        x, scale = self.emb(batch), 1.0
        for i, blk in enumerate(self.blocks):
            x = torch.tanh(blk(x)) * scale
            if i == 0:
                scale = 1.0 + float(x.detach().abs().mean())
        return self.head(x).mean()


def _refusal(rank, world, model):
    mesh = make_mesh(rank, world, pp=world)
    engine = PipelineEngine(model(), mesh, ParallelOptions(micro_batches=2))
    try:
        engine.partition(torch.ones(4, 4))
    except PipelineIncompatibleModel as err:
        return str(err)
    return None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("model,message", [
    (SkipConnected, "the hidden-state input of block 3 depends on the input of block 1"),
    (ShiftedResidual, "that copy does not equal the state the previous stage sends"),
    (FloatCarried, "pipeline stage 1 computes the step's result differently from the whole model"),
], ids=["found-by-the-trace", "found-by-the-stage-probe", "found-by-comparing-values"])
def test_a_model_that_cannot_be_split_is_refused_with_the_same_error_on_every_rank(model, message):
    """Both ranks raise at setup: no rank waits in a collective for a peer that already failed."""
    messages = run_distributed(_refusal, 2, model)
    assert messages[0] is not None and messages[0] == messages[1]
    assert message in messages[0]


class SkipConnectedModule(SkipConnected):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(60)
def test_trainer_fit_refuses_a_model_that_cannot_be_split_at_setup(tmp_path):
    with pytest.raises(Exception, match="the hidden-state input of block 3 depends on the input of block 1"):
        fit_and_record(SkipConnectedModule(), TensorDataset(torch.randn(16, 4)), 4, str(tmp_path), devices=2,
                       strategy=pp_strategy(micro_batches=2), max_steps=1, use_distributed_sampler=False)


class SkipsSecondBatch(GPT):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:  # Lightning's way to skip a step on one device
            return None
        return super().training_step(batch, batch_idx)


def _skipping(rank, world):
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    engine = PipelineEngine(SkipsSecondBatch(n_layer=4, n_embd=32, n_head=2, block_size=16),
                            make_mesh(rank, world, pp=world), ParallelOptions(micro_batches=2, schedule="1f1b"))
    engine.partition()
    batch = tuple(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(k)) for k in range(2))
    engine.training_step(batch, 0)
    engine.training_step(batch, 1)


@pytest.mark.timeout(60)
def test_returning_none_to_skip_a_step_stops_with_what_to_do_instead():
    with pytest.raises(AssertionError, match="cannot be skipped by returning early .* filter such batches"):
        run_distributed(_skipping, 2, timeout=30)


class NamedSamples(torch.utils.data.Dataset):
    """Dict samples with a name string: the default collate makes the names a list, one per sample."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        x, y = self.dataset[i]
        return {"x": x, "y": y, "name": f"sample{i}"}


class CountsByNames(GPT):
    def training_step(self, batch, batch_idx):
        logits = self(batch["x"])
        summed = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="sum")
        loss = summed / (len(batch["name"]) * batch["x"].shape[1])
        self.log("train_loss", loss)
        return loss


@pytest.mark.timeout(90)
def test_a_loss_counted_by_a_per_sample_list_of_names_matches_single_device(tmp_path):
    # each micro-batch must get its own samples' names: the whole batch's list would make the loss 1/4
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    module, dataset = CountsByNames(n_layer=4, n_embd=32, n_head=2, block_size=16), NamedSamples(data(16))
    reference = fit_and_record(module, dataset, 8, str(tmp_path / "ref"), max_steps=2)[0]
    records = fit_and_record(module, dataset, 8, str(tmp_path / "pp"), devices=2, max_steps=2,
                             strategy=pp_strategy(micro_batches=4), use_distributed_sampler=False)
    assert_records_match(reference, records)
