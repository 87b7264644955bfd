"""Pipeline-parallel training reproduces one device, step by step (CPU, gloo, fork).

Tolerances: the pipeline computes the same float32 arithmetic in a different association (the
batch mean is a weighted sum of micro-batch means; tied gradients are summed across stages), so
losses agree to ~5e-7 (measured). Parameters after AdamW agree to ~3e-6 with pipeline stages alone
and 2.3e-5 with data parallelism added (measured, 3 steps): Adam divides by sqrt(v), so a slice
whose gradient is (nearly) zero (the key bias of attention, by softmax shift invariance; embedding
rows of rare tokens) turns rounding noise into updates of up to the learning rate. A wrong gradient
(a tied weight not summed, a micro-batch scaled twice, a replica not averaged) moves parameters by
about the learning rate (3e-3) per step and losses by >1e-3, far outside LOSS_TOL and PARAM_TOL.
"""

import os
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import Op, PipelineEngine
from lightning_parallel.pipeline.memory import ActivationMeter
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    TensorDataset,
    assert_param_close,
    assert_params_close,
    fit_and_record,
)
from tests.helpers.processes import make_mesh, run_distributed

LOSS_TOL = LOSS_BOUND  # the documented float32 parity bound (tests/helpers/parity.py)
PARAM_TOL = PARAM_BOUND
STEPS = 3
BATCH = 8


def gpt():
    torch.manual_seed(0)
    return GPT(n_layer=8, n_embd=32, n_head=2, block_size=16)


def batches(steps=STEPS, batch=BATCH, vocab=256):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, 16), generator=g), torch.randint(0, vocab, (batch, 16), generator=g))
            for _ in range(steps)]


def single_device(make_model, data):
    model = make_model()
    opt = model.configure_optimizers()
    losses = []
    for i, batch in enumerate(data):
        opt.zero_grad()
        loss = model.training_step(batch, i)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def train_pipeline(mesh, make_model, data, micro_batches, schedule, virtual=1, dp_rank=0, dp_size=1):
    """What the strategy does per step: zero, pipeline step, DP average, tied-grad sum, optimizer step."""
    model = make_model()
    engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=micro_batches, schedule=schedule,
                                                         virtual_stages=virtual))
    engine.partition(tuple(t.chunk(dp_size)[dp_rank] for t in data[0]))  # the strategy passes the first batch
    opt = model.configure_optimizers()
    losses = []
    for i, batch in enumerate(data):
        opt.zero_grad()
        shard = tuple(t.chunk(dp_size)[dp_rank] for t in batch)
        loss = engine.training_step(shard, i, loss_scale=1.0)
        if dp_size > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=mesh.dp_group)
                    p.grad /= dp_size
            dist.all_reduce(loss, group=mesh.dp_group)
            loss /= dp_size
        engine.sync_tied_grads()
        opt.step()
        losses.append(loss.item())
    # numpy arrays travel back to the test process by value (tensors would be shared by file descriptor)
    return losses, {k: v.numpy().copy() for k, v in model.state_dict().items()}


CONFIGS = [(m, s, v) for m in (4, 8) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))]


def _all_configs(rank, world):
    warnings.filterwarnings("ignore")
    mesh = make_mesh(rank, world, pp=world)
    return {cfg: train_pipeline(mesh, gpt, batches(), *cfg) for cfg in CONFIGS}


@pytest.fixture(scope="module")
def reference():
    return single_device(gpt, batches())


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
def pipeline_runs(request):
    return request.param, run_distributed(_all_configs, request.param, timeout=90)


def assert_matches(reference, ranks):
    ref_losses, ref_params = reference
    for losses, params in ranks:  # every rank returns the step's loss
        assert losses == pytest.approx(ref_losses, rel=LOSS_TOL, abs=LOSS_TOL)
        for name, value in params.items():
            assert_param_close(torch.from_numpy(value), ref_params[name], atol=PARAM_TOL, name=name)
    covered = set().union(*(params for _, params in ranks))
    assert covered == set(ref_params)  # every parameter lives on some stage


@pytest.mark.timeout(150)
@pytest.mark.parametrize("config", CONFIGS, ids=[f"m{m}-{s}" for m, s, _ in CONFIGS])
def test_gpt_matches_single_device_step_by_step(reference, pipeline_runs, config):
    _, results = pipeline_runs
    assert_matches(reference, [r[config] for r in results])


# ---- Hugging Face Llama, loss computed inside the model from labels -----------------------------
def llama():
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                 tie_word_embeddings=True)
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.model(input_ids=x, labels=y).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)

    return LlamaModule()


def _uneven(rank, world):
    warnings.filterwarnings("ignore")
    mesh = make_mesh(rank, world, pp=world)
    model = gpt()
    engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=4, schedule="1f1b"))
    engine.partition()
    result = train_pipeline(mesh, gpt, batches(batch=10), 4, "1f1b")
    engine.training_step(batches(steps=1, batch=10)[0], 0)
    return result, sorted(key[0] for _, key in engine.link.received)


@pytest.mark.timeout(60)
def test_uneven_micro_batches_match_and_send_one_shape_header_per_size():
    """A batch of 10 in 4 micro-batches (3, 3, 2, 2): the loss is still the batch mean, and the last
    stage learns a shape once per micro-batch size (2 headers a step, not 4)."""
    results = run_distributed(_uneven, 2)
    assert_matches(single_device(gpt, batches(batch=10)), [r for r, _ in results])
    assert results[0][1] == []  # the first stage receives no hidden states
    assert results[1][1] == [0.2, 0.3]


def _llama(rank, world):
    warnings.filterwarnings("ignore")
    return train_pipeline(make_mesh(rank, world, pp=world), llama, batches(vocab=128), 4, "1f1b")


@pytest.mark.timeout(60)
def test_hf_llama_with_tied_embeddings_matches_single_device_at_pp2():
    assert_matches(single_device(llama, batches(vocab=128)), run_distributed(_llama, 2))


# ---- composition with data parallelism ------------------------------------------------------------
def _pp2_dp2(rank, world):
    warnings.filterwarnings("ignore")
    mesh = make_mesh(rank, world, pp=2)
    return train_pipeline(mesh, gpt, batches(), 2, "1f1b", dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)


@pytest.mark.timeout(60)
def test_pp2_x_dp2_on_four_processes_matches_single_device():
    assert_matches(single_device(gpt, batches()), run_distributed(_pp2_dp2, 4))


# ---- activation memory ----------------------------------------------------------------------------
def _peak_activation_bytes(rank, world):
    mesh = make_mesh(rank, world, pp=world)
    data = batches(steps=1, batch=16)[0]
    peaks = {}
    for schedule, micro_batches, batch in (("1f1b", 8, data), ("gpipe", 8, data), ("gpipe", 1, tuple(t[:2] for t in data))):
        model = gpt()
        engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=micro_batches, schedule=schedule))
        engine.partition()
        engine.meter = ActivationMeter(model)
        engine.training_step(batch, 0)
        assert engine.meter.live == 0  # everything kept for backward was freed by the end of the step
        peaks[(schedule, micro_batches)] = engine.meter.peak
    return peaks


@pytest.mark.timeout(60)
def test_1f1b_keeps_at_most_p_micro_batches_of_activations_where_gpipe_keeps_m():
    stages = 2
    for rank, peaks in enumerate(run_distributed(_peak_activation_bytes, stages)):
        one = peaks[("gpipe", 1)]  # one micro-batch of 2 samples, measured alone
        assert peaks[("gpipe", 8)] == pytest.approx(8 * one, rel=0.05)
        assert peaks[("1f1b", 8)] == pytest.approx((stages - rank) * one, rel=0.05)


def _sent_outputs_storage(rank, world):
    mesh = make_mesh(rank, world, pp=world)
    model = gpt()
    engine = PipelineEngine(model, mesh, ParallelOptions(micro_batches=4, schedule="1f1b"))
    engine.partition()
    sent, exchange = [], engine.link.exchange

    def recording_exchange(messages, *args, **kwargs):
        sent.extend(m.tensor for m in messages if m.action.op is Op.SEND_F)
        return exchange(messages, *args, **kwargs)

    engine.link.exchange = recording_exchange
    engine.training_step(batches(steps=1)[0], 0)
    return [out.untyped_storage().nbytes() for out in sent]


@pytest.mark.timeout(30)
def test_sent_activation_storage_is_released_keeping_only_the_graph():
    sizes, last_sizes = run_distributed(_sent_outputs_storage, 2)
    assert len(sizes) == 4 and last_sizes == []  # stage 0 sent one activation per micro-batch
    assert all(size <= 4 for size in sizes)  # one float left of each 2 x 16 x 32 (backward still matched)


# ---- inside Lightning: ParallelStrategy(pipeline_parallel=...) drives the engine ------------------


def token_data(n=64, vocab=256):
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randint(0, vocab, (n, 16), generator=g), torch.randint(0, vocab, (n, 16), generator=g))


def small_gpt():
    torch.manual_seed(0)
    return GPT(n_layer=4, n_embd=32, n_head=2, block_size=16)


def pp_strategy(stages=2, micro_batches=4, **kwargs):
    return ParallelStrategy(pipeline_parallel=stages, micro_batches=micro_batches, start_method="fork", timeout=60, **kwargs)


def assert_records_match(reference, records, replicas=1, loss_tol=LOSS_TOL, param_tol=PARAM_TOL):
    """Every rank holds its stage's parameters as on one device; the replicas' mean loss is the reference's."""
    for first in range(0, len(records), replicas):
        group = records[first : first + replicas]  # the replicas of one stage (rank = stage * replicas + replica)
        losses = torch.tensor([r["losses"] for r in group]).mean(0).tolist()
        assert losses == pytest.approx(reference["losses"], rel=loss_tol, abs=loss_tol)
        logged = sum(r["metrics"]["train_loss"] for r in group) / replicas
        assert logged == pytest.approx(reference["metrics"]["train_loss"], rel=loss_tol, abs=loss_tol)
    covered = set()
    for record in records:
        assert record["global_step"] == reference["global_step"]
        # records list tied weights under every name (the last stage holds the head's)
        assert_params_close(record["params"], reference["params"], atol=param_tol)
        covered |= set(record["params"])
    assert covered == set(reference["params"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("trainer_kwargs", [{}, {"accumulate_grad_batches": 2}, {"gradient_clip_val": 0.05}],
                         ids=["plain", "accumulation", "clipping"])
def test_trainer_pp2_matches_single_device_and_logs_on_every_rank(tmp_path, trainer_kwargs):
    module, data = small_gpt(), token_data()
    reference = fit_and_record(module, data, 8, str(tmp_path / "ref"), max_steps=4, **trainer_kwargs)[0]
    # one replica: every stage reads the batches in order, like the reference
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=2, strategy=pp_strategy(),
                             max_steps=4, use_distributed_sampler=False, **trainer_kwargs)
    assert_records_match(reference, records)


@pytest.mark.timeout(60)
def test_trainer_pp2_x_dp2_on_four_processes_matches_single_device(tmp_path):
    module, data = small_gpt(), token_data()
    # Lightning gives each replica a DistributedSampler (shuffled, seeded): both stages of a replica read
    # shard ``dp_rank`` of the seeded permutation; the reference reads step k's two shards as one batch
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(int(os.getenv("PL_GLOBAL_SEED", 0))))
    shards = [perm[r::2] for r in range(2)]
    order = torch.cat([shards[r][8 * k : 8 * k + 8] for k in range(len(data) // 16) for r in range(2)])
    reference = fit_and_record(module, TensorDataset(*(t[order] for t in data.tensors)), 16, str(tmp_path / "ref"),
                               max_steps=3)[0]
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=4, strategy=pp_strategy(micro_batches=2),
                             max_steps=3)
    assert_records_match(reference, records, replicas=2)


@pytest.mark.timeout(60)
def test_bf16_mixed_pipeline_tracks_single_device(tmp_path):
    # bf16 keeps 8 bits of mantissa: the first step agrees to bf16 rounding, later ones drift because the
    # tied gradient is summed from two bf16-accumulated halves instead of inside one autograd graph
    module, data = small_gpt(), token_data()
    reference = fit_and_record(module, data, 8, str(tmp_path / "ref"), max_steps=3, precision="bf16-mixed")[0]
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=2, strategy=pp_strategy(),
                             max_steps=3, precision="bf16-mixed", use_distributed_sampler=False)
    for record in records:
        assert record["losses"][0] == pytest.approx(reference["losses"][0], abs=1e-2)
        assert record["losses"] == pytest.approx(reference["losses"], abs=5e-2)


class _Monitored(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        ckpt = trainer.checkpoint_callback
        torch.save({"val_loss": [float(trainer.callback_metrics["val_loss"])], "best": float(ckpt.best_model_score),
                    "path": ckpt.best_model_path}, f"{self.out}/rank{trainer.global_rank}.pt")


def _fit_monitored(module, out, devices, strategy):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, limit_train_batches=2,
                        limit_val_batches=2, num_sanity_val_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[ModelCheckpoint(dirpath=f"{out}/ckpt", monitor="val_loss", mode="min"), _Monitored(out)])
    trainer.fit(module, DataLoader(token_data(), batch_size=8), DataLoader(token_data(32), batch_size=8))
    return [torch.load(f"{out}/rank{r}.pt") for r in range(devices)]


@pytest.mark.timeout(60)
def test_monitored_validation_metric_is_checkpointed_on_every_rank(tmp_path):
    os.makedirs(tmp_path / "ref"), os.makedirs(tmp_path / "pp")
    reference = _fit_monitored(small_gpt(), tmp_path / "ref", 1, "auto")[0]
    records = _fit_monitored(small_gpt(), tmp_path / "pp", 2, pp_strategy())
    for record in records:
        assert record["val_loss"] == pytest.approx(reference["val_loss"], abs=LOSS_TOL)
        assert record["best"] == pytest.approx(reference["best"], abs=LOSS_TOL)
        assert os.path.basename(record["path"]) == os.path.basename(reference["path"])


@pytest.mark.timeout(60)
def test_trainer_pp2_x_tp2_on_four_processes_matches_single_device_losses(tmp_path):
    # each stage is also sharded Megatron-style over 2 ranks; parameters are shards, so losses are compared
    module, data = small_gpt(), token_data()
    reference = fit_and_record(module, data, 8, str(tmp_path / "ref"), max_steps=3)[0]
    records = fit_and_record(module, data, 8, str(tmp_path / "pp"), devices=4, strategy=pp_strategy(tensor_parallel=2),
                             max_steps=3, use_distributed_sampler=False)
    for record in records:
        assert record["losses"] == pytest.approx(reference["losses"], rel=LOSS_TOL, abs=LOSS_TOL)
