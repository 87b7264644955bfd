"""A refused setting is the last thing the user reads, in the language the user wrote.

Each test runs a small training script with one mistake in a fresh Python process and reads its
stderr as a terminal would show it: the refusal (which names the module, what is unsupported and
what to write, as the Python arguments of the strategy the script built) ends the output, printed
once, raised in the launching process before any worker starts (no torch ``ProcessRaisedException``
around it); no second traceback follows it (teardown moving meta tensors to the CPU, a crash while
formatting the suggestion), on every launch path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import torch, lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_parallel.models.gpt import GPT
    from lightning_parallel.strategy import ParallelStrategy


    class ManualGPT(GPT):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(self._loss(batch))
            optimizer.step()


    if __name__ == "__main__":
        g = torch.Generator().manual_seed(2)
        data = TensorDataset(torch.randint(0, 256, (16, 16), generator=g), torch.randint(0, 256, (16, 16), generator=g))
        trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            strategy=ParallelStrategy(start_method={start_method!r}, timeout=30, **{strategy}))
        with trainer.init_module(empty_init={empty_init}):
            model = {model_class}(n_layer=2, n_embd={n_embd}, n_head={n_head}, block_size=16)
        trainer.fit(model, DataLoader(data, batch_size=4))
""")

CASES = {
    # name: (strategy kwargs, model kwargs, first line of the refusal, its last line)
    "tp_size_does_not_divide_heads": (
        dict(tensor_parallel=2), dict(n_embd=30, n_head=3),
        "transformer.h.0.attn: number of heads = 3 is not divisible by tensor_parallel=2",
        "ParallelStrategy(tensor_parallel=3), Trainer(devices=3)",  # after tensor_parallel=1 on the 2 devices
    ),
    "misspelled_glob": (
        dict(tensor_parallel=2, tp_plan={"transformer.h.*.atn.c_attn": "colwise"}), {},
        "tp_plan glob 'transformer.h.*.atn.c_attn' matches no module of GPT",
        "tp_plan glob 'transformer.h.*.atn.c_attn' matches no module of GPT",
    ),
    "unknown_style": (
        dict(tensor_parallel=2, tp_plan={"transformer.h.*.attn.c_attn": "columnwise"}), {},
        "tp_plan['transformer.h.*.attn.c_attn']: unknown style 'columnwise'",
        "known styles: colwise, rowwise",
    ),
    "pipeline_blocks_not_found": (
        dict(pipeline_parallel=2, pipeline_blocks="transformer.hh"), {},
        "pipeline_blocks='transformer.hh' is not a submodule of GPT",
        "ParallelStrategy(pipeline_parallel=1)",
    ),
    "manual_optimization_under_pp": (
        dict(pipeline_parallel=2), dict(model_class="ManualGPT"),
        "ManualGPT sets automatic_optimization = False, which pipeline_parallel=2 does not support",
        "ParallelStrategy(pipeline_parallel=1)",
    ),
}


def run_script(tmp_path, case: str, start_method: str = "fork", empty_init: bool = False) -> str:
    strategy, model, _, _ = CASES[case]
    fields = {"n_embd": 32, "n_head": 2, "model_class": "GPT", **model}
    script = tmp_path / f"{case}.py"
    script.write_text(SCRIPT.format(start_method=start_method, strategy=strategy, empty_init=empty_init, **fields))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170, env=env)
    assert run.returncode != 0, run.stderr[-2000:]
    return run.stderr


def assert_refusal_is_last(stderr: str, case: str) -> None:
    _, _, first, last = CASES[case]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert last in lines[-1], "\n".join(lines[-20:])
    errors = [i for i, line in enumerate(lines) if "LaunchError: " in line]
    assert errors and first in lines[errors[-1]], "\n".join(lines[-20:])
    # nothing after the refusal but its own lines, and no crash while it was raised or cleaned up
    assert not any("Traceback" in line or "During handling" in line for line in lines[errors[-1]:])
    assert "meta tensor" not in stderr and "max() arg" not in stderr and "another exception occurred" not in stderr
    # written as the script's own Python arguments, not as lp-train's overrides
    assert not any(line.lstrip().startswith("strategy.") for line in lines[errors[-1]:]), "\n".join(lines[-20:])
    # once, from the launching process: no worker started
    assert len(errors) == 1, "\n".join(lines)
    assert "ProcessRaisedException" not in stderr and "Initializing distributed" not in stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_refusal_ends_the_output_under_fork(tmp_path, case):
    assert_refusal_is_last(run_script(tmp_path, case), case)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["misspelled_glob", "tp_size_does_not_divide_heads"])
def test_refusal_of_a_model_on_the_meta_device_ends_the_output(tmp_path, case):
    # the parent's module never left the meta device: teardown must not try to move it
    assert_refusal_is_last(run_script(tmp_path, case, empty_init=True), case)


@pytest.mark.timeout(180)
def test_refusal_ends_the_output_under_popen(tmp_path):
    # rank 0 is the launching process: it refuses before re-running the script for the other rank,
    # and tears down its own meta module
    stderr = run_script(tmp_path, "misspelled_glob", start_method="popen", empty_init=True)
    assert_refusal_is_last(stderr, "misspelled_glob")


@pytest.mark.timeout(180)
def test_unknown_pipeline_blocks_suggests_the_models_block_list(tmp_path):
    stderr = run_script(tmp_path, "pipeline_blocks_not_found")
    assert "    ParallelStrategy(pipeline_blocks='transformer.h')\n" in stderr


# ---- the checks themselves, without processes ----------------------------------------------------
def _gpt(**kwargs):
    from lightning_parallel.models.gpt import GPT

    return GPT(n_layer=2, block_size=16, **{"n_embd": 32, "n_head": 2, **kwargs})


@pytest.mark.parametrize("plan", [{"transformer.h.*.atn.c_attn": "colwise"}, {"transformer.h.*.attn.c_attn": "col"}],
                         ids=["no_module", "unknown_style"])
def test_a_plan_no_size_fits_is_refused_with_its_own_message_only(plan):
    from lightning_parallel.checks.model import check_model
    from lightning_parallel.errors import LaunchError
    from lightning_parallel.mesh import ParallelMesh
    from lightning_parallel.options import ParallelOptions

    with pytest.raises(LaunchError) as refused:
        check_model(_gpt(), ParallelMesh(4, tensor_parallel=4), ParallelOptions(tensor_parallel=4, tp_plan=plan))
    assert "TP sizes" not in str(refused.value) and refused.value.__cause__ is None


def test_tp_size_that_does_not_divide_heads_names_the_sizes_that_do():
    from lightning_parallel.checks.model import check_model
    from lightning_parallel.errors import LaunchError
    from lightning_parallel.mesh import ParallelMesh
    from lightning_parallel.options import ParallelOptions

    with pytest.raises(LaunchError, match=r"(?s)number of heads = 6 .*allow: \[1, 2\].*tensor_parallel=2"):
        check_model(_gpt(n_embd=48, n_head=6), ParallelMesh(4, tensor_parallel=4), ParallelOptions(tensor_parallel=4))


@pytest.mark.parametrize("automatic, scaler, expected", [
    (False, False, "ManualGPT sets automatic_optimization = False"),
    (True, True, "precision '16-mixed' needs a loss scaler"),
])
def test_pipeline_refuses_what_it_cannot_run(automatic, scaler, expected):
    from lightning_parallel.checks.model import check_training_mode
    from lightning_parallel.errors import LaunchError
    from lightning_parallel.models.gpt import GPT

    model = type("ManualGPT", (GPT,), {})(n_layer=2, n_embd=32, n_head=2, block_size=16)
    with pytest.raises(LaunchError, match=expected):
        check_training_mode(model, 2, automatic, scaler)
    check_training_mode(model, 1, automatic, scaler)  # without pipelining both are fine
