"""Expert parallelism on modules built the other ways users build them: the network made in
``configure_model`` (Lightning's advice for large models), and PEFT LoRA adapters on a frozen MoE base
(the experts placed, frozen, the adapters replicated). DP2 x EP2 against one device, step by step;
tolerances as in ``test_ep_training.py``.
"""

import lightning as L
import pytest
import torch

from lightning_parallel.strategy import ParallelStrategy
from tests.expert_parallel.test_ep_training import (
    LOSS_TOL,
    PARAM_TOL,
    STEPS,
    MoELM,
    Record,
    moe_config,
    tokens,
)
from tests.helpers.parity import assert_close_series, assert_params_close, fit_and_record, mean_over_ranks


class BuiltInConfigureModel(MoELM):
    """A Qwen3-MoE made in ``configure_model``, once (Lightning calls it again on a later Trainer call)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.sgd, self.model = False, None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(5)
            self.model = AutoModelForCausalLM.from_config(moe_config("qwen3_moe"))


class LoraOnMixtral(MoELM):
    """LoRA adapters on the attention of a frozen Mixtral (PEFT)."""

    def __init__(self) -> None:
        super().__init__("mixtral")
        from peft import LoraConfig, get_peft_model

        self.model = get_peft_model(self.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module_cls", [BuiltInConfigureModel, LoraOnMixtral], ids=["configure_model", "peft_lora"])
def test_dp2_ep2_matches_single_device(tmp_path, module_cls):
    L.seed_everything(0)
    module, data = module_cls(), tokens()
    expected = fit_and_record(module, data, 4, str(tmp_path / "one"), max_steps=STEPS, emulate_replicas=2)[0]
    out = tmp_path / "ep"
    got = fit_and_record(module, data, 2, str(out), devices=2, max_steps=STEPS, callbacks=[Record(str(out))],
                         strategy=ParallelStrategy(expert_parallel=2, start_method="fork"))
    assert_close_series(mean_over_ranks(got), expected["losses"], **LOSS_TOL)
    for rank in range(2):
        record = torch.load(out / f"whole{rank}.pt")
        assert record["local"], "no expert was placed"
        assert all(shape[0] == 2 for shape in record["local"].values())  # 2 of the 4 experts per rank
        assert_params_close(record["params"], expected["params"], **PARAM_TOL)
