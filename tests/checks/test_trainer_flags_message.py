"""The Trainer-feature refusals of a split model name the layout that splits it (experts included)."""

from types import SimpleNamespace

import pytest
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.plugins import AsyncCheckpointIO

from lightning_parallel.checks.trainer_flags import refuse_split_model_flags
from lightning_parallel.errors import LaunchError
from lightning_parallel.options import ParallelOptions

SWA = SimpleNamespace(callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)], checkpoint_callbacks=[])
PLAIN = SimpleNamespace(callbacks=[], checkpoint_callbacks=[])


@pytest.mark.parametrize("options, named", [
    (ParallelOptions(tensor_parallel=2), "tensor_parallel=2, pipeline_parallel=1"),
    (ParallelOptions(expert_parallel=2, data_parallel=2), "pipeline_parallel=1, expert_parallel=2"),
    (ParallelOptions(zero_stage=3), "zero_stage=3"),
])
def test_refusal_names_the_layout(options, named):
    with pytest.raises(LaunchError, match=rf"AsyncCheckpointIO\(_Custom.*not supported with .*{named}"):
        refuse_split_model_flags(PLAIN, options, None, AsyncCheckpointIO(_Custom()))


class _Custom(TorchCheckpointIO):
    """A writer of the user's: a split model writes its shards itself, so it would be bypassed."""


def test_async_checkpoint_io_over_the_default_writer_is_accepted():
    for plugin in (AsyncCheckpointIO(), AsyncCheckpointIO(TorchCheckpointIO())):
        refuse_split_model_flags(PLAIN, ParallelOptions(tensor_parallel=2, pipeline_parallel=2), None, plugin)


def test_stochastic_weight_averaging_is_refused_only_under_pipeline_parallelism():
    for options in (ParallelOptions(tensor_parallel=2), ParallelOptions(zero_stage=3)):
        refuse_split_model_flags(SWA, options, None, TorchCheckpointIO())  # each rank averages its part
    with pytest.raises(LaunchError, match=r"StochasticWeightAveraging.*not supported with .*pipeline_parallel=2"):
        refuse_split_model_flags(SWA, ParallelOptions(pipeline_parallel=2, tensor_parallel=2), None,
                                 TorchCheckpointIO())


def test_weight_averaging_with_checkpoints_is_not_refused_on_a_split_model():
    # each rank's part of the average and of the module is written split like the model (checkpoint/io.py)
    ema, swa, checkpoint = EMAWeightAveraging(), StochasticWeightAveraging(swa_lrs=1e-2), ModelCheckpoint()
    for options, averaging in [(ParallelOptions(tensor_parallel=2), ema), (ParallelOptions(zero_stage=3), ema),
                               (ParallelOptions(pipeline_parallel=2), ema), (ParallelOptions(tensor_parallel=2), swa),
                               (ParallelOptions(zero_stage=3), swa)]:
        refuse_split_model_flags(SimpleNamespace(callbacks=[averaging, checkpoint], checkpoint_callbacks=[checkpoint]),
                                 options, None, TorchCheckpointIO())


def test_sync_batchnorm_is_refused_only_where_parameters_are_sharded():
    refuse_split_model_flags(PLAIN, ParallelOptions(tensor_parallel=2), object(), TorchCheckpointIO())
    with pytest.raises(LaunchError, match=r"sync_batchnorm=True\) is not supported with .*zero_stage=2"):
        refuse_split_model_flags(PLAIN, ParallelOptions(zero_stage=2), object(), TorchCheckpointIO())
