"""Silence the warnings, tips and banners that `lp-train` prints and that need no action from the user,
and the messages a model prints while it is built for the launch checks only (``quiet_model_loading``).

Each entry below is a message Lightning, torch or torchmetrics prints for something this package
does on purpose; everything else still reaches the user. Installed in every rank's process, so a
message that would repeat once per rank is gone everywhere, not only on rank 0.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout

# (message regex, why it is harmless here)
HARMLESS_WARNINGS = (
    # SLURMEnvironment sees `srun` on PATH; lp-train runs locally unless launched by srun
    (r"The `srun` command is available on your system but is not used", "local launch on a SLURM login node"),
    # the run's logger is chosen in conf/trainer (CSV), so Lightning's default-logger notice does not apply
    (r"Starting from v1\.9\.0, `tensorboardX` has been removed", "the logger is configured explicitly"),
    # Lightning's own pytree helpers still use LeafSpec; once per rank with torch >= 2.10
    (r".*LeafSpec.*is deprecated", "inside Lightning, not in user code"),
    # under pipeline parallelism only the last stage updates metrics; the others replay its values
    (r"The ``compute`` method of metric .* was called before the ``update`` method", "pipeline stages"),
    # resuming into a new Hydra run folder; the run summary says where checkpoints now go
    (r"The dirpath has changed from", "resume into a new run folder"),
)

# Lightning's rank-zero notices logged at INFO level: advertisements, and the summary callback that
# lp-train configures itself (conf/train.yaml)
_TIPS = ("💡 Tip:", "Trainer already configured with model summary callbacks")
# the accelerator banner of every Trainer: the run summary names the devices already
_BANNER = ("GPU available:", "TPU available:")


class _DropTips(logging.Filter):
    def __init__(self, banner: bool) -> None:
        super().__init__()
        self.dropped = _TIPS if banner else _TIPS + _BANNER

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.dropped)


def quiet_known_warnings(banner: bool = False) -> None:
    """Install the filters (idempotent); ``banner`` keeps Lightning's "GPU available" lines."""
    for pattern, _why in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    # logger filters see only records logged at that logger: these two are where rank_zero_info logs
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _DropTips)]:
            logger.removeFilter(old)
        logger.addFilter(_DropTips(banner))
    # per-rank notices ("Initializing distributed: GLOBAL_RANK: 3"): rank 0's is enough
    if int(os.environ.get("LOCAL_RANK", 0)) > 0 or int(os.environ.get("NODE_RANK", 0)) > 0:
        logging.getLogger("lightning.fabric.utilities.distributed").setLevel(logging.WARNING)
        _quiet_transformers()


def _quiet_transformers() -> None:
    """Hugging Face's loading messages (the "Loading weights" bar, the load report) on a rank that is not
    the first: every rank loads the same files, rank 0 tells. The meta build of the launch check has
    imported transformers where the model uses it, so its own logger set-up does not undo this."""
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()


@contextmanager
def quiet_model_loading() -> Iterator[None]:
    """Silence what building a model prints (a ``from_pretrained``'s progress bar and load report, the
    module's own prints) while the launch checks build it on the meta device, which reads no weights:
    the run that loads them prints them once. Shown after all if the build fails."""
    out, err = io.StringIO(), io.StringIO()
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            yield
    except BaseException:
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())
        raise
    finally:
        logging.disable(disabled)


def quiet_resume_warning(datamodule) -> None:
    """Drop Lightning's "your dataloader is not resumable" when the data module restores its position.

    Lightning asks the dataloader for ``state_dict``; a data module that saves and restores the
    epoch position itself (``TextDataModule``) resumes exactly, so the warning would be wrong.
    For any other data module it stays: resuming mid-epoch there restarts the epoch.
    """
    from lightning.pytorch import LightningDataModule

    if type(datamodule).load_state_dict is not LightningDataModule.load_state_dict:
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
