"""Packaging step: install ``lightning_parallel.pth`` beside the package.

Lightning resolves a strategy name (``Trainer(strategy="lp_dp")``, ``--trainer.strategy=lp_dp``
under ``LightningCLI``) from its registry, which only knows our names once something imported
``lightning_parallel``; Lightning has no entry-point group for strategies. Python runs the
``import`` lines of every ``.pth`` file in site-packages at start-up, so this one line imports the
package (cheap: it imports nothing heavy and registers the names the moment ``lightning.pytorch``
is imported, see ``lightning_parallel/__init__.py``) in every interpreter of the environment.
Used for wheels and for editable installs (``pip install -e .``) alike, from ``pyproject.toml``.
"""

from __future__ import annotations

from pathlib import Path

from setuptools.command.build_py import build_py

PTH_NAME = "lightning_parallel.pth"
PTH_LINE = "import lightning_parallel\n"


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the ``.pth`` file where the wheel's top level is assembled."""

    def run(self) -> None:
        super().run()
        # an editable wheel is assembled from the install folder; a regular one from build_lib
        folder = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / PTH_NAME).write_text(PTH_LINE)
