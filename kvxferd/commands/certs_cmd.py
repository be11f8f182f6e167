"""`kvxferd certs DIR NAME...`: a test CA and one certificate per daemon, for mutual TLS.

Prints the daemon-section lines each daemon needs. Reuses DIR's CA when there is one, so
more daemons can be added later; the CA key stays in DIR (keep it away from the daemons).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "certs", help="make a test CA and mutual-TLS certificates for daemons (uses openssl)"
    )
    p.add_argument("directory", type=Path, help="where the CA and certificates go")
    p.add_argument("names", nargs="+", metavar="NAME", help="daemon names (daemon.name)")
    p.add_argument("--days", type=int, default=30, help="validity in days (default 30)")
    p.set_defaults(handler=_certs)


def _certs(args: argparse.Namespace) -> int:
    from kvxferd.peers import testca

    directory: Path = args.directory.resolve()
    for name in args.names:
        issued = testca.issue(directory, name, days=args.days)
        print(f"# {name}: in its daemon section")
        for key, value in issued.daemon_settings().items():
            print(f"  {key}: {value}")
    print(f"# the CA key is {directory / 'ca.key'}: it signs certificates, keep it off the hosts")
    return 0
