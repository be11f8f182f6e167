"""The configurations `kvxferd bench --configs` can compare.

A configuration is a name, the `cache_transceiver_config` overrides (and, where needed, engine
section overrides) both daemons run with, and whether this build can run it. To add one,
append a BenchConfig to REGISTRY. When a feature lands in the daemon, drop its `missing=`
(the NIXL import probe then decides), or give it a `requires=` probe of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvxferd.errors import KvxferdError

#: None when the configuration can run here, else why not (one sentence).
Availability = Callable[[], str | None]


class BenchConfigError(KvxferdError):
    """An unknown or unavailable configuration name (a usage error: exit status 2)."""


def _needs_nixl() -> str | None:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as exc:
        return (
            f"NIXL does not import ({exc}); install it with "
            "`pip install --no-deps 'nixl-cu12>=1.5,<2'` (scripts/install.sh does this)"
        )
    return None


def _needs_ucxx() -> str | None:
    import importlib.util

    # find_spec, not import: importing ucxx writes UCX_* variables into os.environ, which
    # the daemons started afterwards would inherit (and NIXL with them).
    if importlib.util.find_spec("ucxx") is None:
        return (
            "the UCX backend needs the ucxx-cu12 package, which is not installed "
            "(scripts/install.sh installs it)"
        )
    return _needs_nixl()  # the raw baseline is NIXL


@dataclass(frozen=True)
class BenchConfig:
    """One configuration. `missing`: what this build lacks for it (a static fact, shown by
    --help without importing anything); `requires`: the probe run when nothing is missing."""

    name: str
    description: str
    transceiver: Mapping[str, Any]
    engine: Mapping[str, Any] = field(default_factory=dict)
    #: The context engine sends each request in chunks of this many blocks (0: one send).
    chunk_blocks: int = 0
    missing: str | None = None
    requires: Availability = _needs_nixl

    def unavailable(self) -> str | None:
        if self.missing is not None:
            return f"{self.missing} is not implemented yet"
        return self.requires()


_PYTHON = {"backend": "NIXL", "transceiver_runtime": "PYTHON", "kv_transfer_timeout_ms": 60000}

REGISTRY: tuple[BenchConfig, ...] = (
    BenchConfig(
        "nixl-python",
        "PYTHON runtime over NIXL: one WRITE per request, one descriptor per contiguous run",
        _PYTHON,
    ),
    BenchConfig(
        "nixl-python-bounce",
        "PYTHON runtime over NIXL through the bounce buffer (one contiguous write)",
        # Per region (one send, one receive, on each daemon): room for one 8000-token
        # request of the default geometry. Used only where segments are small (layer-major).
        {**_PYTHON, "kv_cache_bounce_size_mb": 1024},
    ),
    BenchConfig(
        "nixl-python-pipelined",
        "PYTHON runtime over NIXL, one write per prefill chunk of 16 blocks",
        {**_PYTHON, "enable_pipelined_transfer": True},
        engine={"enable_chunked_prefill": True},
        chunk_blocks=16,
    ),
    BenchConfig(
        "nixl-cpp",
        "staged (CPP) runtime over NIXL: gather into a staging buffer, write, scatter",
        {"backend": "NIXL", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
    ),
    BenchConfig(
        "ucx-cpp",
        "staged (CPP) runtime over UCX (ucxx tagged messages)",
        {"backend": "UCX", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
        requires=_needs_ucxx,
    ),
    BenchConfig(
        "mpi-cpp",
        "staged (CPP) runtime over MPI",
        {"backend": "MPI", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
        missing="the MPI backend",
    ),
    BenchConfig(
        "mooncake-cpp",
        "staged (CPP) runtime over the Mooncake transfer engine",
        {"backend": "MOONCAKE", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
        missing="the Mooncake backend",
    ),
)

_BY_NAME = {c.name: c for c in REGISTRY}


def known_names() -> list[str]:
    return [c.name for c in REGISTRY]


def resolve(names: list[str]) -> list[BenchConfig]:
    """The configurations named, in order, duplicates dropped. Raises BenchConfigError for an
    unknown name (listing the known ones) or one that cannot run here (saying why)."""
    out: list[BenchConfig] = []
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        config = _BY_NAME.get(name)
        if config is None:
            raise BenchConfigError(
                f"unknown configuration {name!r}; known configurations: " + ", ".join(known_names())
            )
        why = config.unavailable()
        if why is not None:
            raise BenchConfigError(f"configuration {name!r} is not available in this build: {why}")
        if config not in out:
            out.append(config)
    if not out:
        raise BenchConfigError(
            "no configuration given; known configurations: " + ", ".join(known_names())
        )
    return out
