"""The split checked against the whole model at setup (``checks/verify_split.py``).

A tensor-parallel split that runs but computes other values is refused on every rank before the
first step, naming the module and the value (output or parameter gradient) that differ; four
different ways to be wrong, among them one whose loss at initialisation moves by less than 1e-4 and
one whose forward is exact (only a gradient differs). A correct split is accepted, and training is
bit for bit what it is without the check (the check runs on copies, under forked random generators).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_parallel.checks.float64 import KeepFloat64, grouped_mm
from lightning_parallel.checks.split_compare import RTOL, compare
from lightning_parallel.checks.split_units import choose_units
from lightning_parallel.models.gpt import GPT
from lightning_parallel.strategy import ParallelStrategy
from lightning_parallel.tensor_parallel.plan import parse_plan
from lightning_parallel.tensor_parallel.resolve import resolve_plan
from tests.helpers.refusals import RecordingStrategy

VOCAB, SEQ, D, HEADS = 64, 8, 32, 4


class Attention(nn.Module):
    """Causal self-attention, written correctly or with one ``flaw`` that only matters once its heads
    are split over TP ranks:

    - ``heads``: reshapes with a hard-coded head count, ``view(B, T, 4, -1)``: split, each rank
      regroups its 2 heads of 8 features into 4 heads of 4;
    - ``interleaved``: one fused q|k|v Linear laid out head by head (``[q0 k0 v0 q1 k1 v1 ...]``),
      given a plan that splits it as three blocks ``[q; k; v]``;
    - ``gain``: a bare parameter scaling q, left whole: the forward is exact, but each rank's
      gradient of it covers only its own heads.
    """

    def __init__(self, flaw: str | None) -> None:
        super().__init__()
        self.flaw = flaw
        if flaw == "interleaved":
            self.qkv = nn.Linear(D, 3 * D)
        else:
            self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.o = nn.Linear(D, D)
        if flaw == "gain":
            self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x):
        B, T, _ = x.shape
        if self.flaw == "interleaved":
            q, k, v = self.qkv(x).view(B, T, -1, 3, D // HEADS).unbind(3)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
            if self.flaw == "gain":
                q = q * self.gain
            shape = (B, T, HEADS, -1) if self.flaw == "heads" else (B, T, -1, D // HEADS)
            q, k, v = (t.reshape(shape) for t in (q, k, v))
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """``norm``: normalises the hidden features, which the colwise ``fc`` splits over the ranks."""

    def __init__(self, flaw: str | None) -> None:
        super().__init__()
        self.fc, self.proj, self.flaw = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), flaw

    def forward(self, x):
        h = F.gelu(self.fc(x))
        if self.flaw == "norm":
            h = F.rms_norm(h, (h.shape[-1],))
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, flaw: str | None) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(flaw), nn.LayerNorm(D), MLP(flaw)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(L.LightningModule):
    def __init__(self, flaw: str | None = None, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(flaw) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation (small weights: attention starts near uniform), replayable per module."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(self.norm(h)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def plan(flaw: str | None) -> dict:
    attention = ({"blocks.*.attn.qkv": {"style": "colwise", "fused": 3}} if flaw == "interleaved" else
                 {f"blocks.*.attn.{n}": "colwise" for n in "qkv"})
    return {**attention, "blocks.*.attn.o": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise",
            "embed": "vocab", "head": {"style": "colwise", "gather_output": True}}


class Outcome(Callback):
    """Leaves, per rank, the check's report after the first step (the check runs in it, or at setup under
    pipeline parallelism) and ``step<rank>`` at each optimizer step."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        (self.out / f"step{trainer.global_rank}").touch()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            report = getattr(trainer.strategy, "split_verification", None)
            torch.save(vars(report) if report is not None else None, self.out / f"report{trainer.global_rank}.pt")
        with open(self.out / f"losses{trainer.global_rank}", "a") as f:
            f.write(f"{float(outputs['loss'])!r}\n")


def data() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)


def run(out: Path, flaw: str | None = None, tp: int = 2, steps: int = 2, on_meta: bool = False, pp: int = 1,
        **options):
    """Fit ``TinyLM(flaw)`` with its plan at TP=``tp`` (1: one process) x PP=``pp``; the setup errors, if any."""
    L.seed_everything(0)
    strategy = RecordingStrategy(out, wait=True, tensor_parallel=tp, pipeline_parallel=pp, start_method="fork",
                                 timeout=timedelta(seconds=30), tp_plan=plan(flaw), **options) if tp > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=tp * pp, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Outcome(out)], use_distributed_sampler=False)  # dp = 1: every rank reads every batch
    with trainer.init_module(empty_init=on_meta):
        model = TinyLM(flaw)
    try:
        trainer.fit(model, data())
    except Exception:
        if not list(out.glob("rank*.txt")):  # not a refusal at setup
            raise
    return [(out / f"rank{r}.txt").read_text() for r in range(tp * pp) if (out / f"rank{r}.txt").exists()]


def first_losses(out: Path) -> list[float]:
    return [float(x) for x in (out / "losses0").read_text().split()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flaw, where, what", [
    ("heads", "blocks.0.attn (Attention)", "its output"),
    ("norm", "blocks.0.mlp (MLP)", "its output"),
    ("interleaved", "blocks.0.attn (Attention)", "its output"),
    ("gain", "blocks.0.attn (Attention)", "the gradient of gain"),
])
def test_split_that_computes_other_values_is_refused_on_every_rank_naming_module_and_value(tmp_path, flaw, where,
                                                                                           what):
    messages = run(tmp_path, flaw)
    assert len(messages) == 2 and messages[0] == messages[1], messages
    assert not list(tmp_path.glob("step*")), "an optimizer stepped before the refusal"
    assert "the split model computes other values than the whole one" in messages[0]
    assert f"{where}: {what} differs from the whole module's" in messages[0]
    assert f"leaves {where.split(' ')[0].replace('.0.', '.*.')} whole" in messages[0]
    assert "verify_split=False" in messages[0]


@pytest.mark.timeout(120)
def test_regrouped_heads_move_the_first_loss_by_less_than_1e4(tmp_path):
    """Why a loss at initialisation cannot show it: trained unchecked, the regrouped attention's first loss
    is within 1e-4 of one process's (the earlier loss check passed it), though it trains wrong."""
    (tmp_path / "one").mkdir(), (tmp_path / "split").mkdir()
    run(tmp_path / "one", "heads", tp=1, steps=1)
    assert run(tmp_path / "split", "heads", steps=1, verify_split=False) == []
    one, split = first_losses(tmp_path / "one")[0], first_losses(tmp_path / "split")[0]
    assert 0 < abs(one - split) < 1e-4


@pytest.mark.timeout(120)
def test_a_wrong_split_built_on_the_meta_device_is_refused(tmp_path):
    """``trainer.init_module(empty_init=True)`` (what lp-train does): the whole copies are taken on the meta
    device and get their values from the materialised shards."""
    messages = run(tmp_path, "heads", on_meta=True)
    assert len(messages) == 2 and "blocks.0.attn (Attention): its output differs" in messages[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("on_meta", [False, True], ids=["built", "meta"])
def test_under_pipeline_parallelism_each_stage_checks_the_units_it_holds(tmp_path, on_meta):
    """TP=2 x PP=2: the first stage holds the embedding and the first block, the last stage the head; the
    regrouped heads of the first block are refused on all four ranks."""
    (tmp_path / "right").mkdir(), (tmp_path / "wrong").mkdir()
    assert run(tmp_path / "right", pp=2, on_meta=on_meta) == []
    reports = [torch.load(tmp_path / "right" / f"report{r}.pt") for r in range(4)]
    assert [r["units"] for r in reports] == [["embed", "blocks.0"]] * 2 + [["head"]] * 2
    messages = run(tmp_path / "wrong", "heads", pp=2, on_meta=on_meta)
    assert len(messages) == 4 and len(set(messages)) == 1 and "ranks 0, 1, blocks.0.attn (Attention)" in messages[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_meta", [False, True], ids=["built", "meta"])
def test_correct_split_is_accepted_one_block_kind_and_training_is_unchanged(tmp_path, on_meta):
    (tmp_path / "on").mkdir(), (tmp_path / "off").mkdir()
    assert run(tmp_path / "on", on_meta=on_meta, steps=3) == []
    report = torch.load(tmp_path / "on" / "report0.pt")
    assert report["units"] == ["embed", "blocks.0", "head"] and not report["skipped"]
    assert 0 < report["closest"] < RTOL
    assert run(tmp_path / "off", on_meta=on_meta, steps=3, verify_split=False) == []
    assert first_losses(tmp_path / "on") == first_losses(tmp_path / "off")


@pytest.mark.timeout(120)
def test_under_sequence_parallelism_units_are_compared_on_the_whole_sequence(tmp_path):
    """The default GPT with sequence parallelism: each rank holds part of the sequence between the split
    layers, the whole copies run all of it, and the split is accepted within rounding."""
    L.seed_everything(0)
    strategy = ParallelStrategy(tensor_parallel=2, sequence_parallel=True, start_method="fork",
                                timeout=timedelta(seconds=30))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Outcome(tmp_path)], use_distributed_sampler=False)
    trainer.fit(GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=D), data())
    report = torch.load(tmp_path / "report0.pt")
    assert report["units"] == ["transformer.wte", "transformer.h.0", "lm_head"] and 0 < report["closest"] < RTOL


def test_one_unit_per_kind_whatever_the_depth():
    """Blocks of one kind are checked once: the check costs the same for 2 layers and for 12."""
    for layers in (2, 12):
        model = TinyLM(layers=layers)
        units = choose_units(model, resolve_plan(model, parse_plan(plan(None)), 2, False))
        assert [u.name for u in units] == ["embed", "blocks.0", "head"]
        assert all(p.is_meta for u in units for p in u.whole.parameters())  # copies hold no values


def test_blocks_whose_settings_differ_are_different_kinds():
    model = TinyLM(layers=3)
    model.blocks[2].attn.flaw = "heads"  # a plain setting that changes what the block computes
    units = choose_units(model, resolve_plan(model, parse_plan(plan(None)), 2, False))
    assert [u.name for u in units] == ["embed", "blocks.0", "blocks.2", "head"]


def test_float64_is_kept_where_model_code_casts_to_float32():
    """Hugging Face's RMSNorm computes in float32 and softmaxes take dtype=float32; in the check both stay float64."""
    x = torch.randn(4, 8, dtype=torch.float64)
    with KeepFloat64():
        assert x.to(torch.float32).dtype == torch.float64
        assert x.float().dtype == torch.float64 and x.type_as(torch.ones(1)).dtype == torch.float64
        assert F.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert x.to("cpu", torch.float32).dtype == torch.float64
        assert torch.ones(2).to(torch.float16).dtype == torch.float16  # only float64 tensors are kept


def test_grouped_matrix_product_in_float64():
    a, b = torch.randn(7, 4, dtype=torch.float64), torch.randn(3, 4, 5, dtype=torch.float64)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # an empty group, and a last row in no group
    out = grouped_mm(a, b, offs=offs)
    assert torch.equal(out[:2], a[:2] @ b[0]) and torch.equal(out[2:6], a[2:6] @ b[2])
    assert torch.equal(out[6:], torch.zeros(1, 5, dtype=torch.float64))


def test_rounding_passes_and_a_relative_difference_of_1e9_does_not():
    want = torch.randn(1000, dtype=torch.float64)
    assert compare("x", want * (1 + 1e-14), want, 1.0).rounding
    assert not compare("x", want * (1 + 1e-9), want, 1.0).rounding
    # a gradient that is zero by construction is rounding noise on both sides, compared at its module's scale
    assert compare("bias", torch.full((4,), 1e-17), torch.zeros(4), group_scale=1e-2).rounding
    assert not compare("x", torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), 1.0).rounding
