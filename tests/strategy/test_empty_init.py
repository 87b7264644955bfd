"""A model built on the meta device materialises with the values eager construction gives it, bit for bit.

Construction is recorded (``empty_init.py``) and replayed (``materialize.py``); random calls draw from
the generator state eager construction had, so the comparison is exact equality, with the same seed
before both builds, and the generator continues as after an eager build.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_parallel.strategy.empty_init import empty_parameters, unreplayable
from lightning_parallel.strategy.materialize import (
    UnsplitModel,
    has_meta_parameters,
    materialize,
)

CPU = torch.device("cpu")
# constructor arguments tried in turn until one builds the layer
ARGUMENTS = [(4,), (4, 4), (4, 4, 3), (4, 4, 4), ()]


def _eager_and_meta(make, seed: int = 3):
    torch.manual_seed(seed)
    eager = make()
    after_eager = torch.rand(4)
    torch.manual_seed(seed)
    with empty_parameters():
        meta = make()
    after_meta = torch.rand(4)
    assert torch.equal(after_meta, after_eager), "the generator does not continue as after an eager build"
    assert has_meta_parameters(meta)
    materialize(meta, UnsplitModel.of(meta), 0, 1, CPU, seed=0)
    return eager, meta


def _assert_same(eager: nn.Module, meta: nn.Module) -> None:
    eager_params = dict(eager.named_parameters())
    assert eager_params.keys() == dict(meta.named_parameters()).keys()
    for name, value in meta.named_parameters():
        assert torch.equal(value, eager_params[name]), name


def _parameterised_torch_layers():
    for name in sorted(dir(nn)):
        cls = getattr(nn, name)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)) or name.startswith("Lazy"):
            continue  # lazy layers take their shapes at the first forward, on any device
        for args in ARGUMENTS:
            try:
                layer = cls(*args)
            except Exception:  # noqa: BLE001 - another constructor signature
                continue
            if any(True for _ in layer.parameters()):
                yield pytest.param(cls, args, id=name)
            break


@pytest.mark.parametrize("cls, args", list(_parameterised_torch_layers()))
def test_every_parameterised_torch_layer_gets_its_eager_values(cls, args):
    _assert_same(*_eager_and_meta(lambda: cls(*args)))


class NanoGPTStyle(nn.Module):
    """Initialisation in a loop of the parent's ``__init__`` and values given to ``nn.Parameter``."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8, padding_idx=0)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(8, 2, 16, batch_first=True) for _ in range(2)])
        self.pos = nn.Parameter(torch.randn(1, 4, 8) * 0.02)
        self.scale = nn.Parameter(torch.ones(8) * 3)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():
            if name.endswith("linear2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * 2))
        with torch.no_grad():
            self.blocks[0].norm1.weight.mul_(0.5)


def test_loops_in_the_parents_init_tied_weights_and_given_values_get_their_eager_values():
    eager, meta = _eager_and_meta(NanoGPTStyle)
    _assert_same(eager, meta)
    assert meta.head.weight is meta.wte.weight
    assert torch.equal(meta.wte.weight[0], torch.zeros(8))  # padding_idx row, set through a view


def test_hugging_face_init_weights_and_peft_lora_get_their_eager_values():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)

    def lora():
        base = transformers.AutoModelForCausalLM.from_config(config)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    eager, meta = _eager_and_meta(lora)
    _assert_same(eager, meta)
    assert any("lora_A" in n and p.abs().sum() > 0 for n, p in meta.named_parameters())


def test_what_cannot_be_replayed_is_named_before_anything_is_materialised():
    class CopiesAMetaTensor(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.unset = nn.Parameter(torch.empty(3))
            with torch.no_grad():
                self.b.weight.copy_(torch.empty(4, 4, device="meta"))

    with empty_parameters():
        model = CopiesAMetaTensor()
    found = unreplayable(model)
    assert set(found) == {"b.weight", "unset"}
    assert "another meta tensor" in found["b.weight"] and found["unset"] == "nothing sets its value"


class ReadsOtherParameters(nn.Module):
    """Construction that reads parameter values: one weight drawn with another's std, a copy of another
    parameter, a bias from arithmetic on one, a buffer copied from one, a weight replaced whole."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        nn.init.normal_(self.b.weight, std=self.a.weight.std().item())
        self.register_buffer("row", torch.zeros(8))
        with torch.no_grad():
            self.c.weight.copy_(self.a.weight)
            self.b.bias.copy_(self.a.bias * 2 + self.c.bias.mean())
            self.row.copy_(self.b.weight[0])
        self.c.bias.data = torch.ones(8) * self.a.weight.abs().max()


def test_construction_that_reads_parameter_values_gets_its_eager_values():
    eager, meta = _eager_and_meta(ReadsOtherParameters)
    _assert_same(eager, meta)
    assert torch.equal(meta.row, eager.row)


def test_a_read_of_a_value_not_known_before_materialisation_is_refused_at_construction():
    from lightning_parallel.errors import MetaConstructionError

    class ReadsADrawOnMeta(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8, device="meta")  # drawn only when materialised, with the module's seed
            self.b = nn.Linear(8, 8)
            nn.init.normal_(self.b.weight, std=self.a.weight.std().item())

    with empty_parameters(), pytest.raises(MetaConstructionError) as refused:
        ReadsADrawOnMeta()
    message = str(refused.value)
    assert "std() in __init__" in message and "made on the meta device" in message
    assert "empty_init=False" in message and "init=host" in message


def test_a_deep_copy_keeps_what_construction_recorded():
    import copy

    torch.manual_seed(0)
    eager = NanoGPTStyle()
    torch.manual_seed(0)
    with empty_parameters():
        meta = NanoGPTStyle()
    copied = copy.deepcopy(meta)
    materialize(copied, UnsplitModel.of(copied), 0, 1, CPU, seed=0)
    _assert_same(eager, copied)


def test_reset_parameters_after_construction_gets_the_values_it_gives_after_fabrics_empty_init():
    """``reset_recorded`` (what ``FabricParallelStrategy(reset_at_setup=True)`` runs at setup): each module's
    ``reset_parameters()``, overridden after construction as LitGPT's ``pretrain`` does, is recorded and
    replayed; construction drew nothing, as under Fabric's empty init on one device."""
    from lightning.fabric.utilities.init import _EmptyInit

    from lightning_parallel.strategy.empty_init import reset_recorded

    def make() -> nn.Module:
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 10))
        for layer in (model[0], model[1], model[3]):
            layer.reset_parameters = lambda layer=layer: nn.init.normal_(layer.weight, std=0.5)
        return model

    torch.manual_seed(3)
    with _EmptyInit(enabled=True):
        eager = make()
    for module in eager.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
    after_eager = torch.rand(4)
    torch.manual_seed(3)
    with empty_parameters(draws=False):
        meta = make()
    assert reset_recorded(meta)
    assert torch.equal(torch.rand(4), after_eager), "the generator does not continue as after the eager reset"
    materialize(meta, UnsplitModel.of(meta), 0, 1, CPU, seed=0)
    for name in ("0.weight", "1.weight", "3.weight"):  # the biases keep construction's (undrawn, replayed) values
        assert torch.equal(dict(meta.named_parameters())[name], dict(eager.named_parameters())[name]), name


def test_init_functions_called_after_construction_inside_recording_get_their_eager_values():
    """``model.apply(init)`` after the build: inside ``recording(model)`` it is recorded like construction (and
    inside the build's own recording, nothing is recorded twice)."""
    from lightning_parallel.strategy.empty_init import recording

    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))

    def built_inside() -> nn.Module:
        model = make()
        with recording(model):
            model.apply(init)
        return model

    torch.manual_seed(3)
    eager = make().apply(init)
    after_eager = torch.rand(4)
    torch.manual_seed(3)
    with empty_parameters():
        meta = make()
    with recording(meta):
        meta.apply(init)
    assert torch.equal(torch.rand(4), after_eager), "the generator does not continue as after the eager init"
    materialize(meta, UnsplitModel.of(meta), 0, 1, CPU, seed=0)
    _assert_same(eager, meta)
    _assert_same(*_eager_and_meta(built_inside))
