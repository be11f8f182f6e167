"""The configurations `kvxferd bench --configs` can compare.

A configuration is a name, the `cache_transceiver_config` overrides (and, where needed, engine
section overrides) both daemons run with, and a probe saying whether this build can run it
here. To add one, append a BenchConfig to REGISTRY. `--backend/--runtime` build one on the fly
(from_flags).
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
    # The daemons' own loader, so the bench probes the wheel (nixl_cu12 or nixl_cu13) they load.
    from kvxferd.backends.nixl import load_nixl
    from kvxferd.errors import BackendUnavailableError

    try:
        load_nixl()
    except BackendUnavailableError as exc:
        return str(exc)
    return None


def _needs_backend(backend: str) -> Availability:
    """The probe of a staged-runtime backend: an adapter in this build, its package
    installed (find_spec, not import, as above), and NIXL for the raw baseline."""

    def probe() -> str | None:
        import importlib.util

        from kvxferd.backends import registry

        if backend not in registry.available():
            have = ", ".join(registry.available())
            return f"this build has no {backend} adapter (available: {have})"
        package = registry.package_of(backend)
        if importlib.util.find_spec(package) is None:
            return (
                f"the {backend} backend needs the {package} package, which is not installed "
                "(scripts/install.sh installs it)"
            )
        return _needs_nixl()

    return probe


BACKENDS = ("DEFAULT", "NIXL", "UCX", "MPI", "MOONCAKE")
#: The transceiver key of a PYTHON configuration's bounce buffer (MiB per region).
BOUNCE_KEY = "kv_cache_bounce_size_mb"
RUNTIMES = ("PYTHON", "CPP", "auto")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration. `requires`: None when it can run here, else why not."""

    name: str
    description: str
    transceiver: Mapping[str, Any]
    engine: Mapping[str, Any] = field(default_factory=dict)
    #: The context engine sends each request in chunks of this many blocks (0: one send).
    chunk_blocks: int = 0
    #: Mutual TLS on the peer control channel (a test CA made for the run).
    tls: bool = False
    requires: Availability = _needs_nixl

    def unavailable(self) -> str | None:
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
        "nixl-python-tls",
        "PYTHON runtime over NIXL with mutual TLS on the peer control channel",
        _PYTHON,
        tls=True,
    ),
    BenchConfig(
        "nixl-cpp",
        "staged (CPP) runtime over NIXL: long pool runs written as they are, else gathered",
        {"backend": "NIXL", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
    ),
    BenchConfig(
        "ucx-cpp",
        "staged (CPP) runtime over UCX (ucxx tagged messages)",
        {"backend": "UCX", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
        requires=_needs_backend("UCX"),
    ),
    BenchConfig(
        "mpi-cpp",
        "staged (CPP) runtime over MPI (mpi4py + MPICH)",
        {"backend": "MPI", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
        requires=_needs_backend("MPI"),
    ),
    BenchConfig(
        "mooncake-cpp",
        "staged (CPP) runtime over the Mooncake transfer engine",
        {"backend": "MOONCAKE", "transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 60000},
        requires=_needs_backend("MOONCAKE"),
    ),
)

_BY_NAME = {c.name: c for c in REGISTRY}


def from_flags(backend: str, runtime: str) -> BenchConfig:
    """The configuration `--backend B --runtime R` asks for, as a user would write it in
    cache_transceiver_config. A registered configuration with exactly those settings keeps
    its name (so results compare across runs); others are named `b-r`.

    Raises BenchConfigError for a value outside the seed's or a pair that cannot run.
    """
    if backend not in BACKENDS:
        raise BenchConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if runtime not in RUNTIMES:
        raise BenchConfigError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    effective = "NIXL" if backend == "DEFAULT" else backend
    # What the daemons will resolve `auto` to: PYTHON needs NIXL (a finite timeout is set).
    resolved = runtime if runtime != "auto" else ("PYTHON" if effective == "NIXL" else "CPP")
    if resolved == "PYTHON" and effective != "NIXL":
        raise BenchConfigError(
            f"--runtime PYTHON moves KV over NIXL only; --backend {backend} runs with "
            "--runtime CPP (or auto)"
        )
    transceiver = {
        "backend": backend,
        "transceiver_runtime": runtime,
        "kv_transfer_timeout_ms": 60000,
    }
    for c in REGISTRY:
        if dict(c.transceiver) == transceiver:
            config = c
            break
    else:
        config = BenchConfig(
            f"{backend.lower()}-{runtime.lower()}",
            f"{resolved} runtime over {effective} (--backend {backend} --runtime {runtime})",
            transceiver,
            requires=_needs_backend(effective),
        )
    why = config.unavailable()
    if why is not None:
        raise BenchConfigError(
            f"--backend {backend} --runtime {runtime} cannot run in this build: {why}"
        )
    return config


#: What `--memory vram` runs when no configuration is named: the NIXL configurations that
#: can move device pools (their device staging is always there).
VRAM_DEFAULT = ("nixl-python-bounce", "nixl-cpp")


def vram_refusal(config: BenchConfig) -> str | None:
    """Why `config` cannot move device pools (None: it can), by the same rules the daemons'
    configuration applies to engine.kv_memory vram (kvxferd.config.resolve)."""
    t = config.transceiver
    backend = "NIXL" if t.get("backend", "DEFAULT") == "DEFAULT" else t["backend"]
    runtime = t.get("transceiver_runtime", "auto")
    runtime = ("PYTHON" if backend == "NIXL" else "CPP") if runtime == "auto" else runtime
    ok = ", ".join(VRAM_DEFAULT)
    if backend != "NIXL":
        return (
            f"configuration {config.name!r} runs over {backend}, which moves host memory only "
            f"here; --memory vram measures NIXL configurations ({ok})"
        )
    if runtime == "PYTHON" and not t.get(BOUNCE_KEY, 0):
        return (
            f"configuration {config.name!r} has no bounce buffer, and the PYTHON runtime moves "
            f"device pools only through it; --memory vram measures {ok}"
        )
    if runtime == "PYTHON" and t.get("enable_pipelined_transfer"):
        return (
            f"configuration {config.name!r} pipelines, and the PYTHON runtime bounces device "
            f"pools whole; --memory vram measures {ok}"
        )
    return None


def for_memory(configs: list[BenchConfig], memory: str) -> list[BenchConfig]:
    """`configs`, checked for `memory` (host: all of them). Raises BenchConfigError for the
    first one that cannot move device pools."""
    if memory == "vram":
        for config in configs:
            why = vram_refusal(config)
            if why is not None:
                raise BenchConfigError(why)
    return configs


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
