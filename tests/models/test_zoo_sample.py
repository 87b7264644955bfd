"""The zoo's fixed sample of Hugging Face causal LMs at TP=2 and PP=2 (``benchmarks/zoo.py``).

Eight architectures of different build: Llama (split q/k/v, grouped KV heads, a plan of its own),
Qwen3 (q/k norms), Phi-3 (fused qkv and gate-up projections), GPT-NeoX (fused qkv, parallel
residual), GPT-2 (Conv1D, learned positions), OPT (no plan, learned positions with an offset),
Mixtral (mixture of experts) and BLOOM (no plan, ALiBi), at the zoo's first shape; and Llama and
GPT-2 at a second one (6 heads over 2 KV heads, 3 layers the pipeline splits unevenly, an odd
vocabulary under a tied head). Each, built from the zoo's generic tiny config inside an unchanged
LightningModule, either trains through ``Trainer`` with the strategy
to the one-process losses and parameters step for step, or is refused at set-up with one of the
strategy's own errors (which says what to do instead). It is never wrong, never crashes once
training started and never hangs. Tolerances: loss 1e-5, parameters 1e-4 (``zoo.LOSS_TOL``,
``zoo.PARAM_TOL``), justified in the zoo's docstring.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import zoo
from benchmarks.zoo_random import KeyedDraws

MODES = ("tp2", "pp2")
OTHER_SHAPE = ("gqa3", ("llama", "gpt2"))


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """The sample's results, one forked process group per architecture (about 5 s each)."""
    out = tmp_path_factory.mktemp("zoo")
    first = zoo.run_zoo(list(zoo.SAMPLE), out / "base.json", "base", MODES, log=lambda line: None)
    shape, archs = OTHER_SHAPE
    other = zoo.run_zoo(list(archs), out / f"{shape}.json", shape, MODES, log=lambda line: None)
    return {**first["architectures"], **{f"{a}@{shape}": e for a, e in other["architectures"].items()}}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("arch", list(zoo.SAMPLE) + [f"{a}@{OTHER_SHAPE[0]}" for a in OTHER_SHAPE[1]])
def test_tp2_and_pp2_match_one_process_or_refuse_at_setup(sample, arch):
    entry = sample[arch]
    assert entry["one_process"] == "trains", f"{arch} no longer trains from the generic config; pick another"
    for mode in MODES:
        outcome = entry[mode]
        refused_cleanly = outcome.startswith("refused: lightning_parallel.")
        assert outcome == "parity" or refused_cleanly, f"{arch} at {mode}: {outcome}"
        if outcome == "parity" and mode == "tp2":  # the split was checked against the whole at setup
            assert entry[f"{mode}_detail"]["verified"]["units"], arch
            assert entry[f"{mode}_detail"]["share"] < 0.9, arch


@pytest.mark.timeout(400)
def test_llama_reaches_parity_at_tp2_and_pp2(sample):
    """The architecture the project is built around is not merely refused."""
    assert (sample["llama"]["tp2"], sample["llama"]["pp2"]) == ("parity", "parity")


def test_a_parameter_off_by_the_learning_rate_is_wrong():
    """The comparison itself can fail: one element moved by lr (1e-3) is ten times PARAM_TOL."""
    reference = {"losses": [4.8, 4.7], "params": {"w": torch.zeros(3, 3), "b": torch.zeros(3)}}
    close = {"losses": [4.8 + 1e-6, 4.7], "params": {"w": torch.full((3, 3), 1e-6)}, "sharded": 1}
    stage = {"losses": [4.8, 4.7], "params": {"b": torch.zeros(3)}, "sharded": 0}
    assert zoo.compare(reference, [close, stage])[0] == "parity"
    off = {**close, "params": {"w": torch.zeros(3, 3).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(1e-3))}}
    assert zoo.compare(reference, [off, stage])[0].endswith("param 1.0e-03 (w)")
    assert zoo.compare(reference, [close])[0] == "wrong: parameters on no rank: b"


@pytest.mark.timeout(120)
def test_a_hung_run_is_killed_recorded_and_the_next_run_still_happens(tmp_path, monkeypatch):
    """A TP run that never returns becomes ``hang`` after the timeout; PP runs in a fresh process."""
    run_mode = zoo.run_mode

    def hang_at_tp(module, reference, mode, *args):
        if mode == "tp2":
            import time

            time.sleep(3600)
        return run_mode(module, reference, mode, *args)

    monkeypatch.setattr(zoo, "run_mode", hang_at_tp)  # the forked per-architecture process inherits it
    entry = zoo.run_zoo(["llama"], tmp_path / "results.json", modes=MODES, timeout=30,
                        log=lambda line: None)["architectures"]["llama"]
    assert (entry["one_process"], entry["tp2"], entry["pp2"]) == ("trains", "hang", "parity")


def test_an_outcome_names_the_last_exception_of_a_child_traceback():
    """What a forked rank's failure looks like to the harness: a traceback inside a message."""
    text = (
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
        '  File "a.py", line 1, in f\n    g()\nKeyError: 1\n\nDuring handling of the above exception, '
        'another exception occurred:\n\nTraceback (most recent call last):\n  File "b.py", line 2, in g\n'
        "    raise TensorParallelError(msg)\n    ^^^^^^^^^^\n"
        "lightning_parallel.tensor_parallel.plan.TensorParallelError: heads = 5 is not divisible by 2\n"
        "valid sizes: [1, 5]\n"
    )
    assert zoo.error_line(text) == "lightning_parallel.tensor_parallel.plan.TensorParallelError: heads = 5 is not divisible by 2"
    assert zoo.error_line("plain message\nsecond line") == "plain message"


def test_draws_are_seeded_by_where_they_are_made_and_a_split_shape_is_reported():
    """``zoo_random.KeyedDraws``: the same module drawing on the same shape draws the same numbers, whatever
    the generator's state before; a draw on another shape (a split activation) is reported, not compared."""
    noisy = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train()
    draws = KeyedDraws(noisy)
    with draws:
        draws.start_step(0, noisy)
        torch.manual_seed(1)
        first = noisy(torch.ones(2, 4))
        draws.start_step(0, noisy)
        torch.manual_seed(2)
        again = noisy(torch.ones(2, 4))
    assert torch.equal(first, again) and list(draws.summary()) == ["0|1|aten::bernoulli_.float|1"]
    draws.freeze({"draws": draws.summary()})
    assert draws.unmatched([{"draws": {"0|1|aten::bernoulli_.float|1": [2, 4]}}]) is None
    assert "on (1, 4) on rank 0, (2, 4) on one process" in draws.unmatched(
        [{"draws": {"0|1|aten::bernoulli_.float|1": [1, 4]}}])
