#!/usr/bin/env python3
"""Rewrite a wheel without members the GPU check never loads, so the wheels fit the carry limit.

Usage: scripts/strip_wheel.py WHEEL [--drop GLOB ...] [--more] [--out PATH] [--dry-run]

The device machine receives the working tree and carried paths, 64 MiB in all. nixl-cu13
1.5.1 is ~59 MB as published; about half of it is `nixl_ep_cu13/` (NIXL's expert-parallel
torch extension, three 31 MB builds for three torch versions), which kvxferd never imports.
UCX's perftest module and the C++ headers are not loaded at run time either. What stays:
the `nixl_cu13` package, `nixl_cu13.libs/` (UCX and every library libnixl links, grpc and
etcd included: libnixl.so needs them to load) and the mesonpy plugin directory.

Members are matched with fnmatch against their full name in the zip. Their RECORD lines go
too, so that RECORD lists exactly what the wheel holds (pip installs by the zip's members and
copies RECORD; a RECORD naming missing files would make a later `pip uninstall` complain).
The wheel keeps its file name: pip reads name, version and tags from it.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import tempfile
import zipfile
from collections.abc import Sequence

#: Dropped by default: never imported or dlopened by kvxferd or by NIXL's UCX plugin.
DEFAULT_DROP = (
    "nixl_ep_cu*/*",  # the expert-parallel torch extension (~28 MB compressed)
    "*perftest*",  # UCX's perftest modules (libucx_perftest_cuda.so is 2.2 MB)
    "*.data/headers/*",  # C/C++ headers, for building against NIXL
    "*.data/data/include/*",  # the same, where a build puts them under data/
)

#: With --more: storage and network plugins NIXL dlopens only when a config names them.
#: Not grpc or etcd: libnixl.so links libgrpc and libetcd-cpp-api-core directly.
MORE_DROP = tuple(
    f"*/libplugin_{name}.so"
    for name in (
        "AZURE_BLOB",
        "GDS",
        "GDS_MT",
        "GPUNETIO",
        "GUSLI",
        "INFINIA",
        "LIBFABRIC",
        "OBJ",
        "POSIX",
    )
)

#: Members whose loss would make the wheel useless: refuse a pattern that matches them.
_KEEP = ("*.dist-info/METADATA", "*.dist-info/WHEEL", "*.dist-info/RECORD")


def dropped(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _record_name(names: Sequence[str]) -> str:
    records = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise SystemExit(
            f"strip_wheel: expected one top-level */.dist-info/RECORD, found {records}"
        )
    return records[0]


def _stripped_record(text: str, gone: set[str]) -> str:
    # A RECORD line is "path,hash,size"; paths with commas are quoted, which wheels of
    # these packages never need. Keep every line whose path stays, in its order.
    kept = [line for line in text.splitlines() if line.split(",", 1)[0] not in gone]
    return "\n".join(kept) + "\n"


def strip(wheel: str, patterns: Sequence[str], out: str | None = None) -> tuple[list[str], int]:
    """Write the wheel without members matching `patterns` (to `out`, default in place).

    Returns (dropped member names, bytes of compressed data dropped)."""
    with zipfile.ZipFile(wheel) as zin:
        infos = zin.infolist()
        names = [i.filename for i in infos]
        record = _record_name(names)
        gone = [n for n in names if dropped(n, patterns)]
        for n in gone:
            if any(fnmatch.fnmatchcase(n, k) for k in _KEEP):
                raise SystemExit(f"strip_wheel: refusing to drop {n}: the wheel needs it")
        gone_set = set(gone)
        saved = sum(i.compress_size for i in infos if i.filename in gone_set)
        target = out or wheel
        fd, tmp = tempfile.mkstemp(
            prefix=".strip-", suffix=".whl", dir=os.path.dirname(target) or "."
        )
        os.close(fd)
        try:
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
                for info in infos:
                    if info.filename in gone_set:
                        continue
                    data = zin.read(info)
                    if info.filename == record:
                        data = _stripped_record(data.decode(), gone_set).encode()
                    # Reusing the ZipInfo keeps each member's permission bits (executables
                    # in *.scripts/) and its time stamp.
                    zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            # mkstemp made it 0600; keep the input's mode so the wheel reads like the others.
            os.chmod(tmp, os.stat(wheel).st_mode & 0o777)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    return gone, saved


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("wheel")
    p.add_argument(
        "--drop", action="append", metavar="GLOB", help="drop these members instead of the defaults"
    )
    p.add_argument("--more", action="store_true", help="also drop the non-UCX NIXL plugins")
    p.add_argument("--out", help="write here instead of rewriting the wheel in place")
    p.add_argument("--dry-run", action="store_true", help="list what would go, change nothing")
    args = p.parse_args(argv)
    patterns = list(args.drop or DEFAULT_DROP)
    if args.more:
        patterns += MORE_DROP
    if args.dry_run:
        with zipfile.ZipFile(args.wheel) as z:
            for n in z.namelist():
                if dropped(n, patterns):
                    print(n)
        return 0
    before = os.path.getsize(args.wheel)
    gone, saved = strip(args.wheel, patterns, args.out)
    after = os.path.getsize(args.out or args.wheel)
    print(
        f"strip_wheel: {os.path.basename(args.wheel)}: dropped {len(gone)} members "
        f"({saved / 1e6:.1f} MB compressed); {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
