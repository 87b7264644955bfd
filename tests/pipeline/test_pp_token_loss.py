"""Losses averaged over real tokens: under PP each micro-batch weighs by its share of the batch's targets.

The batches are what Hugging Face collators make: ``input_ids`` right-padded to 16, ``attention_mask``,
``labels`` = -100 on padding (and, for the masked LM, on every token not masked), samples of 2 to 16
real tokens, so micro-batches hold very different numbers of targets. A tiny Llama (causal: the model
shifts labels) and a tiny BERT (masked: no shift) train for a few AdamW steps on one device and
pipelined; each step's loss, the logged ``train_loss`` and the final parameters must agree.

Tolerances: ``test_pp_training``'s (the documented bound: losses 1e-5, parameters 1e-4): the
pipeline only reorders float32 sums. Weighting micro-batches by samples instead (the old behaviour,
still what runs where the targets cannot be learnt) is 3e-3 off on these batches at the first step and
2e-2 in parameters after three (``test_a_loss_the_pipeline_cannot_count_is_warned_about_and_weighted_by_samples``).
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from lightning_parallel import ParallelStrategy
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.pipeline.targets import (
    CrossEntropyCalls,
    TargetCount,
    learn,
    padding_hint,
)
from tests.helpers.parity import assert_params_close, fit_and_record
from tests.helpers.processes import make_mesh, run_distributed
from tests.pipeline.test_pp_training import (
    LOSS_TOL,
    PARAM_TOL,
    assert_records_match,
    pp_strategy,
)
from tests.strategy.test_3d import ShardRecorder, gather_records

VOCAB, SEQ, MASK_ID = 128, 16, 3


class PaddedText(Dataset):
    """Dict samples as a Hugging Face collator leaves them: right padding with id 0, labels -100 there.

    ``masked``: BERT-style, about a third of the real tokens replaced by ``MASK_ID`` and labelled, every
    other label -100 (the first token of each sample always masked). ``unlabelled``: samples without any target.
    """

    def __init__(self, n: int = 32, masked: bool = False, seed: int = 0, unlabelled: tuple = ()):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, SEQ + 1, (n,), generator=g)
        tokens = torch.randint(4, VOCAB, (n, SEQ), generator=g)
        self.mask = (torch.arange(SEQ) < lengths[:, None]).long()
        self.input_ids = tokens * self.mask
        self.labels = tokens.masked_fill(self.mask == 0, -100)
        if masked:
            chosen = (torch.rand(n, SEQ, generator=g) < 0.33) & (self.mask == 1)
            chosen[:, 0] = True
            self.input_ids = self.input_ids.masked_fill(chosen, MASK_ID)
            self.labels = self.labels.masked_fill(~chosen, -100)
        self.labels[list(unlabelled)] = -100  # prompt-only samples: no target at all

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


def tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


class FineTune(L.LightningModule):
    """A plain fine-tuning module: the collator's dict straight into the model, its loss logged and returned."""

    def __init__(self, make=tiny_llama):
        super().__init__()
        torch.manual_seed(0)
        self.model = make()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def _fit_pair(tmp_path, module, data, batch_size=8, devices=2, strategy=None, steps=3, **kwargs):
    reference = fit_and_record(module, data, batch_size, str(tmp_path / "one"), max_steps=steps, **kwargs)[0]
    records = fit_and_record(module, data, batch_size, str(tmp_path / "split"), devices=devices, max_steps=steps,
                             strategy=strategy or pp_strategy(micro_batches=4), use_distributed_sampler=False, **kwargs)
    return reference, records


# ---- learning where the targets are, without processes ----------------------------------------------
def _learnt(module_or_fn, batch, training=True):
    with CrossEntropyCalls() as losses:
        loss = module_or_fn(batch)
    logged = [("train_loss", loss), ("as_number", float(loss)), ("other", loss * 2)]
    return learn(losses.calls, batch, loss if training else None, logged)


def test_learns_labels_shifted_inside_a_causal_lm_and_unshifted_in_a_masked_lm():
    data = PaddedText(4)
    batch = default_collate([data[i] for i in range(4)])
    causal = _learnt(lambda b: tiny_llama()(**b).loss, batch)
    as_loss = frozenset({"train_loss", "as_number"})  # logged values equal to the loss, a tensor or a number
    assert causal == TargetCount(("labels",), 1, -100, as_loss)
    masked = dict(batch, labels=batch["labels"].masked_fill(torch.rand(4, SEQ) < 0.5, -100))
    assert _learnt(lambda b: tiny_bert()(**b).loss, masked) == TargetCount(("labels",), 0, -100, as_loss)
    # nanoGPT style: the step slices the targets itself; a tuple batch
    logits = torch.randn(4, SEQ - 1, VOCAB).flatten(0, 1)
    sliced = _learnt(lambda b: F.cross_entropy(logits, b[0][:, 1:].flatten()), (batch["input_ids"],))
    assert (sliced.path, sliced.shift) == ((0,), 1)
    assert int(causal.targets(batch)) == int((batch["labels"][:, 1:] != -100).sum())
    # a micro-batch without padding: input_ids equal labels there; the tensor holding -100 elsewhere in the
    # batch is the labels, and without any padding the later one is taken
    full = {k: v[:1] for k, v in batch.items()}
    full["input_ids"] = full["labels"] = torch.randint(4, VOCAB, (1, SEQ))
    with CrossEntropyCalls() as losses:
        tiny_llama()(**full)
    assert learn(losses.calls, full, None, [], [full, batch]).path == ("labels",)
    assert learn(losses.calls, full, None, []).path == ("labels",)
    reordered = {"labels": full["labels"], "input_ids": full["input_ids"]}
    assert learn(losses.calls, reordered, None, [], [reordered, batch]).path == ("labels",)


def test_a_loss_that_is_no_mean_over_batch_targets_is_not_counted_by_targets():
    batch = {"x": torch.randint(0, VOCAB, (4, SEQ)), "y": torch.randint(0, VOCAB, (4, SEQ))}
    logits = torch.randn(4 * SEQ, VOCAB, requires_grad=True)
    y = batch["y"].flatten()
    assert "reduction='sum'" in _learnt(lambda b: F.cross_entropy(logits, y, reduction="sum") / 7, batch)
    assert "2 cross-entropy" in _learnt(lambda b: F.cross_entropy(logits, y) + F.cross_entropy(logits, y), batch)
    assert "no torch.nn.functional.cross_entropy" in _learnt(lambda b: logits.square().mean(), batch)
    assert "weighs classes" in _learnt(lambda b: F.cross_entropy(logits, y, weight=torch.ones(VOCAB)), batch)
    assert "no tensor of the batch" in _learnt(lambda b: F.cross_entropy(logits, (y + 1) % VOCAB), batch)
    # one sample's entry of a per-sample list (a custom collate's): other micro-batches have other samples there
    one = {"x": batch["x"][:1], "y": [batch["y"][0]]}
    assert "no tensor of the batch" in _learnt(lambda b: F.cross_entropy(logits[:SEQ], b["y"][0]), one)
    ce = []
    assert "does not depend" in _learnt(lambda b: ce.append(F.cross_entropy(logits, y)) or logits.sum(), batch)
    assert padding_hint(batch) is None
    assert padding_hint({"ids": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 0]])}) == \
        "batch['attention_mask'] marks padding"
    assert padding_hint((torch.tensor([[1, -100]]),)) == "batch[0] holds -100"


# ---- parity --------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb_h1", "zbv"])
def test_padded_hf_llama_batches_match_single_device_at_pp2(tmp_path, schedule):
    warnings.filterwarnings("ignore")
    # zbv places the last stage on rank 0, beside the first
    strategy = pp_strategy(schedule=schedule, virtual_stages=2 if schedule == "zbv" else 1)
    reference, records = _fit_pair(tmp_path, FineTune(), PaddedText(), strategy=strategy)
    assert_records_match(reference, records)


def _validated(out, devices, strategy):
    from torch.utils.data import DataLoader

    from tests.pipeline.test_pp_batches import _ValLoss

    os.makedirs(out)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, limit_train_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[_ValLoss(out)])
    trainer.fit(FineTune(), DataLoader(PaddedText(), batch_size=8), DataLoader(PaddedText(20, seed=1), batch_size=8))
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(devices)]


@pytest.mark.timeout(120)
def test_logged_validation_loss_matches_single_device_at_pp2(tmp_path):
    # validation_step's targets are learnt in its first run on the last stage (fit's setup traced training_step);
    # its batches of 8, 8 and 4 samples are averaged by Lightning with their sizes, as on one device
    warnings.filterwarnings("ignore")
    reference = _validated(str(tmp_path / "one"), 1, "auto")[0]
    for values in _validated(str(tmp_path / "pp"), 2, pp_strategy()):
        assert values == pytest.approx(reference, abs=LOSS_TOL)


@pytest.mark.timeout(120)
def test_a_micro_batch_without_targets_takes_no_part_as_on_one_device(tmp_path):
    # samples 6 and 7 of the first batch of 8 (its last micro-batch) are labelled -100 throughout: that
    # micro-batch's own mean is NaN, one device's mean over the batch is not
    warnings.filterwarnings("ignore")
    reference, records = _fit_pair(tmp_path, FineTune(), PaddedText(unlabelled=(6, 7)))
    assert all(torch.isfinite(torch.tensor(reference["losses"])))
    assert_records_match(reference, records)


@pytest.mark.timeout(120)
def test_masked_lm_with_labels_only_on_masked_tokens_matches_single_device_at_pp2(tmp_path):
    warnings.filterwarnings("ignore")
    reference, records = _fit_pair(tmp_path, FineTune(tiny_bert), PaddedText(masked=True))
    assert_records_match(reference, records)


@pytest.mark.timeout(120)
def test_uneven_micro_batches_and_accumulation_match_single_device(tmp_path):
    # batches of 7 into 4 micro-batches (2, 2, 2, 1 samples), two batches per optimizer step: each batch's
    # loss is its own mean over its targets, divided by 2, as Lightning does on one device
    warnings.filterwarnings("ignore")
    reference, records = _fit_pair(tmp_path, FineTune(), PaddedText(28), batch_size=7, steps=2,
                                   accumulate_grad_batches=2)
    assert_records_match(reference, records)


@pytest.mark.timeout(180)
def test_padded_hf_llama_batches_match_single_device_at_tp2_pp2(tmp_path):
    warnings.filterwarnings("ignore")
    reference, records = _fit_pair(tmp_path, FineTune(), PaddedText(), devices=4,
                                   strategy=pp_strategy(tensor_parallel=2), callbacks=[ShardRecorder(str(tmp_path))])
    for r, record in enumerate(records):
        assert record["losses"] == pytest.approx(reference["losses"], rel=LOSS_TOL, abs=LOSS_TOL)
        assert record["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], abs=LOSS_TOL)
        record["shards"] = torch.load(str(tmp_path / f"shards{r}.pt"), weights_only=False)
    full = gather_records(records)  # rank = pp * 2 + tp
    assert set(full) == set(reference["params"])
    assert_params_close(full, reference["params"], atol=PARAM_TOL)


class CountedBySum(FineTune):
    """The same mean over real tokens, computed from a summed cross-entropy: the pipeline cannot count it."""

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        summed = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum")
        loss = summed / (labels != -100).sum()
        self.log("train_loss", loss)
        return loss


def _setup_warnings(rank, world):
    engine = PipelineEngine(CountedBySum(), make_mesh(rank, world, pp=world), ParallelOptions(micro_batches=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.partition(default_collate([PaddedText()[i] for i in range(8)]))
    return [str(w.message) for w in caught if "loss" in str(w.message)]


@pytest.mark.timeout(120)
def test_a_loss_the_pipeline_cannot_count_is_warned_about_and_weighted_by_samples(tmp_path):
    first, second = run_distributed(_setup_warnings, 2)
    assert len(first) == 1 and not second  # once per run, at setup
    assert "reduction='sum'" in first[0] and "batch['attention_mask'] marks padding" in first[0]
    warnings.filterwarnings("ignore")
    reference, records = _fit_pair(tmp_path, CountedBySum(), PaddedText(), steps=1)
    # the sample-weighted mean of micro-batch means: off from the first step by far more than parity allows
    assert abs(records[-1]["losses"][0] - reference["losses"][0]) > 1e-3


def _fit_on_meta(out, devices, pp):
    """``trainer.init_module(empty_init=True)``: the model is split on the meta device, traced there, and only
    then materialised (with the values one device would get); the targets are learnt in the first step."""
    from torch.utils.data import DataLoader

    from tests.helpers.parity import _Recorder

    out.mkdir(parents=True)
    strategy = ParallelStrategy(pipeline_parallel=pp, micro_batches=4, start_method="fork", timeout=60)
    trainer = L.Trainer(accelerator="cpu", devices=devices, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        strategy=strategy, callbacks=[_Recorder(str(out))])
    with trainer.init_module(empty_init=True):
        module = FineTune()
    trainer.fit(module, DataLoader(PaddedText(), batch_size=8))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


@pytest.mark.timeout(120)
def test_a_model_initialised_on_the_meta_device_learns_its_targets_in_the_first_step(tmp_path):
    warnings.filterwarnings("ignore")
    reference = _fit_on_meta(tmp_path / "one", 1, 1)[0]
    assert_records_match(reference, _fit_on_meta(tmp_path / "pp2", 2, 2))


# ---- data parallelism: each replica's own mean, as Lightning's ddp --------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (2, 2)], ids=["dp2", "pp2xdp2", "tp2xpp2xdp2"])
def test_data_parallel_replicas_average_their_own_token_means_as_lightning_ddp(tmp_path, tp, pp):
    # DDP averages the replicas' gradients, each of its replica's mean over its own targets: with uneven
    # target counts per replica that is not one device's mean over the global batch, and it is what every
    # layout here reproduces, replica by replica
    from lightning.pytorch.strategies import DDPStrategy

    warnings.filterwarnings("ignore")
    module, data = FineTune(), PaddedText()
    ddp = fit_and_record(module, data, 4, str(tmp_path / "ddp"), devices=2, max_steps=3,
                         strategy=DDPStrategy(start_method="fork"))
    strategy = ParallelStrategy(data_parallel=2, tensor_parallel=tp, pipeline_parallel=pp, micro_batches=4,
                                start_method="fork", timeout=60)
    records = fit_and_record(module, data, 4, str(tmp_path / "ours"), devices=2 * tp * pp, max_steps=3,
                             strategy=strategy, callbacks=[ShardRecorder(str(tmp_path))])
    for rank, record in enumerate(records):  # rank = (stage * 2 + replica) * tp + tp_rank
        replica = rank // tp % 2
        assert record["losses"] == pytest.approx(ddp[replica]["losses"], rel=LOSS_TOL, abs=LOSS_TOL)
        record["shards"] = torch.load(str(tmp_path / f"shards{rank}.pt"), weights_only=False)
    replica0 = [r for rank, r in enumerate(records) if rank // tp % 2 == 0]
    full = gather_records(replica0) if tp > 1 else {n: p for r in replica0 for n, p in r["params"].items()}
    assert set(full) == set(ddp[0]["params"])
    assert_params_close(full, ddp[0]["params"], atol=PARAM_TOL)
    global_batch = fit_and_record(module, data, 8, str(tmp_path / "one"), max_steps=1, emulate_replicas=2)[0]
    assert abs(sum(d["losses"][0] for d in ddp) / 2 - global_batch["losses"][0]) > 1e-4  # the DDP semantics bite
