"""The Hydra application: ``lp-train``, ``lp-plan`` and their config checks, overrides and run summaries.

The only part of the package that imports Hydra; everything below it takes plain arguments.
"""
