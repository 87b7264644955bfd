"""Data parallelism: bucketing, overlapped all-reduce, and parity with one device.

Tolerances: the documented float32 parity bound (``tests/helpers/parity.py``: losses 1e-5, parameters
1e-4). The two runs differ only in the order of floating-point sums (a global batch mean against the
mean of two half-batch means, then an all-reduce). A missing or doubled gradient would be off by
O(lr) = 1e-2.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel import DataParallelStrategy
from lightning_parallel.data_parallel import GradientSynchronizer
from lightning_parallel.data_parallel.buckets import assign_buckets
from tests.helpers.parity import (
    LOSS_BOUND,
    PARAM_BOUND,
    TensorDataset,
    assert_close_series,
    assert_params_close,
    fit_and_record,
    mean_over_ranks,
)
from tests.helpers.processes import make_mesh, run_distributed

LOSS_ATOL = LOSS_BOUND
PARAM_ATOL = PARAM_BOUND


class GatedNet(L.LightningModule):
    """An MLP with an extra branch used only for flagged samples, and a parameter never used.

    With the interleaved DistributedSampler only rank 0 sees flagged samples, so ``extra`` gets a
    gradient on one rank only, and ``unused`` on none: it must keep ``grad=None`` (AdamW's weight
    decay would otherwise move it).
    """

    def __init__(self, optimizer: str = "adamw"):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.extra = nn.Linear(8, 4)
        self.unused = nn.Linear(4, 4)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y, flag = batch
        out = self.net(x)
        sel = flag.bool()
        if sel.any():
            out = out.clone()
            out[sel] = out[sel] + self.extra(x[sel])
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def gated_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 4, generator=g)
    flag = (torch.arange(n) % 4 == 0).long()
    return TensorDataset(x, y, flag)


def fork_dp(**kwargs):
    return DataParallelStrategy(start_method="fork", **kwargs)


# ---- pure ------------------------------------------------------------------------------------
def test_buckets_are_filled_in_reverse_parameter_order():
    params = [nn.Parameter(torch.zeros(n)) for n in (4, 6, 3, 10, 2)]
    slots, sizes = assign_buckets(params, bucket_size=10)
    # reverse order: 2, 10 | 3, 6 ... -> [2] + [10] would exceed, so [2], [10], [3, 6], [4]
    assert sizes == [2, 10, 9, 4]
    assert [s.bucket for s in slots] == [3, 2, 2, 1, 0]
    assert slots[2].offset == 0 and slots[1].offset == 3
    assert sum(sizes) == sum(p.numel() for p in params)


def test_buckets_never_mix_dtypes():
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    _, sizes = assign_buckets(params, bucket_size=100)
    assert sizes == [3, 3]


# ---- the synchroniser on raw processes ---------------------------------------------------------
def _sync_worker(rank, world):
    mesh = make_mesh(rank, world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2))
    plain = copy.deepcopy(model)
    sync = GradientSynchronizer(list(model.parameters()), mesh.dp_group, bucket_size_mb=30 * 4 / 2**20)
    torch.manual_seed(rank + 1)
    x = torch.randn(4, 5)
    plain(x).pow(2).sum().backward()
    local = {n: p.grad.clone() for n, p in plain.named_parameters()}
    model(x).pow(2).sum().backward()
    launched_during_backward = sync._next
    sync.finish()
    return launched_during_backward, len(sync.buckets), local, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_buckets_launch_during_backward_and_average():
    results = run_distributed(_sync_worker, 2)
    for launched, n_buckets, _, _ in results:
        assert n_buckets > 2
        assert launched == n_buckets  # every bucket was in flight before backward returned
    expected = {n: (results[0][2][n] + results[1][2][n]) / 2 for n in results[0][2]}
    for _, _, _, synced in results:
        for n, g in synced.items():
            torch.testing.assert_close(g, expected[n], atol=1e-7, rtol=0)


def _unused_worker(rank, world):
    mesh = make_mesh(rank, world)
    torch.manual_seed(0)
    a, b, c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3)
    params = list(a.parameters()) + list(b.parameters()) + list(c.parameters())
    sync = GradientSynchronizer(params, mesh.dp_group, bucket_size_mb=12 * 4 / 2**20)
    out = a(torch.ones(1, 3) * (rank + 1))
    if rank == 0:  # b is used on rank 0 only; c on no rank
        out = b(out)
    out.sum().backward()
    sync.finish()
    return [None if p.grad is None else p.grad.clone() for p in params]


@pytest.mark.timeout(60)
def test_partly_used_parameter_neither_hangs_nor_corrupts():
    g0, g1 = run_distributed(_unused_worker, 2)
    for x, y in zip(g0, g1):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y)
    assert all(g is not None for g in g0[:4])  # a and b have gradients on every rank
    assert g0[4] is None and g0[5] is None  # c: no rank used it
    # b was used on rank 0 only: its averaged gradient is half of rank 0's
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b(a(torch.ones(1, 3))).sum().backward()
    torch.testing.assert_close(g0[2], b.weight.grad / 2)


_HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _host_reads_worker(rank, world, shard):
    from lightning_parallel.data_parallel.zero import ZeroOneSharding

    mesh = make_mesh(rank, world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2), nn.Linear(2, 2))
    sync = GradientSynchronizer(list(model.parameters()), mesh.dp_group, bucket_size_mb=12 * 4 / 2**20, shard=shard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    zero = ZeroOneSharding(sync, [optimizer]) if shard else None
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counted(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    per_step, launched = [], []
    for step in range(2):
        optimizer.zero_grad()
        x = torch.randn(4, 5)
        try:  # count from the first backward to the gradients the optimizer sees
            for name in _HOST_READS:
                setattr(torch.Tensor, name, counted(name))
            with sync.no_sync():
                model[:3](x).sum().backward()  # the last layer is unused in this micro-batch
            model(x).sum().backward()
            launched.append(sync._next)
            sync.finish()
            if zero is not None:
                zero.attach_grads()
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
        per_step.append(list(reads))
        reads.clear()
        optimizer.step()
    return len(sync.buckets), per_step, launched


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shard", [False, True], ids=["dp", "zero1"])
def test_gradient_sync_reads_the_device_once_per_step_and_overlaps_accumulated_backward(shard):
    for n_buckets, per_step, launched in run_distributed(_host_reads_worker, 2, shard):
        assert n_buckets >= 4  # one read per bucket would be caught
        assert per_step == [["tolist"], ["tolist"]]
        # every parameter got a gradient in the syncing backward: all buckets left during it
        assert launched == [n_buckets, n_buckets]


# ---- Lightning parity ------------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_dp2_matches_single_device(tmp_path, optimizer):
    L.seed_everything(0)
    module = GatedNet(optimizer)
    data = gated_data()
    ref = fit_and_record(module, data, batch_size=16, out_dir=str(tmp_path / "ref"), max_steps=4, emulate_replicas=2)[0]
    recs = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "dp"), devices=2, strategy=fork_dp(), max_steps=4)
    assert_close_series(mean_over_ranks(recs), ref["losses"], atol=LOSS_ATOL)
    for rec in recs:
        assert_params_close(rec["params"], ref["params"], atol=PARAM_ATOL)
    torch.testing.assert_close(recs[0]["params"]["unused.weight"], module.unused.weight.detach())


@pytest.mark.timeout(90)
def test_dp2_gradient_accumulation_matches_and_syncs_once_per_window(tmp_path, monkeypatch):
    calls = []
    original = GradientSynchronizer.finish

    def counting_finish(self):
        calls.append(1)
        return original(self)

    class CountSyncs(L.Callback):
        def on_train_end(self, trainer, pl_module):
            torch.save(len(calls), str(tmp_path / f"syncs{trainer.global_rank}.pt"))

    monkeypatch.setattr(GradientSynchronizer, "finish", counting_finish)
    L.seed_everything(0)
    module = GatedNet()
    data = gated_data()
    ref = fit_and_record(module, data, batch_size=16, out_dir=str(tmp_path / "ref"), max_steps=3,
                         accumulate_grad_batches=2, emulate_replicas=2)[0]
    recs = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "dp"), devices=2, strategy=fork_dp(),
                          max_steps=3, accumulate_grad_batches=2, callbacks=[CountSyncs()])
    assert_close_series(mean_over_ranks(recs), ref["losses"], atol=LOSS_ATOL)
    for rec in recs:
        assert rec["global_step"] == 3
        assert_params_close(rec["params"], ref["params"], atol=PARAM_ATOL)
    assert torch.load(str(tmp_path / "syncs0.pt")) == 3  # 6 backwards, 3 windows, 3 syncs


@pytest.mark.timeout(90)
def test_dp2_gradient_clipping_matches(tmp_path):
    L.seed_everything(0)
    module = GatedNet("sgd")
    data = gated_data()
    kwargs = dict(max_steps=4, gradient_clip_val=0.05)
    ref = fit_and_record(module, data, batch_size=16, out_dir=str(tmp_path / "ref"), emulate_replicas=2, **kwargs)[0]
    unclipped = fit_and_record(module, data, batch_size=16, out_dir=str(tmp_path / "raw"), max_steps=4, emulate_replicas=2)[0]
    recs = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "dp"), devices=2, strategy=fork_dp(), **kwargs)
    # the clip is active (else this test could not tell clipping apart from no clipping)
    assert abs(unclipped["params"]["net.0.weight"] - ref["params"]["net.0.weight"]).max() > 1e-3
    assert_close_series(mean_over_ranks(recs), ref["losses"], atol=LOSS_ATOL)
    assert_params_close(recs[1]["params"], ref["params"], atol=PARAM_ATOL)


class HFCausalLM(L.LightningModule):
    """A plain LightningModule around a Hugging Face Llama built from a tiny config."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.timeout(120)
def test_dp2_matches_single_device_on_hf_llama(tmp_path):
    L.seed_everything(0)
    module = HFCausalLM()
    # counting sequences from random offsets: learnable, so the loss must fall
    offsets = torch.randint(0, 64, (32, 1), generator=torch.Generator().manual_seed(0))
    data = TensorDataset((offsets + torch.arange(16)) % 64)
    ref = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "ref"), max_steps=3, emulate_replicas=2)[0]
    recs = fit_and_record(module, data, batch_size=4, out_dir=str(tmp_path / "dp"), devices=2, strategy=fork_dp(), max_steps=3)
    assert ref["losses"][-1] < ref["losses"][0]
    assert_close_series(mean_over_ranks(recs), ref["losses"], atol=1e-5)
    assert_params_close(recs[0]["params"], ref["params"], atol=PARAM_ATOL)


@pytest.mark.timeout(120)
def test_dp2_matches_single_device_on_default_gpt(tmp_path):
    from lightning_parallel.models.gpt import GPT

    L.seed_everything(0)
    module = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    tokens = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    ref = fit_and_record(module, data, batch_size=8, out_dir=str(tmp_path / "ref"), max_steps=3, emulate_replicas=2)[0]
    recs = fit_and_record(module, data, batch_size=4, out_dir=str(tmp_path / "dp"), devices=2,
                          strategy=fork_dp(bucket_size_mb=0.01), max_steps=3)
    assert_close_series(mean_over_ranks(recs), ref["losses"], atol=1e-5)
    assert_params_close(recs[0]["params"], ref["params"], atol=PARAM_ATOL)


def test_string_registration_selects_our_strategy():
    import lightning_parallel  # noqa: F401  (registers the names)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="lp_dp", logger=False)
    assert isinstance(trainer.strategy, DataParallelStrategy)
    assert trainer.strategy.is_distributed


# ---- Trainer(sync_batchnorm=True) ------------------------------------------------------------
class _ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList([_ResidualBlock(8) for _ in range(4)])
        self.head = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x.mean((2, 3))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _NormGroups(L.Callback):
    """After setup: each normalisation layer's type and the ranks it averages statistics over."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        import torch.distributed as dist

        norms = [(type(m).__name__, dist.get_process_group_ranks(m.process_group) if m.process_group else None)
                 for m in pl_module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        torch.save(norms, f"{self.out_dir}/norms{trainer.global_rank}.pt")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("devices, pp", [(2, 1), (4, 2)], ids=["dp2", "pp2xdp2"])
def test_sync_batchnorm_converts_over_the_data_parallel_group_only(tmp_path, devices, pp):
    from lightning_parallel import ParallelStrategy
    from lightning_parallel.mesh import ParallelMesh

    data = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 2, (16,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=ParallelStrategy(pipeline_parallel=pp, start_method="fork"),
        sync_batchnorm=True, limit_train_batches=0, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[_NormGroups(str(tmp_path))],
    )
    trainer.fit(SmallResNet(), torch.utils.data.DataLoader(data, batch_size=4))
    dp_groups = ParallelMesh(devices, pipeline_parallel=pp).dp_groups()
    for rank in range(devices):
        norms = torch.load(tmp_path / f"norms{rank}.pt")
        assert norms, f"rank {rank} holds no normalisation layer"
        group = next(g for g in dp_groups if rank in g)
        assert len(group) == 2
        assert norms == [("SyncBatchNorm", group)] * len(norms), (rank, norms)
