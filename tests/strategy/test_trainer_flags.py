"""Each Trainer flag that touches a strategy means under ours what it means on one device (or under
Lightning's own strategy), or is refused at setup with a message that names it.

Layouts, all fork-started gloo processes on CPU with a 2-layer GPT: DP = ``DataParallelStrategy``
(2 replicas), TP = ``TensorParallelStrategy`` (2 shards), PP = ``PipelineParallelStrategy`` (2 stages,
2 micro-batches), 3D = ``ParallelStrategy(tensor_parallel=2, pipeline_parallel=2)`` (4 processes).
The reference is one process reading the same global batches (``parity.ReplicaBatches``). Flags that
cannot interact share one launch.

Tolerances. float64 (``64-true``): the split runs only re-associate sums (row-parallel partial sums,
micro-batch means, the DP mean), so losses and parameters agree to ~1e-15 relative; after three
AdamW steps, whose 1/sqrt(v) amplifies the rounding of near-zero gradients, to 1e-10 (``F64_TOL``).
float32: the documented bound, 1e-5 for losses and 1e-4 for parameters (``tests/helpers/parity.py``).
bf16: a loss near 4 carries a bf16 ulp of 2^-6 (below 4) or 2^-5 (above), and re-association moves
it by about one (measured up to 0.023 for ``bf16-true``, 1e-3 for ``bf16-mixed``, whose loss is
float32); ``BF16_TRUE_TOL`` allows 2^-5, ``BF16_MIXED_TOL`` 3e-3, and the parameter dtype is checked
exactly. A flag that
changed meaning (a clip on one shard's norm, a skipped accumulation, a lost learning-rate update,
another batch) moves float32/float64 losses by >1e-3 and parameters by about the learning rate.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import (
    Callback,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    StochasticWeightAveraging,
)
from lightning.pytorch.plugins import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.model_summary import summarize
from torch.utils.data import DataLoader

from lightning_parallel import (
    DataParallelStrategy,
    ParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
)
from lightning_parallel.models.gpt import GPT
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    ReplicaBatches,
    assert_close_series,
    assert_params_close,
    fit_and_record,
)
from tests.helpers.resnet import ResNet, image_data
from tests.strategy.test_3d import gather_records, token_data

F64_TOL = 1e-10
LOSS_TOL, PARAM_TOL = LOSS_BOUND, PARAM_BOUND
BF16_TRUE_TOL, BF16_MIXED_TOL = 2**-5, 3e-3

#: layout -> (strategy factory, processes, data-parallel replicas)
LAYOUTS: dict[str, tuple[Callable[[], Any], int, int]] = {
    "dp": (lambda: DataParallelStrategy(start_method="fork"), 2, 2),
    "tp": (lambda: TensorParallelStrategy(start_method="fork"), 2, 1),
    "pp": (lambda: PipelineParallelStrategy(micro_batches=2, start_method="fork"), 2, 1),
    "3d": (lambda: ParallelStrategy(tensor_parallel=2, pipeline_parallel=2, micro_batches=2, start_method="fork"),
           4, 1),
}
SPLIT = ["tp", "pp", "3d"]
PER_RANK_BATCH = 4


def tiny_gpt(**kwargs: Any) -> GPT:
    L.seed_everything(0, verbose=False)
    return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, lr=1e-2, **kwargs)


class Record(Callback):
    """Per rank: the loss of each batch, learning rates and validation losses as Lightning saw them,
    the final parameters (after ``on_train_end`` hooks such as SWA's), and the profiled steps."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.val_losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
        if "lr-AdamW/pg1" in trainer.callback_metrics:
            self.lrs.append(float(trainer.callback_metrics["lr-AdamW/pg1"]))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:  # barebones logs nothing
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_fit_end(self, trainer, pl_module):
        named = list(pl_module.named_parameters(remove_duplicate=False))
        params = {n: p.detach().cpu().clone() for n, p in named}
        shards = {n: p.tp_shard for n, p in named if getattr(p, "tp_shard", None) is not None}
        profiled = getattr(trainer.profiler, "recorded_durations", {})
        steps = sum(len(v) for k, v in profiled.items() if k.endswith(".training_step"))
        torch.save({"losses": self.losses, "lrs": self.lrs, "val_losses": self.val_losses, "params": params,
                    "shards": shards, "global_step": trainer.global_step, "profiled_steps": steps},
                   os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class Data(L.LightningDataModule):
    """Token batches; the reference reads, per epoch, the global batches the parallel run reads.

    ``replicas=None``: a plain loader (the parallel run, whose sampler Lightning replaces, or a run
    without the distributed sampler). Otherwise ``ReplicaBatches`` at the Trainer's epoch, so a
    loader rebuilt every epoch (``reload_dataloaders_every_n_epochs``) keeps drawing as it would.
    """

    def __init__(self, batch_size: int, replicas: int | None = None):
        super().__init__()
        self.batch_size, self.replicas = batch_size, replicas

    def train_dataloader(self):
        data = token_data()
        if self.replicas is None:
            return DataLoader(data, batch_size=self.batch_size)
        sampler = ReplicaBatches(len(data), self.replicas, self.batch_size // self.replicas)
        sampler.epoch = self.trainer.current_epoch
        return DataLoader(data, batch_sampler=sampler)

    def val_dataloader(self):
        return DataLoader(token_data(16), batch_size=PER_RANK_BATCH)


def run(tmp_path, layout: str, flags: Callable[[], dict], module: Callable[[], L.LightningModule] = tiny_gpt,
        distributed_sampler: bool = True) -> list[dict]:
    """Fit under ``layout`` (a key of ``LAYOUTS``, or ``"ref1"``/``"ref2"``: one process reading the
    global batches of 1 or 2 replicas); ``flags()`` gives fresh Trainer arguments (and callbacks)."""
    out = tmp_path / layout
    out.mkdir(parents=True)
    kwargs = dict(max_steps=3, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  use_distributed_sampler=distributed_sampler)
    kwargs.update(flags())
    callbacks = [Record(str(out))] + kwargs.pop("callbacks", [])
    if layout in LAYOUTS:
        make, devices, _ = LAYOUTS[layout]
        strategy, data = make(), Data(PER_RANK_BATCH)
    else:
        replicas = int(layout[-1])
        strategy, devices = "auto", 1
        data = Data(PER_RANK_BATCH * replicas, replicas if distributed_sampler else None)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=callbacks,
                        default_root_dir=str(out), **kwargs)
    trainer.fit(module(), datamodule=data)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def run_with_reference(tmp_path, layout: str, flags: Callable[[], dict], **kwargs: Any) -> tuple[dict, list[dict]]:
    replicas = LAYOUTS[layout][2] if kwargs.get("distributed_sampler", True) else 1
    return run(tmp_path, f"ref{replicas}", flags, **kwargs)[0], run(tmp_path, layout, flags, **kwargs)


def replica_mean(records: list[dict], layout: str, key: str = "losses") -> list[float]:
    """Per step, the mean of the replicas' values: ranks 0 and 1 under DP; a split layout here has one
    replica, and each of its ranks returns the replica's value."""
    replicas = records[: LAYOUTS[layout][2]]
    return torch.tensor([r[key] for r in replicas], dtype=torch.float64).mean(0).tolist()


def assert_matches(ref: dict, records: list[dict], layout: str, loss_tol: float, param_tol: float,
                   keys: tuple[str, ...] = ("losses",)) -> None:
    for key in keys:
        assert len(ref[key]) > 0, key
        torch.testing.assert_close(torch.tensor(replica_mean(records, layout, key), dtype=torch.float64),
                                   torch.tensor(ref[key], dtype=torch.float64), atol=loss_tol, rtol=0,
                                   msg=lambda m: f"{key}: {m}")
    full = gather_records(records)
    assert set(full) == set(ref["params"])
    for name, expected in ref["params"].items():
        torch.testing.assert_close(full[name], expected, atol=param_tol, rtol=0, msg=lambda m: f"{name}: {m}")
    assert {r["global_step"] for r in records} == {ref["global_step"]}


# ---- parity: flags that change nothing a strategy computes ----------------------------------
def numerics_flags() -> dict:
    """float64, checks and profiling, clip by value, mid-epoch validation without inference mode."""
    return dict(precision="64-true", deterministic=True, detect_anomaly=True, inference_mode=False, profiler="simple",
                gradient_clip_val=0.05, gradient_clip_algorithm="value", max_steps=4, val_check_interval=2,
                limit_val_batches=None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float64_checks_profiler_clip_by_value_and_mid_epoch_validation_match_one_device(tmp_path, layout):
    ref, records = run_with_reference(tmp_path, layout, numerics_flags)
    assert_matches(ref, records, layout, F64_TOL, F64_TOL, keys=("losses", "val_losses"))
    assert len(ref["val_losses"]) == 2  # after batches 2 and 4
    assert all(p.dtype == torch.float64 for p in gather_records(records).values())
    assert [r["profiled_steps"] for r in records] == [4] * len(records)


def schedule_flags() -> dict:
    """Per-epoch schedules: accumulation 1 then 2, loaders rebuilt every epoch, a learning-rate
    warm-up watched by LearningRateMonitor, clip by (global) norm."""
    return dict(max_steps=-1, max_epochs=3, limit_train_batches=4, reload_dataloaders_every_n_epochs=1,
                gradient_clip_val=0.1, logger=True, log_every_n_steps=1,
                callbacks=[GradientAccumulationScheduler({1: 2}), LearningRateMonitor("step")])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_accumulation_schedule_reloaded_loaders_lr_monitor_and_clip_by_norm_match_one_device(tmp_path, layout):
    def module():
        return tiny_gpt(warmup_steps=4)

    ref = run(tmp_path, f"ref{LAYOUTS[layout][2]}", schedule_flags, module)[0]
    records = run(tmp_path, layout, schedule_flags, module)
    assert_matches(ref, records, layout, LOSS_TOL, PARAM_TOL, keys=("losses", "lrs"))
    assert ref["global_step"] == 4 + 2 + 2  # accumulation 2 from epoch 1 on
    assert len(set(ref["lrs"])) > 2  # the warm-up moved the learning rate


def barebones_flags() -> dict:
    """``barebones`` with clip by norm, each rank reading the loader as given (no distributed sampler)
    and the first two batches of each epoch (``overfit_batches``)."""
    return dict(barebones=True, gradient_clip_val=0.1, overfit_batches=2, max_steps=4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_barebones_overfit_batches_without_distributed_sampler_match_one_device(tmp_path, layout):
    # every DP replica reads the same batch, so the global batch is that batch (a mean of equal means)
    ref, records = run_with_reference(tmp_path, layout, barebones_flags, distributed_sampler=False)
    assert_matches(ref, records, layout, LOSS_TOL, PARAM_TOL)
    assert ref["global_step"] == 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision, tol, dtype", [("bf16-mixed", BF16_MIXED_TOL, torch.float32),
                                                   ("bf16-true", BF16_TRUE_TOL, torch.bfloat16)])
@pytest.mark.parametrize("layout", ["dp", "tp", "pp", "3d"])
def test_bfloat16_precisions_match_one_device(tmp_path, layout, precision, tol, dtype):
    ref, records = run_with_reference(tmp_path, layout, lambda: dict(precision=precision))
    losses = replica_mean(records, layout)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=tol, rtol=0)
    assert {p.dtype for p in gather_records(records).values()} == {dtype}


def test_16_mixed_on_cpu_becomes_bf16_mixed_as_under_lightning():
    # Lightning substitutes bf16 autocast on CPU; with a GPU loss scaler, PP refuses it (test_errors.py)
    ours = L.Trainer(accelerator="cpu", devices=2, strategy=LAYOUTS["3d"][0](), precision="16-mixed", logger=False)
    theirs = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_fork", precision="16-mixed", logger=False)
    assert ours.precision_plugin.precision == theirs.precision_plugin.precision == "bf16-mixed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["dp", "tp", "pp", "3d"])
def test_max_time_stops_every_rank_at_the_same_step(tmp_path, layout):
    # the Timer broadcasts rank 0's decision; ranks that disagreed would hang or differ in steps
    records = run(tmp_path, layout, lambda: dict(max_steps=-1, max_epochs=None, max_time={"seconds": 1}))
    steps = {r["global_step"] for r in records}
    assert len(steps) == 1 and steps.pop() > 0


# ---- callbacks ------------------------------------------------------------------------------
class SummaryRecord(ModelSummary):
    """Lightning's summary callback, saving what it would print (rank 0 prints)."""

    def __init__(self, path: str):
        super().__init__(max_depth=2)
        self.path = path

    def summarize(self, summary_data, total_parameters, trainable_parameters, *args, **kwargs):
        rows = dict(summary_data)
        torch.save({"total": total_parameters, "trainable": trainable_parameters,
                    "rows": dict(zip(rows["Name"], rows["Params"]))}, self.path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["dp", "tp", "pp", "3d"])
def test_model_summary_counts_the_whole_model(tmp_path, layout):
    # what one device prints: Lightning's own summary of the unsplit module
    columns = dict(summarize(tiny_gpt(), max_depth=2)._get_summary_data())
    expected = dict(zip(columns["Name"], columns["Params"]))
    path = str(tmp_path / "summary.pt")
    run(tmp_path, layout, lambda: dict(callbacks=[SummaryRecord(path)]))
    printed = torch.load(path)
    model = tiny_gpt()
    assert printed["total"] == printed["trainable"] == sum(p.numel() for p in model.parameters())
    assert printed["rows"] == expected


def swa_flags() -> dict:
    return dict(max_steps=-1, max_epochs=2, limit_train_batches=2,
                callbacks=[StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)])


@pytest.mark.timeout(60)
def test_stochastic_weight_averaging_under_dp_matches_one_device(tmp_path):
    ref, records = run_with_reference(tmp_path, "dp", swa_flags)
    assert_matches(ref, records, "dp", LOSS_TOL, PARAM_TOL)


class _Saves(TorchCheckpointIO):
    """Notes each file it writes in ``saved_by_plugin`` beside it (it runs in the worker processes)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        super().save_checkpoint(checkpoint, path, storage_options)
        with open(os.path.join(os.path.dirname(path), "saved_by_plugin"), "a") as f:
            f.write(f"{path}\n")


@pytest.mark.timeout(60)
def test_checkpoint_io_plugins_write_the_checkpoints_of_dp(tmp_path):
    for name, plugin in [("plain", _Saves()), ("async", AsyncCheckpointIO(_Saves()))]:
        out = tmp_path / name
        run(out, "dp", lambda: dict(plugins=[plugin], enable_checkpointing=True,
                                     callbacks=[ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True)]))
        assert (out / "ckpt" / "last.ckpt").is_file()
        assert "last.ckpt" in (out / "ckpt" / "saved_by_plugin").read_text()


# ---- refused at setup, on every rank, naming the flag ----------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", SPLIT)
@pytest.mark.parametrize("flags, named", [
    (lambda: dict(plugins=[_Saves()]), r"plugins=\[_Saves"),
    (lambda: dict(plugins=[AsyncCheckpointIO(_Saves())]), r"plugins=\[AsyncCheckpointIO\(_Saves"),
], ids=["checkpoint_io", "async_checkpoint_io"])
def test_split_model_refuses_flags_it_cannot_honour(tmp_path, layout, flags, named):
    with pytest.raises(Exception, match=named):
        run(tmp_path, layout, flags)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["pp", "3d"])
def test_stochastic_weight_averaging_is_refused_under_pipeline_parallelism(tmp_path, layout):
    # it switches Lightning's backward on again at each epoch end; EMA and TP/ZeRO: test_weight_averaging.py
    with pytest.raises(Exception, match=r"StochasticWeightAveraging.*EMAWeightAveraging"):
        run(tmp_path, layout, swa_flags)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batch_size_finder_is_refused_as_for_lightning_ddp(layout):
    trainer = L.Trainer(accelerator="cpu", devices=LAYOUTS[layout][1], strategy=LAYOUTS[layout][0](), logger=False)
    with pytest.raises(ValueError, match="not supported with distributed strategies"):
        Tuner(trainer).scale_batch_size(tiny_gpt())


# ---- the tuner ------------------------------------------------------------------------------
def run_as_torchrun(fn: Callable[[int], Any], world_size: int, timeout: float = 90.0) -> list[Any]:
    """``fn(rank)`` on ``world_size`` fork-started processes that see torchrun's variables, so each
    builds its own Trainer and Lightning launches nothing (``TorchElasticEnvironment``). The tuner
    needs this launch: under Lightning's fork or spawn launchers (``ddp_fork`` included) its early
    exit ends the worker processes with ``_TunerExitException``."""
    import io
    import multiprocessing as mp
    import traceback

    from tests.helpers.processes import free_port

    def worker(rank, port, queue):
        try:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0")
            torch.set_num_threads(1)
            buffer = io.BytesIO()
            torch.save(fn(rank), buffer)
            queue.put((rank, True, buffer.getvalue()))
        except BaseException:  # noqa: BLE001 - report every failure to the parent
            queue.put((rank, False, traceback.format_exc()))

    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            assert ok, f"rank {rank}:\n{value}"
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


def find_lr(root: str, strategy: Any, devices: int, data: Data) -> dict:
    """``Tuner.lr_find`` (8 steps, then the initial weights restored from a checkpoint)."""
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, max_steps=3,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root)
    module = tiny_gpt()
    initial = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    finder = Tuner(trainer).lr_find(module, datamodule=data, num_training=8, update_attr=False)
    named = list(module.named_parameters(remove_duplicate=False))
    return {"losses": finder.results["loss"], "initial": initial, "params": {n: p.detach().clone() for n, p in named},
            "shards": {n: p.tp_shard for n, p in named if getattr(p, "tp_shard", None) is not None}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["pp", "3d"])
def test_learning_rate_finder_under_torchrun_matches_one_device_and_restores_the_weights(tmp_path, layout):
    devices = LAYOUTS[layout][1]
    ref = find_lr(str(tmp_path / "ref"), "auto", 1, Data(PER_RANK_BATCH, replicas=1))

    def tune(rank):
        # the default start method: torchrun started the processes, so Lightning launches none
        strategy = ParallelStrategy(tensor_parallel=2 if layout == "3d" else 1, pipeline_parallel=2, micro_batches=2)
        return find_lr(str(tmp_path / layout), strategy, devices, Data(PER_RANK_BATCH))

    records = run_as_torchrun(tune, devices)
    assert len(ref["losses"]) == 8
    for record in records:
        torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref["losses"]), atol=LOSS_TOL, rtol=0)
    restored = gather_records(records)
    assert set(restored) == set(ref["initial"])
    for name, initial in ref["initial"].items():
        torch.testing.assert_close(restored[name], initial, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")


# ---- sync_batchnorm, on the ResNet example --------------------------------------------------
@pytest.mark.timeout(90)
def test_resnet_under_dp_matches_lightning_ddp(tmp_path):
    # BatchNorm normalises each replica's batch in both; running statistics stay per replica (rank 0's
    # are the ones checkpointed), as DDP's rank 0 keeps its own and broadcasts them
    L.seed_everything(0, verbose=False)
    module, data = ResNet(), image_data()
    ours = fit_and_record(module, data, PER_RANK_BATCH, str(tmp_path / "ours"), devices=2,
                          strategy=DataParallelStrategy(start_method="fork"), max_steps=3)
    ddp = fit_and_record(module, data, PER_RANK_BATCH, str(tmp_path / "ddp"), devices=2,
                         strategy=DDPStrategy(start_method="fork"), max_steps=3)
    assert ddp[0]["losses"][-1] != ddp[0]["losses"][0]
    for mine, theirs in zip(ours, ddp):
        assert_close_series(mine["losses"], theirs["losses"], atol=LOSS_TOL)
        assert_params_close(mine["params"], theirs["params"], atol=PARAM_TOL)


class NormGroups(Callback):
    """At the start of fit, each BatchNorm's class and the ranks it averages statistics over."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        norms = [(type(m).__name__, dist.get_process_group_ranks(m.process_group) if m.process_group else None)
                 for m in pl_module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        torch.save(norms, os.path.join(self.out_dir, f"norms{trainer.global_rank}.pt"))


@pytest.mark.timeout(60)
def test_sync_batchnorm_converts_every_resnet_norm_over_the_data_parallel_group(tmp_path):
    # SyncBatchNorm normalises CUDA tensors only: on CPU, check the conversion (no training step)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=DataParallelStrategy(start_method="fork"),
                        sync_batchnorm=True, limit_train_batches=0, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[NormGroups(str(tmp_path))])
    module = ResNet()
    trainer.fit(module, DataLoader(image_data(8), batch_size=PER_RANK_BATCH))
    count = sum(isinstance(m, torch.nn.BatchNorm2d) for m in module.modules())
    assert count == 1 + 3 * 16 + 4  # stem, three per bottleneck, one per projected shortcut
    for rank in range(2):
        assert torch.load(tmp_path / f"norms{rank}.pt") == [("SyncBatchNorm", [0, 1])] * count


@pytest.mark.timeout(90)
def test_resnet_stage_split_into_pipeline_stages_matches_one_device(tmp_path):
    # the blocks of one ResNet stage (layer3: 6 bottlenecks, the first of another width) are the
    # pipeline's blocks; stage 0 also runs the stem, layer1 and layer2, stage 1 layer4 and the head.
    # One micro-batch: BatchNorm then normalises the batch the reference normalises (with more
    # micro-batches it normalises each micro-batch, as in GPipe). float64, so the comparison is
    # relative: the last stages normalise over 4 values, which makes gradients ill-conditioned.
    L.seed_everything(0, verbose=False)
    module, data = ResNet(), image_data()
    ref = fit_and_record(module, data, PER_RANK_BATCH, str(tmp_path / "ref"), emulate_replicas=1, max_steps=3,
                         precision="64-true")[0]
    strategy = PipelineParallelStrategy(micro_batches=1, pipeline_blocks="layer3", pipeline_layout=[1, 5],
                                        start_method="fork")
    records = fit_and_record(module, data, PER_RANK_BATCH, str(tmp_path / "pp"), devices=2, strategy=strategy,
                             max_steps=3, precision="64-true")
    assert set(records[0]["params"]) & set(records[1]["params"]) == set()  # each stage holds its own
    assert "layer3.0.conv1.weight" in records[0]["params"] and "layer3.1.conv1.weight" in records[1]["params"]
    for record in records:
        assert_close_series(record["losses"], ref["losses"], atol=0, rtol=1e-9)
        assert_params_close(record["params"], ref["params"], atol=1e-12, rtol=1e-9)


# ---- the order of the training batches --------------------------------------------------------
class DataOrder(Callback):
    """Saves, per rank, the strategy's note on the training batches' order (set when training starts)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.save(trainer.strategy.data_order, os.path.join(self.out_dir, f"order{trainer.global_rank}.pt"))


@pytest.mark.timeout(60)
def test_start_says_when_lightnings_sampler_reorders_a_loader_and_how_to_keep_its_order(tmp_path):
    for sampler in (True, False):
        out = tmp_path / str(sampler)
        out.mkdir()
        run(out, "tp", lambda: dict(max_steps=1, callbacks=[DataOrder(str(out))]), distributed_sampler=sampler)
        notes = {torch.load(out / f"order{r}.pt") for r in range(2)}
        if sampler:  # the plain loader (no shuffle) is read in Lightning's shuffled order, as under ddp
            (note,) = notes
            assert "DistributedSampler(shuffle=True)" in note and "strategy='ddp' on 1 device" in note
            assert "Trainer(use_distributed_sampler=False)" in note
        else:
            assert notes == {None}
