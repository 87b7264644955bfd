"""Which pipeline rank holds which (virtual) stage: the one place that decides it.

With ``P`` ranks and ``V`` stages per rank (``P * V`` stages in all):

* ``"loop"``: stage ``s`` on rank ``s % P``, so rank ``r`` holds ``r, r + P, ..., r + (V - 1) P``
  (Narayanan et al. 2021, arXiv 2104.04473 §2.2; what gpipe, 1f1b, interleaved_1f1b and zb_h1 use).
* ``"v"``: two stages per rank in a V, rank ``r`` holding stages ``r`` and ``2P - 1 - r`` (ZB-V,
  Qi et al. 2023, arXiv 2401.10241 §4; DualPipeV). The data goes down the ranks and back up, so the first and
  the last stage (embedding and head, often tied) share rank 0, and each rank does equal work
  per micro-batch in its two chunks.

Which schedule runs on which placement is the schedule's entry in ``registry``.
"""

from __future__ import annotations

from lightning_parallel.pipeline.errors import PipelineConfigError

PLACEMENTS = ("loop", "v")


def check(placement: str, ranks: int, num_stages: int) -> None:
    """Refuse a placement that does not exist or cannot hold ``num_stages`` stages on ``ranks`` ranks."""
    if placement not in PLACEMENTS:
        raise PipelineConfigError(f"unknown stage placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if num_stages % ranks:
        raise PipelineConfigError(f"{num_stages} stages cannot be spread evenly over {ranks} pipeline ranks")
    if placement == "v" and num_stages != 2 * ranks:
        raise PipelineConfigError(
            f"the V-shaped placement holds exactly 2 stages per rank, got {num_stages} stages on {ranks} ranks; "
            "use virtual_stages=2"
        )


def rank_of_stage(stage: int, ranks: int, num_stages: int, placement: str = "loop") -> int:
    """The pipeline rank (0..P-1) that holds ``stage``."""
    if placement == "v" and stage >= ranks:
        return num_stages - 1 - stage
    return stage % ranks


def stages_of_rank(rank: int, ranks: int, num_stages: int, placement: str = "loop") -> list[int]:
    """The stages ``rank`` holds, in increasing order."""
    if placement == "v":
        return [rank, num_stages - 1 - rank]
    return list(range(rank, num_stages, ranks))
