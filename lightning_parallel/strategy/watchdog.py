"""A rank that dies ends the others within seconds, with an error naming it.

What happens without this, measured with 3 fork-started gloo ranks on one host: when a peer is
SIGKILLed inside a collective or a send/receive, its kernel closes its sockets and gloo raises on the
others within 0.02 s ("Connection reset by peer [127.0.0.1]:port"), an error that names an address,
not a rank. When the peer stops without closing its sockets (a host that loses power or its network,
a rank stopped or stuck, every NCCL collective) the others wait for the process group's timeout (30
minutes by default) inside the collective, where Python cannot interrupt them. Lightning's launchers
help only in part: the fork/spawn parent terminates the other workers when one exits with an error
(``torch.multiprocessing``), the popen launcher's rank 0 kills its children when one dies, but the
children of a rank 0 that dies, and the ranks of other nodes, are not told.

So every rank runs a ``RankWatchdog`` thread for the length of a Trainer call. Through a client of its
own to the process group's ``TCPStore`` it

1. beats: adds one to its counter every ``interval`` seconds (a fifth of ``timeout``, at most one);
2. watches one neighbour (rank r watches rank r + 1, so the store serves O(1) requests per rank, and a
   whole lost node is seen by the rank before it): a counter that has not moved for ``timeout``
   seconds, of a rank that did not finish its Trainer call, is a lost rank, and the watcher records
   ``rank N is lost`` as the run's end;
3. reads that record: a rank that is not itself raising prints it and ends at once with ``os._exit``
   (a thread cannot interrupt a rank blocked in a collective); one that is raising is given
   ``timeout`` seconds to end by itself.

A rank that raises records ``rank N raised <error>`` first (``failed``), so its peers' errors name it
too; the others are then given ``timeout`` seconds to raise the same error themselves (errors agreed
on every rank, such as a failed checkpoint save, reach all ranks together) before they are ended.
A rank whose own error is a failed collective (its peer vanished) waits for the record instead of
writing one, and raises ``LostRankError`` naming the rank that was lost. Either way the process ends
with a non-zero exit code, which is what SLURM's requeue and ``torchrun``'s restarts look at.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from lightning_parallel.errors import LightningParallelError

PREFIX = "lightning_parallel/watchdog"
BEATS_PER_TIMEOUT = 5  # heartbeats within one ``timeout``, at least
MAX_INTERVAL = 1.0  # seconds between two heartbeats, at most


class LostRankError(LightningParallelError, RuntimeError):
    """Another rank died or raised, so this rank's collective could not finish."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when a peer vanished: torch's distributed errors
    (NCCL, the store), gloo's ``RuntimeError`` of a closed socket."""
    text = str(error) if type(error) is RuntimeError else ""
    return isinstance(error, dist.DistError) or any(
        words in text for words in ("Connection reset by peer", "Connection closed by peer", "/gloo/transport/"))


class RankWatchdog:
    """Heartbeats of this rank, a watch on its neighbour's, and the end of the run recorded in the store.

    Args:
        host, port: the process group's ``TCPStore`` (the cluster environment's main address and port).
        rank, world_size: this process in the world.
        call: the Trainer call's number, the same on every rank (each call has keys of its own).
        timeout: seconds without a heartbeat after which a rank is lost.
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, call: int, timeout: float) -> None:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(timeout, 30.0)))
        self.store = dist.PrefixStore(f"{PREFIX}/{call}", client)
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        # beats (and reads of the record) at least once a second, so a record is read within a second
        self.interval = min(timeout / BEATS_PER_TIMEOUT, MAX_INTERVAL)
        self.neighbour = (rank + 1) % world_size
        self.raising = False  # this rank is handling its own error
        self._read = False  # this rank has read the record of what ended the run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_parallel-watchdog", daemon=True)

    def start(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        self._thread.start()

    def stop(self) -> None:
        """The Trainer call ended on this rank: its silence from now on is no loss."""
        self._stop.set()
        self._thread.join()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the process serving the store finished first: nobody watches
            pass

    def failed(self, error: BaseException) -> Optional[str]:
        """This rank raised ``error``: record it, or, when it is a failed collective, wait (up to
        ``timeout`` and two beats) for the record of what ended the run. Returns that record when
        another rank's loss or error caused this one, else None."""
        self.raising = True
        try:
            if not is_collective_failure(error):
                self._linger(self._record(f"rank {self.rank} raised {type(error).__name__}: {error}"))
                return None
            deadline = time.monotonic() + self.timeout + 2 * self.interval
            while time.monotonic() < deadline:
                ended = self._ended()
                if ended is not None:
                    self._linger(ended)
                    return ended
                time.sleep(self.interval / 2)
        except Exception as err:  # noqa: BLE001 - the store is gone with the rank that served it
            return _unreachable(err)
        return None

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        seen, since = -1, time.monotonic()
        looked = since
        ended_at: Optional[float] = None
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                ended = self._ended()
                if ended is None and self.neighbour != self.rank:
                    beats = self.store.add(f"beat/{self.neighbour}", 0)
                    now = time.monotonic()
                    if beats != seen or now - looked > 2 * self.interval:  # it beat, or this thread was held up
                        seen, since = beats, now
                    looked = now
                    if now - since > self.timeout and not self.store.check([f"done/{self.neighbour}"]):
                        ended = self._record(f"rank {self.neighbour} is lost: no heartbeat for {self.timeout:g} s")
                # a lost rank ends the others at once; a raised error gives them time to raise it too
                patient = self.raising or (ended is not None and " raised " in ended)
            except Exception as err:  # noqa: BLE001 - the store is gone with the process serving it, which
                ended, patient = _unreachable(err), True  # may have just finished: this rank gets time to finish
            if ended is None:
                continue
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at >= (self.timeout if patient else 0.0) and not self._stop.is_set():
                sys.stderr.write(f"[rank {self.rank}] ending this rank: {ended}\n")
                sys.stderr.flush()
                self._linger(ended)
                os._exit(1)

    def _record(self, ended: str) -> str:
        """Record what ended the run, unless something was recorded first; return the record."""
        return self.store.compare_set("ended", "", ended).decode()

    def _ended(self) -> Optional[str]:
        """The record of what ended the run, if there is one (acknowledged once, for ``_linger``)."""
        if not self.store.check(["ended"]):
            return None
        if not self._read:
            self._read = True
            self.store.add("read", 1)
        return self.store.get("ended").decode()

    def _linger(self, ended: str) -> None:
        """Rank 0 serves the store under Lightning's launchers: before it ends, the other ranks that are
        alive read the record, so their errors name the lost rank rather than rank 0 (for at most
        ``timeout`` or 10 s: on a loaded host a rank blocked in a failing collective takes seconds to
        look; a rank lost with the first is never counted, so the wait is bounded)."""
        if self.rank != 0:
            return
        readers = self.world_size - 1 - (" is lost" in ended)
        deadline = time.monotonic() + max(2 * self.interval, min(self.timeout, 10.0))
        while time.monotonic() < deadline and self.store.add("read", 0) < readers + self._read:
            time.sleep(0.05)


def _unreachable(error: BaseException) -> str:
    return (f"the process group's store is unreachable, so the process serving it is lost (rank 0 under "
            f"Lightning's launchers; torchrun's agent under torchrun): {type(error).__name__}: {error}")
