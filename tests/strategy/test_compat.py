"""Every private Lightning and torch name the plugin relies on (``lightning_parallel/compat.py``)
still exists and still behaves as the plugin assumes. A release that moves one fails here, by name."""

from __future__ import annotations

import importlib
import inspect

import lightning as L
import pytest
import torch
from torch import nn

from lightning_parallel import compat, lightning_hooks

REEXPORTED = [
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_sync_ddp_if_available",
    "_optimizers_to_device",
    "_sync_module_states",
    "_sync_module_states_over",
    "_sync_params_and_buffers",
    "_SubprocessScriptLauncher",
    "_MultiProcessingLauncher",
    "_WorkerOutput",
    "tree_map",
]


@pytest.mark.parametrize("name", REEXPORTED)
def test_reexported_private_name_is_callable(name):
    assert callable(getattr(compat, name))


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path, attribute", [(p, a) for p, names in compat.OVERRIDDEN.items() for a in names])
def test_overridden_lightning_attribute_exists(path, attribute):
    cls = _class(path)
    if hasattr(cls, attribute):
        return
    # instance attributes are set in __init__: look for the assignment there
    init_source = inspect.getsource(cls.__init__)
    assert f"self.{attribute} =" in init_source or f"self.{attribute}:" in init_source, f"{path}.{attribute}"


def test_worker_output_carries_the_weights_path():
    assert "weights_path" in compat._WorkerOutput._fields


def test_skip_backward_switch_is_read_by_the_fit_loop():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    compat.set_skip_backward(trainer, True)
    assert trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward is True
    compat.set_skip_backward(trainer, False)
    assert trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward is False


def test_attached_trainer_is_none_until_a_trainer_holds_the_module():
    module = L.LightningModule()
    assert compat.attached_trainer(module) is None
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    module.trainer = trainer
    assert compat.attached_trainer(module) is trainer


def test_module_is_hidden_from_teardown_and_restored():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    module = L.LightningModule()
    trainer.strategy.connect(module)
    with compat.module_hidden_from_teardown(trainer.strategy):
        assert trainer.strategy.lightning_module is None
    assert trainer.strategy.lightning_module is module


def test_fit_passes_ckpt_path_fifth_to_its_launcher(monkeypatch):
    seen = {}

    def fake_run(trainer, trainer_fn, *args, **kwargs):
        seen["ckpt_path"] = compat.fit_ckpt_path(args)

    monkeypatch.setattr("lightning.pytorch.trainer.call._call_and_handle_interrupt", fake_run)
    L.Trainer(accelerator="cpu", devices=1, logger=False).fit(L.LightningModule(), ckpt_path="last.ckpt")
    assert seen["ckpt_path"] == "last.ckpt"


def test_autograd_engine_and_backward_detection():
    x = torch.ones(2, requires_grad=True)
    inside = []
    y = x * 2
    y.register_hook(lambda g: inside.append(compat.in_backward()))
    (grad,) = compat.autograd_engine().run_backward((y.sum(),), (torch.ones(()),), False, False, (x,), True, False)
    assert inside == [True] and not compat.in_backward()
    assert torch.equal(grad, torch.full((2,), 2.0))


def test_cpu_flash_attention_returns_the_log_sum_exp_and_matches_sdpa():
    forward, backward = compat.cpu_flash_attention()
    q, k, v = (torch.randn(1, 4, 6, 8, requires_grad=True) for _ in range(3))
    out, lse = forward(q, k, v, 0.0, True, scale=None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)
    scores = (q @ k.transpose(-2, -1) / 8 ** 0.5).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), -float("inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    grads = backward(torch.ones_like(out), q, k, v, out, lse, 0.0, True, scale=None)
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(got, want)


def test_packed_in_projection_of_multihead_attention():
    assert compat.packed_in_projection(nn.MultiheadAttention(8, 2))
    assert not compat.packed_in_projection(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))


def test_loop_data_source_holds_the_loader_before_the_loop_builds_it():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    loader = torch.utils.data.DataLoader(torch.zeros(4, 2))
    trainer.fit_loop._data_source.instance = loader
    source = compat.loop_data_source(trainer, "fit_loop")
    assert source.instance is loader and callable(source.is_defined) and callable(source.dataloader)


def test_unwrap_optimizer_reaches_the_torch_optimizer_inside_lightnings_wrapper():
    from lightning.pytorch.core.optimizer import LightningOptimizer

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    assert compat.unwrap_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert compat.unwrap_optimizer(optimizer) is optimizer


def test_a_modules_own_parameters_are_in_its_parameters_dict():
    # init.py reads and replaces ``_parameters`` to materialise a module's own parameters
    linear = nn.Linear(2, 3)
    assert set(linear._parameters) == {"weight", "bias"} and linear._parameters["weight"] is linear.weight


def test_fake_backend_plays_one_rank_of_a_large_world_and_new_group_calls_are_counted():
    import torch.distributed as dist

    dist.init_process_group("fake", store=compat.fake_store(), rank=5, world_size=1024)
    try:
        held = compat.groups_held()
        with compat.counting_new_group_calls() as calls:
            mine = dist.new_group([4, 5], use_local_synchronization=True)
            dist.new_group([0, 1])  # a group this rank is not in: a call, but nothing held
        assert calls == [2] and compat.groups_held() == held + 1
        assert dist.get_world_size(mine) == 2 and dist.get_rank(mine) == 1
        dist.all_reduce(torch.ones(1), group=mine)  # returns without communicating
    finally:
        dist.destroy_process_group()


def test_lightning_checkpoint_readers_exist_with_their_signature_and_are_extended_once():
    readers = [getattr(importlib.import_module(module), name) for module, name in lightning_hooks.CHECKPOINT_READERS]
    assert all(reader._lp_reads_directories for reader in readers)  # lightning_parallel is imported
    original = readers[0].__wrapped__
    assert all(reader.__wrapped__ is original for reader in readers)  # one function, bound under three names
    assert list(inspect.signature(original).parameters) == ["path_or_url", "map_location", "weights_only"]
    lightning_hooks.read_checkpoint_directories(lambda *args: None)
    assert [getattr(importlib.import_module(m), n) for m, n in lightning_hooks.CHECKPOINT_READERS] == readers


def test_transformers_save_steps_exist_and_drop_a_tied_head():
    from transformers import LlamaConfig, LlamaForCausalLM

    remove_tied_weights, revert_weight_conversion = compat.hf_save_steps()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, vocab_size=16, tie_word_embeddings=True))
    kept = remove_tied_weights(model.state_dict(), model)
    assert "lm_head.weight" not in kept and "model.embed_tokens.weight" in kept
    assert list(revert_weight_conversion(model, kept)) == list(kept)  # nothing to revert for Llama


def _fsdp_internals(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from tests.helpers.processes import make_mesh

    mesh = make_mesh(rank, world_size).device_mesh["dp"]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = compat.fsdp_param_groups(model)  # the root's own group and its unit's
    seen = []
    for group in groups:
        compat.before_fsdp_post_backward(group, lambda g: seen.append(
            [compat.fsdp_has_unsharded_grad(p) for p in compat.fsdp_group_parameters(g)]))
    model.set_requires_gradient_sync(False)
    model.unshard()
    model(torch.ones(3, 4)).sum().backward()
    kept = [compat.fsdp_reduces(g) for g in groups], [p.grad for p in model.parameters()]
    model.set_requires_gradient_sync(True)
    compat.fsdp_reduce_now(model, groups)
    return len(groups), seen, kept[0], kept[1], [p.grad is not None for p in model.parameters()]


def test_fsdp2_internals_name_groups_and_gradients_and_reduce_on_demand():
    from tests.helpers.processes import run_distributed

    count, seen, reducing, before, after = run_distributed(_fsdp_internals, 2)[0]
    assert count == 2
    assert seen[:2] == [[True, True], [True, True]]  # the hook sees whole gradients before each group's end
    assert reducing == [False, False] and before == [None] * 4  # accumulated, not yet reduced
    assert after == [True] * 4  # reduce-scattered on demand


def _reshard_after_an_aborted_forward(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from tests.helpers.processes import make_mesh

    mesh = make_mesh(rank, world_size).device_mesh["dp"]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model[1].register_forward_pre_hook(lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))  # a stage's exit
    try:
        model(torch.ones(3, 4))
    except KeyboardInterrupt:
        pass
    gathered = not isinstance(model[0].weight, DTensor)
    for group in compat.fsdp_param_groups(model):
        compat.fsdp_reshard(group)
    return gathered, isinstance(model[0].weight, DTensor)


def test_fsdp2_group_left_mid_forward_is_resharded():
    from tests.helpers.processes import run_distributed

    assert run_distributed(_reshard_after_an_aborted_forward, 2)[0] == (True, True)


def test_training_steps_are_set_where_lightning_reads_them():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    compat.set_training_steps(trainer, 7, 6)
    assert compat.training_steps(trainer) == (7, 6)
    assert trainer.global_step == 7
    assert trainer.fit_loop.epoch_loop.state_dict()["state_dict"]["_batches_that_stepped"] == 6
