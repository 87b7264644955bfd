"""The fine-tuning recipe end to end, as a user runs it: a pretrained Hugging Face folder, `lp-train` at
TP2 x PP2 with the module unchanged, `lp-export`, `from_pretrained`.

The test saves its own tiny Llama (no download). The first logged loss must be the pretrained model's
loss on the first batch (a fresh initialisation is off by more than 0.5; float32 reassociation across
the split stays below 1e-5), and the exported folder must hold exactly the trained weights.
"""

from __future__ import annotations

import csv
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate

from lightning_parallel.checkpoint.consolidate import consolidate
from lightning_parallel.cli.overrides import compose_config
from tests.helpers.pretrained import save_tiny_llama

transformers = pytest.importorskip("transformers")

RECIPE = ["+recipe=finetune_cpu", "trainer.max_steps=4", "trainer.val_check_interval=2",
          "trainer.log_every_n_steps=1"]


def _run(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _first_batch_loss(folder: str) -> float:
    """The pretrained model's loss on the first training batch the recipe reads."""
    cfg = compose_config([*RECIPE, f"model.pretrained={folder}"])
    data = instantiate(cfg.data, _convert_="all")
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)))


@pytest.mark.timeout(600)
def test_finetune_recipe_trains_from_the_pretrained_weights_and_exports_them(tmp_path):
    folder = save_tiny_llama(tmp_path / "pretrained", vocab=256)
    run = tmp_path / "run"
    _run(["lp-train", *RECIPE, f"model.pretrained={folder}", f"hydra.run.dir={run}"], cwd=tmp_path)
    with open(run / "logs" / "version_0" / "metrics.csv") as f:
        losses = {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")}
    assert losses[min(losses)] == pytest.approx(_first_batch_loss(folder), abs=1e-5)

    last = run / "checkpoints" / "last.ckpt"
    assert last.is_dir()  # split at TP2 x PP2: one file per rank
    out = tmp_path / "exported"
    _run(["lp-export", str(last), str(out)], cwd=tmp_path)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    trained = {k.removeprefix("model."): v for k, v in consolidate(last)["state_dict"].items()}
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    state = exported.state_dict()
    assert state.keys() == trained.keys()
    for name, value in state.items():
        assert torch.equal(value, trained[name]), name
    assert not torch.equal(state["model.layers.0.mlp.up_proj.weight"], pretrained["model.layers.0.mlp.up_proj.weight"])
