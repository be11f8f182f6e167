"""UCX_TLS as UCX itself may see it: the environment, or the ucx.conf files UCX reads when
the environment does not set it.

UCX reads, each later one overriding the earlier (the environment overrides them all):
its build's system directory (/etc/ucx/ucx.conf here), ../etc/ucx/ucx.conf beside the
library itself, $HOME/ucx.conf and $UCX_CONFIG_DIR/ucx.conf. A process holds more than one
UCX (NIXL's own copy, ucxx's), each reading the file beside itself, so this does not pick
one: it returns every value of UCX_TLS any of them may take, and the caller allows what
all of them allow (kvxferd.backends.cma: CMA only if no file limits it).

The files are ini-style "KEY=VALUE" lines ("#" and ";" start comments); a value under a
section header is taken as one that may apply. A file that exists but cannot be read
counts as a value that allows nothing (UNREADABLE).
"""

from __future__ import annotations

import importlib.util
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

FILE_NAME = "ucx.conf"
SYSTEM_DIR = "/etc/ucx"
# What a file that exists but cannot be read stands for: a UCX_TLS naming no transport.
UNREADABLE = "^all"
# A ucx.conf is a few lines; one larger than this is not read (UNREADABLE).
MAX_BYTES = 1 << 20
# Where the wheels this project installs keep their UCX libraries, by package.
_LIB_DIRS = {"nixl_cu12": "../nixl_cu12.libs", "libucx": "lib"}


def library_dirs(maps: str = "/proc/self/maps") -> set[Path]:
    """The directories of the UCX libraries this process loaded or would load: those
    mapped already (libucs), and those of the wheels that ship one."""
    dirs: set[Path] = set()
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").partition("/")[2]
                if path and "libucs" in Path(path).name:
                    dirs.add(Path("/" + path).parent)
    except OSError:
        pass
    for package, rel in _LIB_DIRS.items():
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                dirs.add((Path(location) / rel).resolve())
    return dirs


def config_files(env: Mapping[str, str], lib_dirs: Iterable[Path]) -> list[Path]:
    """The ucx.conf files UCX may read, in its order (system, beside a library, home,
    UCX_CONFIG_DIR)."""
    files = [Path(SYSTEM_DIR) / FILE_NAME]
    files += [(d / "../etc/ucx" / FILE_NAME) for d in sorted(lib_dirs)]
    for var in ("HOME", "UCX_CONFIG_DIR"):
        if env.get(var):
            files.append(Path(env[var]) / FILE_NAME)
    return files


def file_value(path: Path, key: str) -> str | None:
    """The last value of `key` in one ucx.conf (None: not set there, or no such file). A
    path that is not a regular file (a FIFO would block the read), or a file over
    MAX_BYTES, cannot be judged: UNREADABLE for UCX_TLS."""
    unreadable = UNREADABLE if key == "UCX_TLS" else None
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return unreadable
        with path.open("rb") as f:
            text = f.read(MAX_BYTES + 1).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError:
        return unreadable
    value = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;[":
            continue
        name, sep, rest = line.partition("=")
        if sep and name.strip() == key:
            value = rest.split(" #", 1)[0].split(" ;", 1)[0].strip()
    return value


def tls_values(
    env: Mapping[str, str] | None = None, lib_dirs: Iterable[Path] | None = None
) -> list[str | None]:
    """Every UCX_TLS a UCX of this process may take: the environment's alone when it sets
    one; else each config file's that sets one, or [None] (UCX's default) when none does."""
    env = os.environ if env is None else env
    if "UCX_TLS" in env:
        return [env["UCX_TLS"]]
    dirs = library_dirs() if lib_dirs is None else lib_dirs
    found = [v for f in config_files(env, dirs) if (v := file_value(f, "UCX_TLS")) is not None]
    return list(found) or [None]
