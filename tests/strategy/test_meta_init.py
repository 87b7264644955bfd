"""Meta-device initialisation: each rank materialises only its stage and shards, with the values of
a single-device run, and its peak memory falls with tensor x pipeline parallelism.

Values are compared for exact equality: every module is initialised from the same seeded
generator whatever the layout, and a shard is a slice of that full tensor.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from lightning_parallel.options import ParallelOptions
from lightning_parallel.pipeline import PipelineEngine
from lightning_parallel.strategy.materialize import (
    UnsplitModel,
    empty_parameters,
    has_meta_parameters,
    materialize,
)
from lightning_parallel.tensor_parallel import parallelize
from lightning_parallel.tensor_parallel.shard import slice_shard
from tests.helpers.parity import _Recorder, assert_close_series, mean_over_ranks
from tests.helpers.processes import make_mesh, run_distributed

SEED = 1234
CPU = torch.device("cpu")
M_MMAP_THRESHOLD = -3  # mallopt parameter, <malloc.h>


def tiny_gpt() -> GPT:
    return GPT(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)


def big_gpt() -> GPT:
    # 6.4 M parameters (25.6 MB in float32): large against the transient full tensor of one module
    return GPT(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=256)


def split_on_meta(mesh, make_model):
    """What the strategy does with empty_init: build on meta, record, split, materialise."""
    torch.manual_seed(SEED)  # as a script seeds before building: values are those of eager construction
    with empty_parameters():
        model = make_model()
    assert has_meta_parameters(model)
    unsplit = UnsplitModel.of(model)
    if mesh.tp_size > 1:
        parallelize(model, mesh)
    if mesh.pp_size > 1:
        PipelineEngine(model, mesh, ParallelOptions(micro_batches=mesh.pp_size)).partition()
    materialize(model, unsplit, mesh.tp_rank, mesh.tp_size, CPU, SEED)
    return model


def single_device(make_model) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    with empty_parameters():
        model = make_model()
    materialize(model, UnsplitModel.of(model), 0, 1, CPU, SEED)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def tiny_llama():
    from lightning_parallel.models.hf_causal_lm import HFCausalLM

    return HFCausalLM(dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, vocab_size=64, max_position_embeddings=16))


MODELS = {"gpt": tiny_gpt, "llama": tiny_llama}


def _rank_values(rank, world_size, model_name, tp, pp):
    mesh = make_mesh(rank, world_size, tp=tp, pp=pp)
    model = split_on_meta(mesh, MODELS[model_name])
    tied = model.lm_head.weight is model.transformer.wte.weight if model_name == "gpt" and pp == 1 else None
    return mesh.tp_rank, {n: (p.detach().clone(), getattr(p, "tp_shard", None))
                          for n, p in model.named_parameters(remove_duplicate=False)}, tied


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model_name, tp, pp", [("gpt", 2, 1), ("gpt", 1, 2), ("gpt", 2, 2), ("llama", 2, 2)])
def test_each_rank_materialises_its_shards_with_single_device_values(model_name, tp, pp):
    reference = single_device(MODELS[model_name])
    held = set()
    ranks = run_distributed(_rank_values, tp * pp, model_name, tp, pp)
    for tp_rank, params, tied in ranks:
        assert tied in (True, None)  # the embedding and head stay one parameter
        for name, (value, shard) in params.items():
            expected = reference[name] if shard is None else slice_shard(reference[name], shard, tp_rank, tp)
            assert torch.equal(value, expected), name
            held.add(name)
    assert held == set(reference)  # together the ranks hold the whole model
    if pp > 1:  # and a stage holds only its part
        assert all(len(params) < len(reference) for _, params, _ in ranks)


def test_initial_values_follow_the_models_own_init():
    values = single_device(tiny_gpt)
    assert torch.equal(values["transformer.h.0.ln_1.weight"], torch.ones(32))  # LayerNorm.reset_parameters
    assert torch.equal(values["transformer.h.0.attn.c_attn.bias"], torch.zeros(96))  # GPT._init_weights
    assert abs(values["transformer.h.0.mlp.c_fc.weight"].std().item() - 0.02) < 2e-3
    assert torch.equal(values["lm_head.weight"], values["transformer.wte.weight"])
    llama = single_device(tiny_llama)  # Hugging Face: PreTrainedModel._init_weights
    assert torch.equal(llama["model.model.norm.weight"], torch.ones(32))
    assert abs(llama["model.model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 2e-3


def test_values_given_by_the_constructor_are_kept_and_a_parameter_nothing_sets_is_an_error_naming_it():
    class Scaled(nn.Module):
        def __init__(self, unset: bool = False, copied: bool = False):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4) * 3)  # a value, not an init call: kept on meta
            self.offset = nn.Parameter(torch.empty(4)) if unset else None  # nothing ever sets it
            if copied:
                with torch.no_grad():
                    self.proj.bias.copy_(torch.empty(4, device="meta"))  # from a meta tensor: nothing to replay

    with empty_parameters():
        model = Scaled()
    materialize(model, UnsplitModel.of(model), 0, 1, CPU, SEED)
    assert torch.equal(model.scale, torch.full((4,), 3.0))
    with empty_parameters():
        model = Scaled(unset=True)
    with pytest.raises(ValueError, match=r"^offset cannot be materialised .*nothing sets its value"):
        materialize(model, UnsplitModel.of(model), 0, 1, CPU, SEED)
    with empty_parameters():
        model = Scaled(copied=True)
    with pytest.raises(ValueError, match=r"^proj.bias cannot be materialised .*copy_.* another meta tensor"):
        materialize(model, UnsplitModel.of(model), 0, 1, CPU, SEED)


def _peak_memory(rank, world_size, tp, pp):
    """Parameter bytes this rank holds, and its peak resident memory growth while building them.

    glibc raises its mmap threshold after large frees and then keeps freed temporaries (each
    module's full tensor) resident, so RSS would count memory the process no longer uses; a fixed
    threshold returns them, as a GPU's caching allocator reuses them, and RSS tracks live tensors.
    """
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    mesh = make_mesh(rank, world_size, tp=tp, pp=pp)
    split_on_meta(mesh, tiny_gpt)  # warm-up: first-call imports and allocator pools are not the model
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one
    start = _status_kib("VmRSS")
    model = split_on_meta(mesh, big_gpt)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return param_bytes, (_status_kib("VmHWM") - start) * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure_peaks() -> dict[str, list]:
    """Parameter bytes and peak resident growth per rank at T x P = 1 x 1, 2 x 1 and 2 x 2."""
    return {f"{tp}x{pp}": run_distributed(_peak_memory, tp * pp, tp, pp) for tp, pp in [(1, 1), (2, 1), (2, 2)]}


@pytest.mark.timeout(90)
def test_per_rank_peak_memory_falls_with_tp_times_pp():
    # Measured from a fresh interpreter: a worker forked from this long-lived test process inherits its
    # heap of freed but resident memory, where new tensors land without growing the resident set.
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    code = "import json; from tests.strategy.test_meta_init import measure_peaks; print(json.dumps(measure_peaks()))"
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=80)
    assert run.returncode == 0, run.stderr[-3000:]
    measured = {tuple(map(int, k.split("x"))): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    print("\n  T x P | max parameter MB per rank | max peak RSS growth MB per rank")
    for (tp, pp), ranks in measured.items():
        print(f"  {tp} x {pp} | {max(b for b, _ in ranks) / 2**20:26.1f} | {max(r for _, r in ranks) / 2**20:.1f}")
    whole = measured[(1, 1)][0][0]
    for (tp, pp), ranks in measured.items():
        # each rank holds about 1/(T x P) of the model: the embeddings of a stage are the imbalance
        assert max(b for b, _ in ranks) <= 1.15 * whole / (tp * pp)
    peak = {layout: max(r for _, r in ranks) for layout, ranks in measured.items()}
    assert peak[(2, 1)] < 0.75 * peak[(1, 1)]
    assert peak[(2, 2)] < 0.75 * peak[(2, 1)]


class _InitialValues(Callback):
    def __init__(self, out: Path):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        mesh = trainer.strategy.mesh
        values = {n: (p.detach().clone(), getattr(p, "tp_shard", None))
                  for n, p in pl_module.named_parameters(remove_duplicate=False)}
        torch.save((mesh.tp_rank, mesh.tp_size, values), self.out / f"init{trainer.global_rank}.pt")


def _fit_on_meta(out: Path, devices: int, tp: int = 1, pp: int = 1) -> tuple[list[dict], list[tuple]]:
    from tests.checkpoint.test_checkpoint import STEPS, StepData

    out.mkdir(parents=True)
    L.seed_everything(7)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        strategy=ParallelStrategy(tensor_parallel=tp, pipeline_parallel=pp, start_method="fork", timeout=60),
        callbacks=[_Recorder(str(out)), _InitialValues(out)],
    )
    with trainer.init_module(empty_init=True):
        model = tiny_gpt()
    assert has_meta_parameters(model)
    trainer.fit(model, datamodule=StepData())
    records = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]
    return records, [torch.load(out / f"init{r}.pt", weights_only=False) for r in range(devices)]


@pytest.mark.timeout(60)
def test_trainer_init_module_empty_init_starts_and_trains_like_one_device(tmp_path):
    """trainer.init_module(empty_init=True) under TP2 x PP2: single-device initial values and losses.

    Losses: the parity tolerance of test_checkpoint (LOSS_TOL, measured 4.8e-7 here).
    """
    from tests.checkpoint.test_checkpoint import LOSS_TOL

    one, (one_init,) = _fit_on_meta(tmp_path / "one", devices=1)
    split, split_init = _fit_on_meta(tmp_path / "tp2pp2", devices=4, tp=2, pp=2)
    reference = {n: v for n, (v, _) in one_init[2].items()}
    for tp_rank, tp_size, values in split_init:
        for name, (value, shard) in values.items():
            expected = reference[name] if shard is None else slice_shard(reference[name], shard, tp_rank, tp_size)
            assert torch.equal(value, expected), name
    assert_close_series(mean_over_ranks(split), one[0]["losses"], **LOSS_TOL)
