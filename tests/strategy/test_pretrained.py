"""Pretrained weights are never lost: a module that loads a Hugging Face model, however it loads it,
trains from exactly those weights on every layout and under every initialisation mode.

Each test saves a tiny Llama with ``save_pretrained`` into a temporary folder and fine-tunes a plain
LightningModule around it. The reference is one device with the module built plainly. With lr 0 a
layout's losses show the weights it computes with; with lr > 0 the losses of 3 AdamW steps show it
trains like one device (float32: losses agree to 1e-5; a freshly initialised model is off by more
than 1 at step 0).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

import lightning as L
import pytest
import torch

from lightning_parallel import ParallelStrategy
from lightning_parallel.checkpoint import pretrained
from tests.helpers.parity import TensorDataset, fit_and_record
from tests.helpers.pretrained import save_tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, SEQ, BATCH, STEPS = 128, 16, 8, 3
LOSS_TOL = dict(rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A tiny Llama (untied head) saved as a Hugging Face folder: config.json and model.safetensors."""
    return save_tiny_llama(tmp_path_factory.mktemp("pretrained") / "llama", vocab=VOCAB)


class FineTune(L.LightningModule):
    """A plain fine-tuning module: the pretrained model loaded where ``where`` says."""

    def __init__(self, folder: str, where: str = "init", lr: float = 1e-3, lora: bool = False,
                 tokens: Optional[int] = None):
        super().__init__()
        self.folder, self.where, self.lr, self.lora, self.tokens = folder, where, lr, lora, tokens
        if where == "init":
            self.model = self._load()
        elif where == "state_dict":  # built from the config, then the file's tensors loaded into it
            from safetensors.torch import load_file

            config = transformers.AutoConfig.from_pretrained(folder)
            self.model = transformers.AutoModelForCausalLM.from_config(config)
            self.model.load_state_dict(load_file(f"{folder}/model.safetensors"))

    def _load(self):
        model = transformers.AutoModelForCausalLM.from_pretrained(self.folder)
        if self.tokens is not None:  # new special tokens: rows drawn from the old rows' mean and covariance
            model.resize_token_embeddings(self.tokens)
        if self.lora:
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
            model = peft.get_peft_model(model, config)
        return model

    def configure_model(self):
        if self.where == "configure_model" and not hasattr(self, "model"):
            self.model = self._load()

    def setup(self, stage: str):
        if self.where == "setup" and not hasattr(self, "model"):
            self.model = self._load()

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def data() -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(5)))


def _fit(tmp_path, module_args: dict, devices: int = 1, empty_init: bool = False, replicas: int = 1,
         **sizes) -> list[dict]:
    """Losses of every rank; the module built plainly or under ``trainer.init_module(empty_init=True)``.
    One device (``devices=1``) reads the global batches ``replicas`` data-parallel ranks would read."""
    warnings.filterwarnings("ignore")
    strategy = ParallelStrategy(start_method="fork", timeout=60, **sizes) if devices > 1 or sizes else "auto"
    out = tmp_path / f"{devices}-{replicas}-{sorted(sizes.items())}-{empty_init}-{sorted(module_args.items())}"

    def build(trainer: L.Trainer) -> FineTune:
        torch.manual_seed(0)  # what a script does before building its module (LoRA's A is drawn)
        with trainer.init_module(empty_init=True) if empty_init else contextlib.nullcontext():
            module = FineTune(**module_args)
        built_later = module_args.get("where") in ("configure_model", "setup")
        assert built_later or any(p.is_meta for p in module.parameters()) == empty_init
        return module

    if devices == 1:
        return fit_and_record(build, data(), BATCH, str(out), strategy=strategy, max_steps=STEPS,
                              emulate_replicas=replicas)
    return fit_and_record(build, data(), BATCH // replicas, str(out), devices=devices, strategy=strategy,
                          max_steps=STEPS)


@pytest.fixture(scope="module")
def one_device(folder, tmp_path_factory) -> dict:
    """Per (lr, data-parallel replicas read), the losses of one device with the module built plainly."""
    root = tmp_path_factory.mktemp("one")
    return {(lr, replicas): _fit(root, dict(folder=folder, lr=lr), replicas=replicas)[0]["losses"]
            for lr in (0.0, 1e-3) for replicas in (1, 2)}


LAYOUTS = {"tp2": dict(tensor_parallel=2), "pp2": dict(pipeline_parallel=2, micro_batches=2),
           "dp2": dict(), "tp2pp2": dict(tensor_parallel=2, pipeline_parallel=2, micro_batches=2)}
DEVICES = {"tp2": 2, "pp2": 2, "dp2": 2, "tp2pp2": 4}


def _assert_losses(records: list[dict], expected: list[float]) -> None:
    for record in records:  # every rank logs the last stage's loss; DP replicas each their half batch
        assert len(record["losses"]) == len(expected)
    mean = torch.tensor([r["losses"] for r in records]).mean(0).tolist()
    assert mean == pytest.approx(expected, **LOSS_TOL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("empty_init", [False, True], ids=["plain", "empty_init"])
def test_from_pretrained_in_init_trains_from_the_file_weights(folder, one_device, tmp_path, layout, empty_init):
    for lr in (0.0, 1e-3):
        records = _fit(tmp_path, dict(folder=folder, lr=lr), DEVICES[layout], empty_init, **LAYOUTS[layout])
        _assert_losses(records, one_device[lr, 1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "tp2pp2"])
@pytest.mark.parametrize("empty_init", [False, True], ids=["plain", "empty_init"])
def test_model_built_in_configure_model_is_checked_split_and_trains_like_one_device(folder, one_device, tmp_path,
                                                                                   layout, empty_init):
    replicas = 2 if layout == "dp2" else 1
    records = _fit(tmp_path, dict(folder=folder, where="configure_model"), DEVICES[layout], empty_init, replicas,
                   **LAYOUTS[layout])
    _assert_losses(records, one_device[1e-3, replicas])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_model_built_in_the_setup_hook_is_checked_split_and_trains_like_one_device(folder, one_device, tmp_path,
                                                                                 layout):
    records = _fit(tmp_path, dict(folder=folder, where="setup"), DEVICES[layout], **LAYOUTS[layout])
    _assert_losses(records, one_device[1e-3, 1])


@pytest.mark.timeout(240)
def test_state_dict_loaded_in_init_on_the_meta_device_is_kept(folder, one_device, tmp_path):
    records = _fit(tmp_path, dict(folder=folder, where="state_dict"), 2, True, tensor_parallel=2)
    _assert_losses(records, one_device[1e-3, 1])


@pytest.mark.timeout(240)
def test_lora_on_a_pretrained_base_on_the_meta_device_matches_one_device(folder, tmp_path):
    args = dict(folder=folder, lora=True)
    expected = _fit(tmp_path, args)[0]["losses"]
    for sizes, devices in ((dict(tensor_parallel=2), 2), (dict(pipeline_parallel=2, micro_batches=2), 2)):
        _assert_losses(_fit(tmp_path, args, devices, True, **sizes), expected)


def _read_bytes(rank, world, folder, sizes):
    """Bytes of safetensors data this rank read to materialise its part of the model."""
    from lightning_parallel.options import ParallelOptions
    from lightning_parallel.pipeline import PipelineEngine
    from lightning_parallel.strategy.materialize import (
        UnsplitModel,
        empty_parameters,
        materialize,
    )
    from lightning_parallel.tensor_parallel import parallelize
    from tests.helpers.processes import make_mesh

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    mesh = make_mesh(rank, world, **sizes)
    with empty_parameters():
        module = FineTune(folder)
    unsplit = UnsplitModel.of(module)
    if mesh.tp_size > 1:
        parallelize(module, mesh)
    if mesh.pp_size > 1:
        batch = torch.randint(0, VOCAB, (4, SEQ))
        PipelineEngine(module, mesh, ParallelOptions(micro_batches=2)).partition(batch)
    pretrained.BYTES_READ[0] = 0
    materialize(module, unsplit, mesh.tp_rank, mesh.tp_size, torch.device("cpu"), 0)
    held = sum(p.numel() * p.element_size() for p in module.parameters())
    return pretrained.BYTES_READ[0], held


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sizes", [dict(tp=2), dict(pp=2), dict(tp=2, pp=2)], ids=["tp2", "pp2", "tp2pp2"])
def test_each_rank_reads_only_the_bytes_of_its_own_shards(folder, sizes):
    from tests.helpers.processes import run_distributed

    whole = sum(s.read().numel() * 4 for s in pretrained.read_header(f"{folder}/model.safetensors").values())
    world = sizes.get("tp", 1) * sizes.get("pp", 1)
    results = run_distributed(_read_bytes, world, folder, sizes)
    for read, held in results:
        assert read == held  # what a rank holds (its shards of its stage), byte for byte, and nothing else
        assert read <= whole / world * 1.3  # about its share: a stage's blocks are balanced, norms are whole


def _saved(kind: str, path) -> str:
    """A tiny pretrained folder: sharded safetensors with their index, a tied head, or a Mixtral whose
    per-expert tensors transformers fuses when loading (a layout that differs from the file's)."""
    if kind == "sharded":
        folder = save_tiny_llama(path, vocab=VOCAB)
        transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(path / "sharded",
                                                                                   max_shard_size="100KB")
        return str(path / "sharded")
    if kind == "tied":
        return save_tiny_llama(path, vocab=VOCAB, tied=True)
    torch.manual_seed(1)
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["sharded", "tied", "converted"])
def test_from_pretrained_on_meta_gives_the_files_weights(kind, tmp_path):
    from lightning_parallel.strategy.materialize import (
        UnsplitModel,
        empty_parameters,
        materialize,
    )

    transformers.logging.set_verbosity_error()
    folder = _saved(kind, tmp_path)
    if kind == "sharded":
        assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with empty_parameters():
        meta = transformers.AutoModelForCausalLM.from_pretrained(folder)
    materialize(meta, UnsplitModel.of(meta), 0, 1, torch.device("cpu"), 0)
    expected = dict(plain.named_parameters(remove_duplicate=False))
    for name, value in meta.named_parameters(remove_duplicate=False):
        assert torch.equal(value, expected[name]), name
    if kind == "tied":
        assert meta.lm_head.weight is meta.model.embed_tokens.weight


def _resized(folder: str, tokens: int):
    def build():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        model.resize_token_embeddings(tokens)
        return model
    return build


def _tied_after_loading(folder: str):
    def build():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        return model
    return build


@pytest.mark.parametrize("kind", ["grown", "grown_tied", "shrunk", "tie_weights"])
def test_tokens_added_and_weights_tied_after_from_pretrained_on_meta_give_eager_values(kind, tmp_path):
    """Mean resizing reads the old rows and draws the new ones: on meta the values are read on demand
    and the draws made as in eager construction, so the result is bit for bit eager's, and the generator
    continues as after an eager build."""
    from lightning_parallel.strategy.materialize import (
        UnsplitModel,
        empty_parameters,
        materialize,
    )

    transformers.logging.set_verbosity_error()
    folder = save_tiny_llama(tmp_path, vocab=VOCAB, tied=kind == "grown_tied")
    build = _tied_after_loading(folder) if kind == "tie_weights" else _resized(folder, 120 if kind == "shrunk" else 131)
    torch.manual_seed(0)
    eager = build()
    after_eager = torch.rand(4)
    torch.manual_seed(0)
    with empty_parameters():
        meta = build()
    assert torch.equal(torch.rand(4), after_eager)
    materialize(meta, UnsplitModel.of(meta), 0, 1, torch.device("cpu"), 0)
    expected = dict(eager.named_parameters(remove_duplicate=False))
    for name, value in meta.named_parameters(remove_duplicate=False):
        assert value.shape == expected[name].shape and torch.equal(value, expected[name]), name
    assert (meta.lm_head.weight is meta.model.embed_tokens.weight) == (kind in ("grown_tied", "tie_weights"))


@pytest.mark.timeout(300)
def test_tokens_added_after_from_pretrained_on_meta_train_like_one_device(folder, tmp_path):
    """resize_token_embeddings(131) after from_pretrained, under empty_init at TP2 (131 rows do not divide
    by 2: the vocabulary-parallel embedding and head pad them) and PP2, against one device built plainly
    with the same seed. The values are eager construction's bit for bit (test above), so the float32
    parity bound holds: losses to 1e-5."""
    args = dict(folder=folder, tokens=131)
    expected = _fit(tmp_path, args)[0]["losses"]
    for layout in ("tp2", "pp2"):
        _assert_losses(_fit(tmp_path, args, DEVICES[layout], True, **LAYOUTS[layout]), expected)


def _resized_on_unseeded_rank(rank, world, folder):
    """This rank's materialised resized model, built after a seed of its own (a popen or torchrun launch
    whose script does not seed): the strategy's broadcast makes it rank 0's construction."""
    from lightning_parallel.strategy.materialize import (
        UnsplitModel,
        broadcast_recorded_values,
        empty_parameters,
        materialize,
    )

    transformers.logging.set_verbosity_error()
    torch.manual_seed(rank)
    with empty_parameters():
        model = _resized(folder, 131)()
    broadcast_recorded_values(model)
    materialize(model, UnsplitModel.of(model), 0, 1, torch.device("cpu"), 0)
    return {name: p.detach() for name, p in model.named_parameters() if "embed" in name or "lm_head" in name}


@pytest.mark.timeout(120)
def test_rows_drawn_by_resizing_on_ranks_seeded_apart_are_rank_zeros(folder):
    from tests.helpers.processes import run_distributed

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    eager = dict(_resized(folder, 131)().named_parameters())
    for values in run_distributed(_resized_on_unseeded_rank, 2, folder):
        for name, value in values.items():
            assert torch.equal(value, eager[name]), name
