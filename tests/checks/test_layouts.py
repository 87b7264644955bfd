"""A refusal suggests only layouts the model runs on the allocation it has, and each one it prints works.

Hugging Face BERT classifiers with 4, 6 and 12 attention heads (two blocks) inside a plain
LightningModule are refused at layouts they cannot run; every fix the refusal prints, as the
arguments of ``ParallelStrategy`` and ``Trainer`` a script passes, is read back and run: through
every check of a launch for each of them, and through a real training step for the 4-head model's.
"""

from __future__ import annotations

import re
from datetime import timedelta
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_parallel.checks.launch import validate_launch
from lightning_parallel.cli.run_summary import layout_lines
from lightning_parallel.errors import LaunchError, python_arguments
from lightning_parallel.mesh import ParallelMesh
from lightning_parallel.options import ParallelOptions
from lightning_parallel.strategy import ParallelStrategy
from tests.helpers.parity import TensorDataset, fit_and_record


class Classifier(L.LightningModule):
    """A user's module around a Hugging Face sequence classifier, unchanged by the strategy."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=64, hidden_size=8 * heads, num_hidden_layers=2, num_attention_heads=heads,
                            intermediate_size=16 * heads, max_position_embeddings=16, num_labels=3)
        self.bert = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return self.bert(input_ids=tokens, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# (devices, strategy arguments) that the classifiers cannot run as given
MISTAKES = [
    (3, dict(tensor_parallel=2)),  # 2 does not divide the 3 devices
    (2, dict(tensor_parallel=3)),  # 3 processes needed
    (3, dict(tensor_parallel=3)),  # 3 does not divide 4 heads (it divides 6 and 12)
    (6, dict(tensor_parallel=4)),  # 4 does not divide 6 devices, nor 6 heads
    (4, dict(tensor_parallel=8)),  # more TP ranks than devices and than 4 or 6 heads
    (2, dict(pipeline_parallel=3)),  # 3 stages of 2 blocks
    (4, dict(tensor_parallel=2, data_parallel=1)),  # a DP size that leaves 2 devices idle
]
SCRIPT_CALLS = {"ParallelStrategy": lambda **kw: ("strategy", kw), "Trainer": lambda **kw: ("trainer", kw)}


def printed_fixes(message: str) -> list[tuple[dict, dict]]:
    """The fixes a refusal printed, read back as (strategy arguments, Trainer arguments)."""
    fixes = []
    for line in message.splitlines():
        code = line.split("   #")[0].strip()
        if line.startswith("    ") and re.match(r"(ParallelStrategy|Trainer)\(", code):
            calls = dict(eval(f"[{code}]", {"__builtins__": {}}, SCRIPT_CALLS))  # noqa: S307 - our own output
            fixes.append((calls.get("strategy", {}), calls.get("trainer", {})))
    return fixes


def refusal(model, devices: int, strategy: dict) -> str:
    """The refusal of ``strategy`` on one node of ``devices``, written as a script's arguments."""
    with pytest.raises(LaunchError) as refused:
        validate_launch(ParallelOptions(**strategy), 1, devices, model=model)
    return str(refused.value.in_language(python_arguments("ParallelStrategy")))


@pytest.mark.parametrize("heads", [4, 6, 12])
def test_every_printed_fix_passes_every_check_of_its_launch(heads):
    with torch.device("meta"):  # the checks read shapes only
        model = Classifier(heads)
    refused = 0
    for devices, strategy in MISTAKES:
        try:
            validate_launch(ParallelOptions(**strategy), 1, devices, model=model)
            continue  # a layout this model runs (tensor_parallel=3 on 6 or 12 heads)
        except LaunchError as err:
            refused += 1
            message = str(err.in_language(python_arguments("ParallelStrategy")))
        fixes = printed_fixes(message)
        assert fixes, message  # a script is told what to write
        assert "out_features" not in message and "in_features" not in message, message
        tp = strategy.get("tensor_parallel", 1)
        if heads % tp:
            assert f"{heads} attention heads" in message, message
        for fixed_strategy, fixed_trainer in fixes:
            assert fixed_trainer.get("num_nodes", 1) == 1, message  # the one machine it has
            options = ParallelOptions(**{**strategy, **fixed_strategy})
            validate_launch(options, 1, fixed_trainer.get("devices", devices), model=model)
        listed = re.search(r"Layouts that fit (\d+) processes[^:]*: (.*)", message)
        for tp_, pp, dp in re.findall(r"tp=(\d+) pp=(\d+) dp=(\d+)", listed.group(2) if listed else ""):
            validate_launch(ParallelOptions(tensor_parallel=int(tp_), pipeline_parallel=int(pp),
                                            data_parallel=int(dp)), 1, devices, model=model)
    assert refused >= 5


def test_tp_size_that_does_not_divide_the_heads_suggests_the_sizes_that_do_on_other_devices():
    with torch.device("meta"):
        message = refusal(Classifier(4), 3, dict(tensor_parallel=3))
    assert message.startswith("tensor_parallel=3 does not divide the 4 attention heads of "
                              "BertForSequenceClassification"), message
    fixes = printed_fixes(message)
    assert ({"tensor_parallel": 2}, {"devices": 2}) in fixes and ({"tensor_parallel": 2}, {"devices": 4}) in fixes


@pytest.mark.timeout(240)
def test_the_fixes_of_a_refused_script_train(tmp_path):
    """The 4-head classifier at tensor_parallel=2 on 3 devices, as a script launches it: refused in the
    launching process with its own arguments, and each printed fix then trains a step."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 64, (16, 8), generator=g), torch.randint(0, 3, (16,), generator=g))
    strategy = lambda **kw: ParallelStrategy(start_method="fork", timeout=timedelta(seconds=60), **kw)  # noqa: E731
    L.seed_everything(0)
    with pytest.raises(LaunchError) as refused:
        fit_and_record(Classifier(4), data, 4, str(tmp_path / "refused"), devices=3,
                       strategy=strategy(tensor_parallel=2), max_steps=1)
    message = str(refused.value)
    fixes = printed_fixes(message)
    assert "tp=3" not in message and len(fixes) >= 3, message
    for i, (fixed_strategy, fixed_trainer) in enumerate(fixes):
        devices = fixed_trainer.get("devices", 3)
        records = fit_and_record(Classifier(4), data, 4, str(tmp_path / f"fix{i}"), devices=devices,
                                 strategy=strategy(**{"tensor_parallel": 2, **fixed_strategy}), max_steps=1)
        assert [r["global_step"] for r in records] == [1] * devices, message


def test_start_block_names_every_dimension_in_use():
    plan = SimpleNamespace(mesh=ParallelMesh(4, expert_parallel=2), num_nodes=1, devices_per_node=4,
                           model_name="MixtralForCausalLM", parameters=1e6, tp_plan={}, share=None, stages=None)
    assert layout_lines(plan)[0].startswith("layout       pp=1 x dp=4 (ep=2) x tp=1 on 1 node(s) x 4 devices")
    assert ParallelMesh(4, expert_parallel=2).describe().startswith("mesh: pp=1 x dp=4 (ep=2) x tp=1 = 4 processes")
