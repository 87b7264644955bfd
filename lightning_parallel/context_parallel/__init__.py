"""Context parallelism: each sequence of a replica's batch split over ``context_parallel`` ranks.

Pure arithmetic (``chunks``: which tokens a rank holds, which attention block it computes at each ring
step) apart from the process code: the ring's collectives (``comm``), one block's attention with its
log-sum-exp (``kernels``), ring attention (``ring``), the replacement of ``scaled_dot_product_attention``
(``attention``) and the hooks that split an unchanged model's sequence at its blocks (``sequence``).
"""

from lightning_parallel.context_parallel.sequence import ContextParallel

__all__ = ["ContextParallel"]
