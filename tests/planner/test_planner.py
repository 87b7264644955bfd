"""The layout search: enumeration, memory, the cost model, determinism, `lp-plan --search` and
`strategy=auto` training with parity against one device.

All but the training test and the calibration test run in this process on meta-device models.
"""

from __future__ import annotations

import logging
import math
import os
import shlex

import lightning as L
import pytest
import torch

from lightning_parallel import ParallelStrategy
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.models.gpt import GPT
from lightning_parallel.pipeline.schedules import SCHEDULES
from lightning_parallel.planner import Cluster, Constraints, PlanError, Workload, search
from lightning_parallel.planner.calibrate import measure, nominal
from lightning_parallel.planner.space import Rates, enumerate_layouts, schedule_actions
from tests.helpers.parity import (
    TensorDataset,
    assert_close_series,
    fit_and_record,
    mean_over_ranks,
)

GIB = 1024**3
CPU = nominal("cpu")
GPU = nominal("cuda")


def meta_gpt(**sizes) -> GPT:
    with torch.device("meta"):
        return GPT(**{"vocab_size": 64, "block_size": 16, "n_layer": 3, "n_head": 4, "n_embd": 32, **sizes})


def cluster(nodes=1, devices=8, memory=GIB, rates: Rates = GPU, shared=False) -> Cluster:
    return Cluster(nodes, devices, memory, rates, shared_compute=shared)


def one(model, cl, work, **fixed):
    """The prediction of the single layout ``fixed`` pins (no ZeRO, no recomputation)."""
    constraints = Constraints(**{"zero": 0, "recompute": (False,), **fixed})
    result = search(model, cl, work, constraints)
    assert len({r.candidate.layout for r in result.ranked}) == 1, [r.candidate.layout for r in result.ranked]
    return result.best


def test_layouts_respect_divisibility_of_devices_heads_blocks_and_batch():
    model = meta_gpt()  # 4 heads, 3 blocks
    work = Workload(seq=16, global_batch=24)
    layouts = [c.layout for c in enumerate_layouts(model, cluster(nodes=2, devices=8), work)]
    assert layouts
    for lay in layouts:
        assert 8 % lay.tp == 0 and 4 % lay.tp == 0  # inside a node, dividing the heads
        assert lay.tp * lay.pp * lay.dp == 16
        assert lay.pp * lay.virtual_stages <= 3  # at least one block per stage
        assert 24 % lay.dp == 0 and (24 // lay.dp) % lay.micro_batches == 0
        if lay.pp > 1:
            assert schedule_actions(lay.schedule, lay.pp, lay.micro_batches, lay.virtual_stages) is not None
    assert {lay.tp for lay in layouts} == {1, 2, 4}  # tp=8 would split 4 heads
    assert {lay.pp for lay in layouts} == {1, 2}  # pp=4 and 8 exceed 3 blocks (16 = tp x pp x dp)


def test_layout_that_does_not_fit_memory_is_dropped():
    model = meta_gpt(n_layer=4)
    work = Workload(seq=16, global_batch=64)
    everything = enumerate_layouts(model, cluster(memory=float("inf")), work)
    peaks = sorted(c.peak_bytes for c in everything)
    limit = peaks[len(peaks) // 2]
    result = search(model, cluster(memory=limit), work)
    assert result.ranked and result.too_big
    assert all(r.candidate.peak_bytes <= limit for r in result.ranked)
    assert all(c.peak_bytes > limit for c in result.too_big)
    assert len(result.ranked) + len(result.too_big) == len(everything)


def test_model_too_big_for_any_layout_says_what_would_fit():
    model = meta_gpt(n_layer=8)
    work = Workload(seq=16, global_batch=8)
    smallest = min(c.peak_bytes for c in enumerate_layouts(model, cluster(devices=2, memory=1.0), work))
    with pytest.raises(PlanError) as err:
        search(model, cluster(devices=2, memory=smallest * 0.9), work)
    message = str(err.value)
    assert "no layout of GPT fits 1 node(s) x 2 devices" in message
    assert f"needs {smallest / GIB:.1f} GiB per device" in message
    assert "with 2 nodes of these devices it fits" in message  # PP over 4 devices halves the blocks held


@pytest.mark.parametrize("rates,shared", [(GPU, False), (CPU, True)])
def test_more_data_parallelism_with_fixed_global_batch_is_not_slower_in_compute(rates, shared):
    model = meta_gpt(n_layer=4)
    work = Workload(seq=16, global_batch=64)
    computes = [one(model, cluster(rates=rates, shared=shared), work, tp=1, pp=8 // dp, dp=dp,
                    micro_batches=64 // dp, schedule="1f1b" if dp < 8 else None, virtual_stages=1).prediction.compute
                for dp in (2, 4, 8)]
    # per device, compute shrinks as the batch is shared by more replicas (the stages also shrink)
    assert computes[0] >= computes[1] >= computes[2] > 0


def test_zero_stages_shrink_memory_per_device_and_zero3_moves_one_and_a_half_times_dp_bytes():
    model = meta_gpt(n_layer=4, n_embd=64, vocab_size=256)
    work = Workload(seq=16, global_batch=64)
    runs = {z: one(model, cluster(devices=4, memory=float("inf")), work, tp=1, pp=1, dp=4, zero=z) for z in range(4)}
    memory = {z: r.candidate.memory[0] for z, r in runs.items()}
    model_state = {z: m.param_bytes + m.grad_bytes + m.optimizer_bytes for z, m in memory.items()}
    assert model_state[0] > model_state[1] > model_state[2] > model_state[3]
    assert memory[1].optimizer_bytes == memory[2].optimizer_bytes == memory[0].optimizer_bytes / 4
    assert memory[3].param_bytes < memory[0].param_bytes < memory[2].param_bytes  # stage 2 holds shards and all
    moved = {z: r.prediction.bytes_moved for z, r in runs.items()}  # all data-parallel here (tp = pp = 1)
    assert moved[1] == moved[2] == pytest.approx(moved[0])  # a reduce-scatter and an all-gather: an all-reduce
    assert moved[3] == pytest.approx(1.5 * moved[0])  # the parameters gathered twice
    # under pipelining ZeRO-3 gathers once per step and keeps the stage's parameters and gradients whole
    piped = {z: one(model, cluster(devices=4, memory=float("inf")), work, tp=1, pp=2, dp=2, zero=z, micro_batches=4,
                    schedule="1f1b", virtual_stages=1) for z in (1, 3)}
    assert piped[3].prediction.bytes_moved == pytest.approx(piped[1].prediction.bytes_moved)
    # ZeRO-1 keeps, beside its whole gradient buckets, the 1/dp slice they are reduce-scattered to
    assert piped[1].candidate.memory[0].grad_bytes == piped[3].candidate.memory[0].grad_bytes * (1 + 1 / 2)


def test_search_takes_zero3_only_where_nothing_less_sharded_fits():
    model = meta_gpt(n_layer=4, n_embd=64, vocab_size=256)
    work = Workload(seq=16, global_batch=64)
    fixed = Constraints(tp=1, pp=1, dp=4, recompute=(False,))
    roomy = search(model, cluster(devices=4, memory=float("inf")), work, fixed)
    assert roomy.best.candidate.layout.zero < 3  # zero 3 moves more bytes for nothing
    peaks = {r.candidate.layout.zero: r.candidate.peak_bytes for r in roomy.ranked}
    tight = search(model, cluster(devices=4, memory=peaks[3] * 1.01), work, fixed)
    assert peaks[3] < min(peaks[z] for z in (0, 1, 2))
    assert [r.candidate.layout.zero for r in tight.ranked] == [3]
    assert tight.best.candidate.layout.options()["zero_stage"] == 3


def test_hsdp_holds_model_state_over_its_shard_group_and_keeps_the_gathers_inside_a_node():
    """Two nodes of 4: ZeRO-3 over all 8 replicas, or HSDP over the 4 of a node (offered only where the DP
    group spans nodes). HSDP holds what ZeRO-3 over 4 replicas holds, and its data-parallel time is the
    gathers and reduce-scatters on the node's links plus an all-reduce of a quarter of the gradients across."""
    model = meta_gpt(n_layer=4, n_embd=64, vocab_size=256)
    work = Workload(seq=16, global_batch=64)
    fixed = Constraints(tp=1, pp=1, zero=3, recompute=(False,))
    ranked = search(model, cluster(nodes=2, devices=4, memory=float("inf")), work, fixed).ranked
    by_shard = {r.candidate.layout.zero_shard: r for r in ranked}
    assert set(by_shard) == {None, 4} and by_shard[4].candidate.layout.options()["zero_shard_size"] == 4
    assert [r.candidate.layout.zero_shard for r in search(model, cluster(devices=8, memory=float("inf")), work,
                                                          fixed).ranked] == [None]  # one node: nothing to gain
    state = lambda r: [(m.param_bytes, m.grad_bytes, m.optimizer_bytes) for m in r.candidate.memory]  # noqa: E731
    node = one(model, cluster(devices=4, memory=float("inf")), work, tp=1, pp=1, dp=4, zero=3)
    assert state(by_shard[4]) == state(node)
    assert by_shard[4].candidate.peak_bytes > by_shard[None].candidate.peak_bytes
    assert by_shard[4].prediction.data_parallel < by_shard[None].prediction.data_parallel  # GPU: slower across
    pinned = search(model, cluster(nodes=2, devices=4, memory=float("inf")), work,
                    Constraints(tp=1, pp=1, zero_shard=2, recompute=(False,))).ranked
    assert {(r.candidate.layout.zero, r.candidate.layout.zero_shard) for r in pinned} == {(2, 2), (3, 2)}


def test_slower_link_makes_tensor_parallelism_costlier():
    model = meta_gpt(n_layer=4)
    work = Workload(seq=16, global_batch=64)
    fast = cluster(rates=GPU)
    slow = cluster(rates=Rates(GPU.flops, GPU.intra_bandwidth / 10, GPU.inter_bandwidth, GPU.latency, GPU.optimizer))
    tp_fast, tp_slow = (one(model, c, work, tp=4, pp=1, dp=2).prediction for c in (fast, slow))
    assert tp_slow.tensor_parallel > tp_fast.tensor_parallel > 0
    assert tp_slow.step_time > tp_fast.step_time
    assert tp_slow.compute == tp_fast.compute  # only the link changed


def test_zero_bubble_schedule_is_simulated_with_its_split_backward():
    if "zb_h1" not in SCHEDULES:
        pytest.skip("no zb_h1 schedule in this tree")
    model = meta_gpt(n_layer=4)
    work = Workload(seq=16, global_batch=64)
    common = dict(tp=1, pp=4, dp=2, micro_batches=8, virtual_stages=1)
    zb = one(model, cluster(), work, schedule="zb_h1", **common).prediction
    base = one(model, cluster(), work, schedule="1f1b", **common).prediction
    assert zb.bubble < base.bubble and zb.step_time < base.step_time
    assert zb.compute == base.compute


def test_search_is_deterministic():
    work = Workload(seq=16, global_batch=64)
    runs = [search(meta_gpt(n_layer=4), cluster(nodes=2, devices=4, memory=GIB), work) for _ in range(2)]
    first, second = ([(r.candidate.layout, r.prediction) for r in run.ranked] for run in runs)
    assert first == second
    assert len(first) > 10


def test_lp_plan_search_prints_the_ranked_table_and_the_overrides(capsys):
    from lightning_parallel.cli.plan import main

    main(["--search", "model.n_layer=4", "model.n_embd=64", "--nodes", "2", "--devices-per-node", "4",
          "--device-memory", "16", "--tflops", "100", "--intra-bandwidth", "100", "--inter-bandwidth", "10",
          "--latency-us", "10", "--optimizer-rate", "10000", "--global-batch", "64", "--top", "3"])
    out = capsys.readouterr().out
    assert "cluster: 2 node(s) x 4 cpu devices of 16.0 GiB" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  layout"))
    for column in ("memory/device", "step time", "bubble", "moved/device"):
        assert column in lines[header]
    assert [line.split()[0] for line in lines[header + 1 : header + 4]] == ["1", "2", "3"]
    assert lines[header + 4].startswith("chosen: ")
    # the command to train with it carries the user's overrides and pins every size: no search at setup
    command = shlex.split(lines[lines.index("train with it:") + 1])
    assert command[:4] == ["lp-train", "strategy=auto", "model.n_layer=4", "model.n_embd=64"]
    from lightning_parallel.cli.launch_plan import build_plan
    from lightning_parallel.cli.overrides import compose_config

    plan = build_plan(compose_config(command[1:]), env={})
    assert plan.search is None and plan.mesh.world_size == 8


def test_lp_plan_refuses_cluster_flags_without_search(capsys):
    from lightning_parallel.cli.plan import main

    with pytest.raises(SystemExit):
        main(["--nodes", "2", "strategy=dp"])
    assert "--nodes describes the cluster to search: add --search" in capsys.readouterr().err


def test_lp_plan_of_strategy_auto_pins_the_same_layout():
    from lightning_parallel.cli.launch_plan import build_plan
    from lightning_parallel.cli.overrides import compose_config

    overrides = ["strategy=auto", "trainer.devices=4", "data.batch_size=8"]
    plan = build_plan(compose_config(overrides), env={})
    best = plan.search.best.candidate.layout
    assert (plan.mesh.tp_size, plan.mesh.pp_size, plan.mesh.dp_size) == (best.tp, best.pp, best.dp)
    pinned = build_plan(compose_config(overrides + best.overrides()), env={})
    assert pinned.search is None or pinned.search.best.candidate.layout == best
    assert (pinned.mesh.tp_size, pinned.mesh.pp_size, pinned.mesh.dp_size) == (best.tp, best.pp, best.dp)


@pytest.mark.timeout(60)
def test_calibration_measures_compute_and_links_between_local_processes():
    rates = measure(2, 32)
    for value in (rates.flops, rates.intra_bandwidth, rates.optimizer):
        assert 0 < value < math.inf
    assert 0 <= rates.latency < 1  # seconds per message; timing noise may fit it to zero


def test_strategy_auto_reads_the_batch_shape_from_the_data_the_run_uses():
    from types import SimpleNamespace

    from lightning_parallel.planner.auto import training_shape
    from lightning_parallel.planner.batch import BatchShapeUnknown, batch_shape

    class Sized(L.LightningDataModule):  # arguments that give the shape: read without building any data
        def __init__(self, batch_size: int, block_size: int):
            super().__init__()
            self.save_hyperparameters()

        def setup(self, stage=None):
            raise AssertionError("set up although its arguments give the shape")

    class Own(L.LightningDataModule):  # no hyperparameters: set up, and its first batch read
        def setup(self, stage=None):
            self.data = torch.utils.data.TensorDataset(torch.zeros(20, 6, dtype=torch.long))

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=5, shuffle=True)

    state = torch.random.get_rng_state()
    assert training_shape(SimpleNamespace(datamodule=Sized(4, 16)), strategy=None) == (4, 16)
    assert training_shape(SimpleNamespace(datamodule=Own()), strategy=None) == (5, 6)
    assert torch.equal(torch.random.get_rng_state(), state)  # the run shuffles as if nothing was read
    with pytest.raises(BatchShapeUnknown, match="LightningDataModule's training loader could not be read"):
        training_shape(SimpleNamespace(datamodule=L.LightningDataModule()), strategy=None)
    assert batch_shape({"input_ids": torch.zeros(3, 7, dtype=torch.long)}) == (3, 7)
    assert batch_shape((torch.zeros(5, 9), torch.zeros(5, 9))) == (5, 9)


# ---- strategy=auto trains ------------------------------------------------------------------
class LayoutRecorder(L.Callback):
    """Keep the layout the strategy chose and each parameter's TP layout, per rank."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        shards = {n: p.tp_shard for n, p in pl_module.named_parameters(remove_duplicate=False)
                  if getattr(p, "tp_shard", None)}
        torch.save({"layout": strategy.layout_search.best.candidate.layout, "shards": shards},
                   os.path.join(self.out_dir, f"layout{trainer.global_rank}.pt"))


def full_parameters_of_replica_0(records: list[dict], mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    """Every parameter of replica 0, its TP shards merged in TP rank order."""
    from lightning_parallel.tensor_parallel.shard import merge_shards

    full: dict[str, torch.Tensor] = {}
    for pp in range(mesh.pp_size):
        ranks = [mesh.rank_of(pp, 0, tp) for tp in range(mesh.tp_size)]
        for name in records[ranks[0]]["params"]:
            if name in full:
                continue
            shard = records[ranks[0]]["shards"].get(name)
            tensors = [records[r]["params"][name] for r in ranks]
            full[name] = merge_shards(tensors, shard) if shard is not None else tensors[0]
    return full


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pinned", [{}, {"tensor_parallel": 2}], ids=["all-auto", "tp2-pp-auto"])
def test_strategy_auto_trains_tiny_gpt_like_one_device_and_logs_its_choice(tmp_path, pinned):
    """Tolerances as in test_3d.py: whatever layout is chosen computes the same float32 arithmetic in
    another association (TP partial sums, micro-batch means, the DP mean), ~1e-6 on the loss; AdamW
    amplifies rounding of near-zero gradients to ~3e-5 on parameters. A wrong split (a replica not
    reduced, a shard not gathered) moves losses by >1e-3 and parameters by about the learning rate."""
    L.seed_everything(0)
    module = GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, lr=1e-2)
    offsets = torch.randint(0, 64, (64, 1), generator=torch.Generator().manual_seed(0))
    tokens = (offsets + torch.arange(17) * 3) % 64
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    options = {"tensor_parallel": "auto", "pipeline_parallel": "auto", "schedule": "auto", "virtual_stages": "auto",
               "zero_stage": "auto", **pinned}
    strategy = ParallelStrategy(start_method="fork", **options)
    log = logging.FileHandler(tmp_path / "log.txt")  # the forked ranks inherit it
    logging.getLogger("lightning.pytorch").addHandler(log)
    try:
        recs = fit_and_record(module, data, batch_size=4, out_dir=str(tmp_path / "auto"), devices=4,
                              strategy=strategy, max_steps=3, callbacks=[LayoutRecorder(str(tmp_path))])
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(log)
        log.close()
    chosen = [torch.load(tmp_path / f"layout{r}.pt", weights_only=False) for r in range(4)]
    layout = chosen[0]["layout"]
    assert all(c["layout"] == layout for c in chosen)  # every rank chose alike
    assert all(getattr(layout, {"tensor_parallel": "tp"}[k]) == v for k, v in pinned.items())
    logged = (tmp_path / "log.txt").read_text()
    assert logged.count(f"strategy=auto chose {layout.describe()}") == 1  # once, by rank 0
    assert "moved/device" in logged
    for rec, c in zip(recs, chosen):
        rec["shards"] = c["shards"]

    mesh = ParallelMesh(4, tensor_parallel=layout.tp, pipeline_parallel=layout.pp, data_parallel=layout.dp)
    ref = fit_and_record(module, data, batch_size=4 * layout.dp, out_dir=str(tmp_path / "ref"),
                         emulate_replicas=layout.dp, max_steps=3)[0]
    replicas = [recs[mesh.rank_of(0, dp, 0)] for dp in range(layout.dp)]
    assert_close_series(mean_over_ranks(replicas), ref["losses"], atol=1e-5)
    assert ref["losses"][-1] < ref["losses"][0]
    full = full_parameters_of_replica_0(recs, mesh)
    assert set(full) == set(ref["params"])
    for name, expected in ref["params"].items():
        torch.testing.assert_close(full[name], expected, atol=5e-5, rtol=0, msg=lambda m: f"{name}: {m}")
