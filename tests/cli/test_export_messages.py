"""``lp-export`` refuses in one line, saying what would work: a module with several Hugging Face
models (``--module``), with none (``lp-consolidate``), ``--merge`` without LoRA, a non-empty output.

The checkpoints are plain files written by ``ParallelStrategy`` on one process (an unsplit model: a
``.ckpt`` with the record of the module's Hugging Face models), or that record saved by hand.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checkpoint.hf_models import RECORD_KEY, describe
from lightning_parallel.cli.export import main
from lightning_parallel.strategy import ParallelStrategy
from tests.checkpoint.test_export import VOCAB, assert_equal_states, llama


class Distill(L.LightningModule):
    """Two Hugging Face models in one module: a student trained against a frozen teacher."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.student, self.teacher = llama(False), llama(True)
        self.teacher.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.student(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.student.parameters(), lr=1e-2)


def refusal(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("lp-export: ") and err.count("\n") <= 2, err
    return err


def saved(path: Path, module: nn.Module) -> Path:
    """What ParallelStrategy saves for an unsplit model: the state dict and the record."""
    torch.save({"state_dict": module.state_dict(), RECORD_KEY: describe(module)}, path)
    return path


@pytest.mark.timeout(60)
def test_several_models_need_module_and_each_exports_alone(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    module = Distill()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ParallelStrategy(start_method="fork", timeout=60),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=4))
    trainer.save_checkpoint(tmp_path / "distill.ckpt")
    assert RECORD_KEY in torch.load(tmp_path / "distill.ckpt")
    message = refusal(capsys, tmp_path / "distill.ckpt", tmp_path / "out")
    assert "2 Hugging Face models: student, teacher" in message and "--module NAME" in message
    assert "it holds: student, teacher" in refusal(capsys, tmp_path / "distill.ckpt", tmp_path / "out",
                                                   "--module", "pupil")
    for name in ("student", "teacher"):
        main([str(tmp_path / "distill.ckpt"), str(tmp_path / name), "--module", name])
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
        assert_equal_states(loaded, getattr(module, name).state_dict())


def test_module_without_hugging_face_model_points_at_lp_consolidate(tmp_path, capsys):
    checkpoint = saved(tmp_path / "plain.ckpt", nn.Sequential(nn.Linear(2, 2)))
    message = refusal(capsys, checkpoint, tmp_path / "out")
    assert "holds no Hugging Face model" in message and "lp-consolidate CKPT OUT.ckpt" in message


def test_merge_refuses_a_model_without_adapters_and_adapters_other_than_lora(tmp_path, capsys):
    from peft import IA3Config, get_peft_model

    plain = saved(tmp_path / "plain.ckpt", nn.ModuleDict({"model": llama(False)}))
    assert "has no PEFT adapters to merge" in refusal(capsys, plain, tmp_path / "out", "--merge")
    ia3 = get_peft_model(llama(False), IA3Config(target_modules=["k_proj", "down_proj"],
                                                 feedforward_modules=["down_proj"]))
    adapted = saved(tmp_path / "ia3.ckpt", nn.ModuleDict({"model": ia3}))
    assert "--merge folds LoRA adapters only" in refusal(capsys, adapted, tmp_path / "out", "--merge")
    main([str(adapted), str(tmp_path / "adapter")])  # the adapter folder is written by PEFT itself
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_output_folder_must_be_new_or_empty(tmp_path, capsys):
    checkpoint = saved(tmp_path / "plain.ckpt", nn.ModuleDict({"model": llama(False)}))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"old")
    assert "is not empty" in refusal(capsys, checkpoint, tmp_path / "out")
    assert "no checkpoint at" in refusal(capsys, tmp_path / "missing.ckpt", tmp_path / "new")
