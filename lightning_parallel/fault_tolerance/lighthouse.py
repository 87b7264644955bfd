"""The quorum server replica groups meet at: torchft's lighthouse, on a port of one's choosing.

Every step each group's rank 0 asks it for a quorum of at least ``min_replicas`` groups. A group whose
heartbeat it has not heard for ``heartbeat_timeout_ms`` counts as dead, so the others go on without it
after that long; a group that heartbeats but has not asked yet (one still starting) is waited for up
to ``join_timeout_ms`` before a quorum goes ahead without it (torchft's lighthouse options).
"""

from __future__ import annotations

from typing import Any

from lightning_parallel.fault_tolerance import require_torchft


def start_lighthouse(port: int, min_replicas: int = 1, join_timeout_ms: int = 60000,
                     heartbeat_timeout_ms: int = 5000) -> Any:
    """A running ``torchft`` ``LighthouseServer`` bound to every interface at ``port`` (0: any free one);
    ``.address()`` is what groups pass as ``lighthouse``, ``.shutdown()`` stops it."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)
