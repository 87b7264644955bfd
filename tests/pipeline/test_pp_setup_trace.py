"""The setup trace of pipeline parallelism runs the user's step once and leaves nothing behind.

At setup every rank runs the user's step on one micro-batch of the first batch (the whole model,
then its own stages) to learn the order the modules run in. Metrics updated in that step, lists it
appends to and counters it bumps must read afterwards as if it had never run, or every metric of the
run is silently off (a perplexity averaged over one micro-batch too many on every stage).

Tolerances: validation losses and perplexities are float32 means over the same tokens, summed in
another order under the pipeline: relative 1e-5 before training, and after training the loss
tolerance of ``test_pp_training`` (1e-5) scaled by the perplexity's ~260 (exp amplifies a loss
error eps to a relative error eps), so 1e-4 relative. An extra metric update by the trace moves the
perplexity by ~2e-3 relative and the token count by whole micro-batches (compared exactly).
"""

from __future__ import annotations

import copy
import warnings

import lightning as L
import pytest
import torch
import torch.utils.checkpoint as checkpoint
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from torchmetrics import SumMetric

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.pipeline.isolation import untouched
from lightning_parallel.pipeline.order import trace_run_order
from lightning_parallel.strategy.materialize import (
    empty_parameters,
    has_meta_parameters,
)
from tests.helpers.processes import make_mesh, run_distributed
from tests.pipeline.test_pp_models import CausalLM, litgpt_model
from tests.pipeline.test_pp_training import pp_strategy, token_data

VAL_KEYS = ("val_loss", "val_ppl", "tokens")


class CountingGPT(GPT):
    """The default GPT plus what users keep on their module: a counter-style metric, a list, an int."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(n_layer=4, n_embd=32, n_head=2, block_size=16)
        self.tokens = SumMetric()  # tokens every finished step has seen (training and validation)
        self.losses: list = []
        self.steps = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.tokens.update(batch[1].numel())  # after the loss: reached by the last stage only
        return loss

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.tokens.update(batch[1].numel())

    def on_validation_epoch_end(self):
        super().on_validation_epoch_end()
        self.log("tokens", self.tokens.compute(), sync_dist=True)  # summed over ranks; equal on every rank


class _ValMetrics(Callback):
    def __init__(self, out, tag):
        self.out, self.tag = out, tag

    def on_validation_end(self, trainer, pl_module):
        metrics = {k: float(trainer.callback_metrics[k]) for k in VAL_KEYS}
        torch.save(metrics, self.out / f"{self.tag}{trainer.global_rank}.pt")


def _validate_then_fit(out, devices, strategy):
    """Validation metrics of the untrained model (``trainer.validate``) and after 4 steps (``fit``)."""
    data = token_data()
    val = DataLoader(torch.utils.data.Subset(data, range(32)), batch_size=8)
    results = {}
    for tag in ("before", "after"):
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=copy.deepcopy(strategy), max_steps=4,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
                            val_check_interval=4,  # validation after the 4th step
                            callbacks=[_ValMetrics(out, tag)])
        module = CountingGPT()
        if tag == "before":
            trainer.validate(module, val, verbose=False)
        else:
            trainer.fit(module, DataLoader(data, batch_size=8), val)
        results[tag] = [torch.load(out / f"{tag}{r}.pt") for r in range(devices)]
    return results


@pytest.mark.timeout(120)
def test_validation_perplexity_and_counter_metric_match_one_device_before_and_after_training_at_pp2(tmp_path):
    warnings.filterwarnings("ignore")
    (tmp_path / "one").mkdir()
    (tmp_path / "pp").mkdir()
    reference = _validate_then_fit(tmp_path / "one", 1, "auto")
    pipelined = _validate_then_fit(tmp_path / "pp", 2, pp_strategy())
    for tag, rel in (("before", 1e-5), ("after", 1e-4)):
        want = reference[tag][0]
        assert want["tokens"] == (32 if tag == "before" else 32 + 4 * 8) * 16
        for rank, got in enumerate(pipelined[tag]):
            assert got["tokens"] == want["tokens"], (tag, rank)
            for key in ("val_loss", "val_ppl"):
                assert got[key] == pytest.approx(want[key], rel=rel), (tag, rank, key)


def test_trace_leaves_metric_states_lists_and_attributes_as_they_were():
    module = CountingGPT()
    module.tokens.update(100)
    module.losses.append(1.0)
    before = (module.tokens.metric_state["sum_value"].clone(), module.tokens._update_count, list(module.losses))
    x = torch.randint(0, 256, (2, 16))

    def step():
        loss = module._loss((x, x))
        module.tokens.update(x.numel())
        module.tokens.compute()
        module.losses.append(loss.item())
        module.steps += 1
        module.new_attribute = loss
        return loss

    with untouched(module):
        trace_run_order(module, "transformer.h", step)
    assert torch.equal(module.tokens.metric_state["sum_value"], before[0])
    assert module.tokens._update_count == before[1] and module.tokens._computed is None
    assert module.losses == before[2] and module.steps == 0 and not hasattr(module, "new_attribute")


# ---- a model whose parameters are on the meta device (trainer.init_module(empty_init=True)) ------------


def _fit_litgpt_on_meta(tmp_path, devices):
    from tests.helpers.parity import fit_and_record

    def strategy():
        return ParallelStrategy(pipeline_parallel=devices, micro_batches=4, start_method="fork", timeout=60)

    with L.Trainer(accelerator="cpu", devices=devices, strategy=strategy(), logger=False).init_module(empty_init=True):
        module = CausalLM(litgpt_model, hf=False)
    assert has_meta_parameters(module)
    return fit_and_record(module, token_data(vocab=128), 8, str(tmp_path), devices=devices, strategy=strategy(),
                          max_steps=3, use_distributed_sampler=False)


@pytest.mark.timeout(120)
def test_litgpt_built_on_meta_device_is_split_by_run_order_and_matches_one_device_at_pp2(tmp_path):
    """LitGPT registers lm_head before its blocks; only a trace (here on the meta device) can place it last."""
    from tests.pipeline.test_pp_training import assert_records_match

    warnings.filterwarnings("ignore")
    reference = _fit_litgpt_on_meta(tmp_path / "one", 1)[0]
    records = _fit_litgpt_on_meta(tmp_path / "pp", 2)
    assert_records_match(reference, records)
    assert "model.lm_head.weight" in records[1]["params"] and "model.lm_head.weight" not in records[0]["params"]


class ReentrantGPT(GPT):
    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = checkpoint.checkpoint(block, x, use_reentrant=True)
        return self.lm_head(self.transformer.ln_f(x))


def _partition_reentrant_on_meta(rank, world):
    warnings.filterwarnings("ignore")
    with empty_parameters():
        module = ReentrantGPT(n_layer=4, n_embd=32, n_head=2, block_size=16)
    x = torch.randint(0, 256, (8, 16))
    try:
        PipelineEngine(module, make_mesh(rank, world, pp=world), ParallelOptions(micro_batches=4)).partition((x, x))
    except Exception as error:  # noqa: BLE001 - the message is what is tested
        return str(error)
    return ""


@pytest.mark.timeout(60)
def test_reentrant_checkpointing_on_meta_device_is_refused_at_setup_on_every_rank():
    messages = run_distributed(_partition_reentrant_on_meta, 2)
    assert all("use_reentrant=False" in m for m in messages), messages


class ValueCheckingGPT(GPT):
    def training_step(self, batch, batch_idx):
        if batch[0].max().item() >= self.hparams.vocab_size:  # needs values: cannot run on the meta device
            raise ValueError("token id out of range")
        return super().training_step(batch, batch_idx)


def _traced_on_meta(rank, world, model_class):
    warnings.filterwarnings("ignore")
    with empty_parameters():
        module = model_class(n_layer=4, n_embd=32, n_head=2, block_size=16)
    x = torch.randint(0, 256, (8, 16))
    engine = PipelineEngine(module, make_mesh(rank, world, pp=world), ParallelOptions(micro_batches=4))
    engine.partition((x, x))
    return engine.plan.traced, has_meta_parameters(module)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("model_class", "traced"), [(GPT, True), (ValueCheckingGPT, False)],
                         ids=["runs-on-meta", "needs-values"])
def test_meta_device_model_is_traced_there_or_falls_back_to_registration_order(model_class, traced):
    assert run_distributed(_traced_on_meta, 2, model_class) == [(traced, True)] * 2
