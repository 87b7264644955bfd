"""`lp-lighthouse`: the quorum server that the replica groups of a fault-tolerant run meet at.

    lp-lighthouse --port 29510                     # then, per group I of R:
    lp-train strategy.replica_groups=R strategy.replica_group=I strategy.lighthouse=http://HOST:29510

It prints ``http://HOST:PORT`` (the address to pass as ``strategy.lighthouse``) and serves until
interrupted (Ctrl-C, SIGTERM). See docs/cluster.md, "Fault tolerance across replica groups".
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Optional


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lp-lighthouse", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--port", type=int, required=True, help="port to serve on, every interface (0: any free one)")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="fewest replica groups that may train; below it the groups alive wait (default 1)")
    parser.add_argument("--join-timeout-ms", type=int, default=60000,
                        help="how long a quorum waits for a group that heartbeats but has not asked yet (default 60000)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="silence after which a group counts as dead and the others go on (default 5000)")
    args = parser.parse_args(argv)
    if args.min_replicas < 1:
        parser.error(f"--min-replicas must be at least 1, got {args.min_replicas}")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    from lightning_parallel.errors import ConfigurationError
    from lightning_parallel.fault_tolerance.lighthouse import start_lighthouse

    args = parse_args(argv)
    try:
        server = start_lighthouse(args.port, args.min_replicas, args.join_timeout_ms, args.heartbeat_timeout_ms)
    except ConfigurationError as err:
        sys.exit(f"lp-lighthouse: {err}")
    print(server.address(), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()


if __name__ == "__main__":
    main()
