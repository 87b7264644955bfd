"""Evaluation that generates: ``validation_step`` / ``test_step`` / ``predict_step`` calling
``self.model.generate(...)`` (greedy, and sampled under a seed; KV cache on; left-padded prompts, so the
padding mask and the cache's length decide positions and masks).

Under tensor parallelism every rank runs the whole decoding loop on its shards. Under pipeline
parallelism every rank runs the step and each forward passes through the stages, which keep their own
layers' cache (``pipeline/relay.py``); the logits come from the last stage. Under context parallelism the
step runs unsplit on every CP rank; under expert parallelism each rank generates from its own prompts,
its tokens routed to the experts of every rank. Each gives one device's tokens on every rank.

Tokens are compared exactly. The logits differ from one device's by float32 reassociation only (~1e-6
relative; none at all under pipelining or unsplit CP, which run one device's operations); greedy picks
the same token unless two logits are that close, and a seeded sample draws the same uniform numbers, so
it differs only if one falls within ~1e-6 of a boundary between two tokens' cumulative probabilities:
neither happens on these models' few dozen tokens.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_parallel import ParallelStrategy
from lightning_parallel.models.gpt import GPT
from lightning_parallel.pipeline.errors import PipelineIncompatibleModel
from lightning_parallel.pipeline.generation import generating_step, generating_steps, refuse_generating_training
from tests.helpers.parity import TensorDataset
from tests.helpers.pretrained import save_tiny_llama

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW = 128, 6, 5


class Generates(L.LightningModule):
    """A fine-tuning module that measures itself by generating from prompts in every evaluation step."""

    def __init__(self, folder: str, out: str = ""):
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        self.out = out
        self.tokens: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def _generate(self, batch):
        mask = batch.ne(0)  # left padding: the cache's length and the padding mask give positions and masks
        greedy = self.model.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, use_cache=True,
                                     pad_token_id=0)
        torch.manual_seed(7)
        sampled = self.model.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0,
                                      use_cache=True, pad_token_id=0)
        return torch.cat([greedy, sampled], dim=1)

    def validation_step(self, batch, batch_idx):
        self.tokens.append(self._generate(batch))

    def test_step(self, batch, batch_idx):
        self.tokens.append(self._generate(batch))

    def predict_step(self, batch, batch_idx):
        self.tokens.append(self._generate(batch))
        return self.tokens[-1]

    def _save(self):
        torch.save(torch.cat(self.tokens), os.path.join(self.out, f"rank{self.global_rank}.pt"))

    def on_validation_epoch_end(self):
        self._save()

    def on_predict_epoch_end(self):
        self._save()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("generation") / "llama", vocab=VOCAB)


def _prompts() -> DataLoader:
    prompts = torch.randint(1, VOCAB, (4, PROMPT), generator=torch.Generator().manual_seed(3))
    prompts[1, :2] = prompts[2, :1] = 0  # left-padded prompts
    return DataLoader(TensorDataset(prompts), batch_size=2)


def _evaluate(folder: str, out, devices: int = 1, strategy="auto", entry: str = "validate") -> list[torch.Tensor]:
    """Every rank's tokens from ``trainer.<entry>`` (validate or predict) over ``_prompts()``."""
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    os.makedirs(out, exist_ok=True)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    getattr(trainer, entry)(Generates(folder, str(out)), _prompts())
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(devices)]


@pytest.fixture(scope="module")
def expected(folder, tmp_path_factory) -> torch.Tensor:
    tokens = _evaluate(folder, tmp_path_factory.mktemp("one"))[0]
    assert tokens.shape == (4, 2 * (PROMPT + NEW))
    return tokens


def _strategy(**sizes) -> ParallelStrategy:
    return ParallelStrategy(start_method="fork", timeout=60, **sizes)


@pytest.mark.timeout(180)
def test_generate_in_validation_step_at_tp2_gives_one_devices_tokens(folder, expected, tmp_path):
    for tokens in _evaluate(folder, tmp_path, 2, _strategy(tensor_parallel=2)):
        assert torch.equal(tokens, expected)


@pytest.mark.timeout(180)
def test_generate_in_validation_and_predict_step_at_pp2_gives_one_devices_tokens(folder, expected, tmp_path):
    for entry in ("validate", "predict"):
        for tokens in _evaluate(folder, tmp_path / entry, 2, _strategy(pipeline_parallel=2), entry):
            assert torch.equal(tokens, expected), entry


@pytest.mark.timeout(180)
def test_generate_in_validation_step_at_pp2_tp2_gives_one_devices_tokens(folder, expected, tmp_path):
    for tokens in _evaluate(folder, tmp_path, 4, _strategy(pipeline_parallel=2, tensor_parallel=2)):
        assert torch.equal(tokens, expected)


@pytest.mark.timeout(180)
def test_generate_in_validation_step_at_cp2_gives_one_devices_tokens(folder, expected, tmp_path):
    for tokens in _evaluate(folder, tmp_path, 2, _strategy(context_parallel=2)):
        assert torch.equal(tokens, expected)


@pytest.mark.timeout(180)
def test_generate_in_validation_step_at_ep2_gives_one_devices_tokens_for_each_ranks_prompts(tmp_path):
    """A tiny Mixtral (4 experts, 2 a token) at EP2: each rank reads every other prompt (a data-parallel
    replica), its tokens dispatched to both ranks' experts in every decoding step."""
    from tests.expert_parallel.test_ep_training import moe_config

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = moe_config("mixtral")
    config.vocab_size = VOCAB
    folder = str(tmp_path / "moe")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    one = Generates(folder).eval()
    prompts = next(iter(DataLoader(_prompts().dataset, batch_size=4)))
    got = _evaluate(folder, tmp_path / "ep2", 2, _strategy(expert_parallel=2))
    for rank, tokens in enumerate(got):
        assert torch.equal(tokens, one._generate(prompts[rank::2]))  # DistributedSampler: every other sample


class TrainsOnGenerated(Generates):
    def training_step(self, batch, batch_idx):
        return self.model(input_ids=self._generate(batch), labels=None).logits.mean()


def test_every_evaluation_step_that_generates_is_found_and_a_training_step_that_does_is_refused(folder):
    transformers.logging.set_verbosity_error()
    module = Generates(folder)
    for step in ("validation_step", "test_step", "predict_step"):
        assert generating_step(module, [step]) == step
    assert generating_step(module, ["training_step"]) is None
    assert generating_steps(module) == {"validation_step", "test_step", "predict_step"}
    refuse_generating_training(module)  # evaluation steps that generate run relayed
    with pytest.raises(PipelineIncompatibleModel, match="training_step calls generate"):
        refuse_generating_training(TrainsOnGenerated(folder))


class NanoGenerates(GPT):
    """The project's GPT with nanoGPT's decoding loop: the whole window through ``self(idx)`` for every new
    token (no cache), greedy and sampled."""

    def __init__(self, out: str = ""):
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, block_size=32, n_layer=4, n_head=2, n_embd=32)
        self.out = out

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new: int, sample: bool) -> torch.Tensor:
        for _ in range(new):
            probs = torch.softmax(self(idx)[:, -1], dim=-1)
            nxt = torch.multinomial(probs, 1) if sample else probs.argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    def validation_step(self, batch, batch_idx):
        torch.manual_seed(7)
        tokens = torch.cat([self.generate(batch, NEW, False), self.generate(batch, NEW, True)], dim=1)
        torch.save(tokens, os.path.join(self.out, f"rank{self.global_rank}-{batch_idx}.pt"))

    def on_validation_epoch_end(self):
        pass  # GPT's logs a validation loss this step does not compute


@pytest.mark.timeout(180)
def test_nanogpt_style_generate_in_validation_step_at_pp2_gives_one_devices_tokens(tmp_path):
    for devices, strategy in ((1, "auto"), (2, _strategy(pipeline_parallel=2))):
        out = tmp_path / str(devices)
        os.makedirs(out)
        L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_progress_bar=False,
                  enable_model_summary=False).validate(NanoGenerates(str(out)), _prompts())
    for batch in range(2):
        expected = torch.load(tmp_path / "1" / f"rank0-{batch}.pt")
        for rank in range(2):
            assert torch.equal(torch.load(tmp_path / "2" / f"rank{rank}-{batch}.pt"), expected)


def test_a_decoding_loop_written_in_the_step_is_refused_at_the_pipeline_trace_with_the_way_that_works():
    from lightning_parallel.pipeline.order import trace_run_order

    module = NanoGenerates()
    prompts = next(iter(_prompts()))

    def inline_loop():  # the loop of generate(), not in a method of that name: not found from the step's code
        idx = prompts
        for _ in range(2):
            idx = torch.cat([idx, module(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx.float().sum()

    with pytest.raises(PipelineIncompatibleModel, match="more than once: a decoding loop .* method named generate"):
        trace_run_order(module, "transformer.h", inline_loop)


def test_a_decoding_loop_in_an_untraced_pipelined_step_is_refused_where_its_second_forward_reaches_a_stage():
    """A validation during fit is not traced: on the last stage the loop's second forward, on a longer
    sequence, would start again from the first forward's received state; it is refused there instead. A
    second forward on an input of the same shape keeps working as before."""
    from lightning_parallel.pipeline.stage_modules import BlockDispatch, StageRuntime

    runtime = StageRuntime()
    runtime.begin(range(2, 4), False, torch.randn(2, PROMPT, 8), 0)
    first_block = BlockDispatch(runtime, 2)
    for _ in range(2):
        assert torch.equal(first_block(lambda h: 2 * h, torch.zeros(2, PROMPT, 8)), 2 * runtime.received)
    with pytest.raises(PipelineIncompatibleModel, match="ran twice in one step.*method named generate"):
        first_block(lambda h: 2 * h, torch.zeros(2, PROMPT + 1, 8))
