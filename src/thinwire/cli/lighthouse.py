"""Run torchft's Lighthouse, which forms the quorums of fault-tolerant training.

    thinwire lighthouse --min-workers 2            # listens on [::]:29510
    thinwire train --fault-tolerant --lighthouse http://HOST:29510 --replica-id 0 ...

It runs until interrupted (Ctrl-C). Workers that stop answering for
--heartbeat-timeout seconds leave the next quorum; a new quorum waits up to
--join-timeout seconds for live workers that have not asked for it yet, which
must exceed the time between two syncs: else workers that join while the
others train form a quorum of their own.
"""

from __future__ import annotations

import argparse
import os
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="[::]:29510", metavar="ADDRESS",
                        help="address to listen on")
    parser.add_argument("--min-workers", type=int, default=1, metavar="N",
                        help="the fewest workers that form a quorum")
    parser.add_argument("--join-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long a quorum waits for live workers that have not asked "
                             "yet; longer than the time between two syncs")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="SECONDS",
                        help="how long a silent worker still counts as alive")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's own logging, read at its import
    from thinwire.elastic import start_lighthouse

    server = start_lighthouse(args.bind, min_workers=args.min_workers,
                              join_timeout_s=args.join_timeout,
                              heartbeat_timeout_s=args.heartbeat_timeout)
    print(f"Lighthouse listening at {server.address()} (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0
