"""lightning-parallel: data, tensor and pipeline parallelism for unchanged Lightning modules.

    from lightning_parallel import ParallelStrategy
    trainer = Trainer(devices=8, strategy=ParallelStrategy(tensor_parallel=2, pipeline_parallel=2))

The strategy names ``lp_dp``, ``lp_tp``, ``lp_pp`` and ``lp_3d`` are registered with Lightning, so
``Trainer(strategy="lp_dp")`` works too, and ``--trainer.strategy=lp_dp`` under ``LightningCLI``; a
sharded checkpoint directory loads on one device (``MyModule.load_from_checkpoint(dir)``,
``Trainer(...).fit(ckpt_path=dir)``) as its consolidated file would. Installing the package adds
``lightning_parallel.pth`` to site-packages, which imports this package when Python starts
(``build_pth.py``), so a script need not import it. Importing it is cheap: the names below are
imported on first use, and Lightning (several seconds to import) is only touched once something
imports it; the strategy names are registered and the checkpoint reader extended at that moment
(or at once, if it already is).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from lightning_parallel.lightning_hooks import extend_lightning

_EXPORTS = {
    "DataParallelStrategy": "lightning_parallel.strategy",
    "ParallelStrategy": "lightning_parallel.strategy",
    "PipelineParallelStrategy": "lightning_parallel.strategy",
    "TensorParallelStrategy": "lightning_parallel.strategy",
    "MeshError": "lightning_parallel.mesh",
    "ParallelMesh": "lightning_parallel.mesh",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


class _RegisterAfterLightning(importlib.abc.MetaPathFinder):
    """Extends Lightning (``lightning_hooks.extend_lightning``) right after ``lightning.pytorch`` finishes importing.

    A post-import hook: it finds the module with the normal finders and wraps its loader's
    ``exec_module``, so the names exist before any ``Trainer`` can read the registry.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != "lightning.pytorch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def load_then_register(module) -> None:
            load(module)
            extend_lightning()

        spec.loader.exec_module = load_then_register
        return spec


if "lightning.pytorch" in sys.modules:
    extend_lightning()
elif not any(isinstance(f, _RegisterAfterLightning) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLightning())
