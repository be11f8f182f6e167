"""`kvxferd fence`: tell a generation daemon that a context daemon is gone for good.

A receive that ended while a context daemon may still write into its blocks keeps them
(a hold) until that writer is fenced: it answers the receive's Abort, its process is seen
to exit (same host), or it comes back where it was as a new incarnation. A writer on
another host that died and never comes back is none of these, and its holds would last
until the generation daemon stops. This is the operator's fence for it: run it once you
know that process is gone (the host is down, the container was removed). A stopped
process is not a gone one: it can still write when it resumes.

The daemon is named by its configuration file (its engine API socket) or by --socket.
Exits 0 when holds ended, 1 when the daemon refused (it is connected to that daemon,
or no hold waits for it) or cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvxferd.errors import KvxferdError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "fence",
        help="end the holds of a context daemon that is gone for good",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the generation daemon's configuration")
    where.add_argument("--socket", metavar="PATH", help="the generation daemon's engine API socket")
    p.add_argument("--role", choices=["context", "generation", "both"], help="as for `run`")
    p.add_argument("peer", metavar="NAME", help="the gone context daemon's daemon.name")
    p.add_argument(
        "--incarnation",
        default="",
        help="only this incarnation of it (a refusal lists the writers holds wait for)",
    )
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds (default 10)")
    p.set_defaults(handler=_fence)


def _socket(args: argparse.Namespace) -> str:
    if args.socket:
        return str(args.socket)
    from kvxferd.config import load_config

    return load_config(args.config, role=args.role).daemon.api_socket_path()


def _fence(args: argparse.Namespace) -> int:
    from kvxferd.client import CallError, Client, DaemonGoneError

    path = _socket(args)
    try:
        with Client(path, engine="kvxferd-fence", timeout_s=args.timeout) as client:
            ended = client.fence_writer(args.peer, args.incarnation)
    except CallError as exc:
        print(f"kvxferd fence: the daemon at {path} refused: {exc}", file=sys.stderr)
        return 1
    except (DaemonGoneError, OSError, TimeoutError) as exc:
        raise KvxferdError(f"no kvxferd daemon answered at {path}: {exc}") from exc
    who = f"{args.peer}/{args.incarnation}" if args.incarnation else args.peer
    print(f"fenced {who}: {ended} hold(s) ended, their blocks are back with their engines")
    return 0
