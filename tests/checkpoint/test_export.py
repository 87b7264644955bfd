"""``lp-export``: a split run's checkpoint -> a Hugging Face folder that ``from_pretrained`` loads with
exactly the trained weights.

Each round trip starts as a user would: the test saves a tiny Hugging Face model with
``save_pretrained``, an unchanged LightningModule loads it with ``from_pretrained`` (and wraps it
with PEFT LoRA in the adapter cases), a fork-started ``ParallelStrategy`` fine-tunes it for a few
steps and ``ModelCheckpoint`` writes a DCP directory. The trained weights are that checkpoint's,
consolidated (``lp-consolidate``'s tensors, whose equality with a one-device run
``test_checkpoint.py`` establishes). Export copies bytes and never recomputes them, except
``--merge``, which runs PEFT's own merge on the same values, so every comparison is ``torch.equal``.

What is compared besides the loaded weights: the files and tensor names against transformers' own
``save_pretrained`` of the trained model (and PEFT's for adapters), and ``config.json`` byte for byte.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checkpoint import consolidate
from lightning_parallel.cli.consolidate import main as consolidate_main
from lightning_parallel.cli.export import main as export_main
from lightning_parallel.strategy import ParallelStrategy

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 3
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=SEQ)


def llama(tie: bool, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_key_value_heads": kv_heads}, tie_word_embeddings=tie))


def gpt2():
    """Conv1D layers (LoRA needs ``fan_in_fan_out``), a fused QKV weight, a head tied to the embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def mixtral():
    """Experts fused in memory (``gate_up_proj``), saved per expert by ``save_pretrained``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{**SMALL, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=0.0)
    return MixtralForCausalLM(config)


MODELS = {"llama_tied": lambda: llama(True), "llama": lambda: llama(False), "gpt2": gpt2, "mixtral": mixtral,
          "llama_one_kv_head": lambda: llama(False, kv_heads=1)}  # on TP2 each rank holds a copy of the KV head
LORA = {"llama": dict(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], modules_to_save=["lm_head"]),
        "llama_tied": dict(target_modules=["q_proj", "v_proj"]),
        "llama_one_kv_head": dict(target_modules=["q_proj", "k_proj", "v_proj"]),
        "gpt2": dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)}


class FineTune(L.LightningModule):
    """A user's module: a pretrained folder loaded in ``__init__``, optionally under LoRA adapters."""

    def __init__(self, folder: str, lora: Optional[dict] = None):
        super().__init__()
        self.save_hyperparameters()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder)
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            # init_lora_weights=False: B starts non-zero, so the adapters matter from the first step
            self.model = get_peft_model(self.model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def pretrained(folder: Path, model: str) -> Path:
    torch.manual_seed(0)
    MODELS[model]().save_pretrained(folder)
    return folder


def fit(out: Path, folder: Path, lora: Optional[dict], devices: int = 1, **layout) -> Path:
    """Fine-tune for STEPS steps; return the checkpoint ModelCheckpoint wrote at the last one."""
    warnings.filterwarnings("ignore")
    strategy = ParallelStrategy(start_method="fork", timeout=60, **layout) if devices > 1 else "auto"
    data = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=STEPS)], enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(FineTune(str(folder), lora), DataLoader(TensorDataset(data), batch_size=BATCH))
    return out / f"epoch=0-step={STEPS}.ckpt"


def trained(checkpoint: Path, folder: Path, lora: Optional[dict]) -> FineTune:
    """The module holding the checkpoint's weights (consolidated when it is a directory)."""
    state = consolidate(checkpoint)["state_dict"] if checkpoint.is_dir() else torch.load(checkpoint)["state_dict"]
    module = FineTune(str(folder), lora)
    module.load_state_dict(state)
    return module


def safetensors_in(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def assert_equal_states(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def assert_like_save_pretrained(out: Path, reference: Path) -> None:
    """Same names and bytes per tensor, same configs as ``save_pretrained``."""
    assert safetensors_in(out).keys() == safetensors_in(reference).keys()
    assert_equal_states(safetensors_in(out), safetensors_in(reference))
    for name in ("config.json", "generation_config.json", "adapter_config.json"):
        assert (out / name).is_file() == (reference / name).is_file(), name
        if (out / name).is_file():
            assert _config(out / name) == _config(reference / name), name


def _config(file: Path) -> dict:
    """A saved config; PEFT keeps ``target_modules`` as a set and writes it in the set's order."""
    config = json.loads(file.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return config


def check_round_trip(tmp_path: Path, checkpoint: Path, folder: Path, lora: Optional[dict]) -> None:
    from transformers import AutoModelForCausalLM

    module = trained(checkpoint, folder, lora)
    initial = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    export_main([str(checkpoint), str(tmp_path / "out")])
    module.model.save_pretrained(tmp_path / "reference")
    assert_like_save_pretrained(tmp_path / "out", tmp_path / "reference")
    # lp-consolidate's file keeps the record: it exports the same
    consolidate_main([str(checkpoint), str(tmp_path / "plain.ckpt")])
    export_main([str(tmp_path / "plain.ckpt"), str(tmp_path / "from_plain")])
    assert_equal_states(safetensors_in(tmp_path / "from_plain"), safetensors_in(tmp_path / "out"))
    if lora is None:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
        assert_equal_states(loaded, module.model.state_dict())
        assert not all(torch.equal(loaded[n], initial[n]) for n in initial)  # training moved the weights
        return
    from peft import PeftModel

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "out")
    assert_equal_states(adapter.state_dict(), module.model.state_dict())
    export_main([str(checkpoint), str(tmp_path / "merged"), "--merge"])
    merged = module.model.merge_and_unload()
    assert not all(torch.equal(t, initial[n]) for n, t in merged.state_dict().items())  # the adapters count
    assert_equal_states(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict(), merged.state_dict())
    merged.save_pretrained(tmp_path / "merged_reference")
    assert_like_save_pretrained(tmp_path / "merged", tmp_path / "merged_reference")


LAYOUTS = {"tp2": dict(devices=2, tensor_parallel=2), "pp2": dict(devices=2, pipeline_parallel=2, micro_batches=2),
           "tp2pp2": dict(devices=4, tensor_parallel=2, pipeline_parallel=2, micro_batches=2)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout, model", [("tp2", "gpt2"), ("pp2", "llama_tied"), ("tp2pp2", "mixtral"),
                                           ("tp2", "llama_one_kv_head")])
def test_split_checkpoint_exports_the_trained_weights_as_save_pretrained_does(tmp_path, layout, model):
    folder = pretrained(tmp_path / "pretrained", model)
    checkpoint = fit(tmp_path / "ckpt", folder, None, **LAYOUTS[layout])
    assert checkpoint.is_dir()
    check_round_trip(tmp_path, checkpoint, folder, None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout, model", [("tp2", "llama"), ("pp2", "gpt2"), ("tp2pp2", "llama_tied"),
                                           ("tp2", "llama_one_kv_head")])
def test_split_lora_checkpoint_exports_peft_adapter_folder_and_merged_model(tmp_path, layout, model):
    folder = pretrained(tmp_path / "pretrained", model)
    checkpoint = fit(tmp_path / "ckpt", folder, LORA[model], **LAYOUTS[layout])
    check_round_trip(tmp_path, checkpoint, folder, LORA[model])


@pytest.mark.timeout(60)
def test_one_device_checkpoint_without_record_exports_with_config_folder(tmp_path, capsys):
    """Lightning's own strategy saves no record of the model: ``--config`` supplies it."""
    from transformers import AutoModelForCausalLM

    folder = pretrained(tmp_path / "pretrained", "llama")
    checkpoint = fit(tmp_path / "ckpt", folder, None)
    assert checkpoint.is_file()
    with pytest.raises(SystemExit):
        export_main([str(checkpoint), str(tmp_path / "out")])
    refusal = capsys.readouterr().err
    assert "was not saved by ParallelStrategy" in refusal and "--config FOLDER" in refusal
    export_main([str(checkpoint), str(tmp_path / "out"), "--config", str(folder), "--max-shard-size", "20KB"])
    assert "(--config)" in capsys.readouterr().out
    module = trained(checkpoint, folder, None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert_equal_states(loaded, module.model.state_dict())
    module.model.save_pretrained(tmp_path / "reference", max_shard_size="20KB")
    assert_like_save_pretrained(tmp_path / "out", tmp_path / "reference")
    # several files and their index; which tensor goes in which file may differ (README: key format)
    got, expected = (json.loads((f / "model.safetensors.index.json").read_text()) for f in (tmp_path / "out",
                                                                                           tmp_path / "reference"))
    assert len(set(got["weight_map"].values())) > 1
    assert got["metadata"] == expected["metadata"] and got["weight_map"].keys() == expected["weight_map"].keys()


def test_streamed_safetensors_file_holds_what_the_library_would_write(tmp_path):
    from safetensors.torch import load_file

    from lightning_parallel.checkpoint.safetensors_file import write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g).to(torch.bfloat16), "scalar": torch.tensor(2.5),
               "mask": torch.rand(7, generator=g) > 0.5, "ids": torch.arange(6, dtype=torch.int64).view(2, 3),
               "empty": torch.zeros(0, 4), "t": torch.randn(4, 6, generator=g).t()}  # a non-contiguous view
    produced = []
    write_safetensors(tmp_path / "x.safetensors", {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()},
                      lambda name: produced.append(name) or tensors[name], {"format": "pt"})
    assert produced == list(tensors)  # each asked for once, in order
    assert_equal_states(load_file(tmp_path / "x.safetensors"), tensors)
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
