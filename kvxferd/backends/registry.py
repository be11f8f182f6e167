"""Which adapter moves KV for each `backend` of the configuration.

Two kinds of adapter (DESIGN.md):

* one-sided backends implement `Backend` (kvxferd.backends.base): the daemon's
  data plane registers memory with them and posts writes into the peer's
  registered memory (NIXL under both runtimes, MOONCAKE under the staged one);
* two-sided backends implement `TwoSidedTransport` (kvxferd.backends.twosided):
  each staged round crosses as one tagged message (UCX, MPI); the data plane
  then runs `NoOneSidedBackend`.

Every adapter module imports its transport library itself, when the factory
below is called: a daemon configured for NIXL never imports ucxx, mpi4py or
mooncake, and a missing package fails only the daemon that chose it, with a
BackendUnavailableError that says what to install.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.backends.base import Backend
from kvxferd.backends.nixl import NIXL_MODULES, nixl_module_name
from kvxferd.backends.twosided import NoOneSidedBackend, TwoSidedTransport
from kvxferd.errors import StartupError


@dataclass(frozen=True)
class BackendOptions:
    """What a one-sided adapter may need from the daemon's configuration."""

    host: str = "127.0.0.1"
    """The host of daemon.peer_listen: where peers reach this daemon's data plane."""
    transfer_timeout_ms: int | None = None
    """kv_transfer_timeout_ms: an adapter keeps its library's own timeouts below it."""


def _nixl(agent_name: str, options: BackendOptions) -> Backend:
    from kvxferd.backends.nixl import NixlBackend

    return NixlBackend(agent_name)


def _mooncake(agent_name: str, options: BackendOptions) -> Backend:
    from kvxferd.backends.mooncake import MooncakeBackend

    return MooncakeBackend(agent_name, options.host, options.transfer_timeout_ms)


def _ucx(daemon_name: str, incarnation: str, secret: bytes, per_pair: bool) -> TwoSidedTransport:
    from kvxferd.backends.ucx import UcxTransport

    return UcxTransport(daemon_name, incarnation, secret=secret, per_pair_secrets=per_pair)


def _mpi(daemon_name: str, incarnation: str, secret: bytes, per_pair: bool) -> TwoSidedTransport:
    from kvxferd.backends.mpi import MpiTransport

    return MpiTransport(daemon_name, incarnation, secret=secret, per_pair_secrets=per_pair)


# backend name -> factory(agent_name, options). One-sided: memory registration + writes.
ONE_SIDED: dict[str, Callable[[str, BackendOptions], Backend]] = {
    "NIXL": _nixl,
    "MOONCAKE": _mooncake,
}

# backend name -> factory(daemon_name, incarnation, shared secret). Two-sided: tagged
# send/recv.
TWO_SIDED: dict[str, Callable[[str, str, bytes, bool], TwoSidedTransport]] = {
    "UCX": _ucx,
    "MPI": _mpi,
}


def _nixl_module() -> str:
    # Which NIXL wheel (nixl_cu12 or nixl_cu13) decides by what is installed; with neither,
    # the name a probe reports missing is today's default.
    return nixl_module_name() or NIXL_MODULES[0]


def package_of(backend: str) -> str:
    """The package `backend`'s adapter imports, for probes that must not import it
    (importing ucxx, say, writes UCX_* variables into os.environ): find_spec it."""
    if backend == "NIXL":
        return _nixl_module()  # asked each time: the environment may name another
    return PACKAGES[backend]


# The same, as found when this module was imported (NIXL: see package_of).
PACKAGES = {"NIXL": _nixl_module(), "UCX": "ucxx", "MPI": "mpi4py", "MOONCAKE": "mooncake"}

# The one backend the PYTHON runtime runs on (the seed: "Requires Python NIXL").
PYTHON_RUNTIME_BACKEND = "NIXL"


def available() -> list[str]:
    """The backends this build can move KV with, in a stable order."""
    return sorted({*ONE_SIDED, *TWO_SIDED})


def is_two_sided(backend: str) -> bool:
    return backend in TWO_SIDED


def startup_problem(backend: str, runtime: str) -> str | None:
    """Why a daemon with this resolved backend and runtime cannot start, or None."""
    if backend not in ONE_SIDED and backend not in TWO_SIDED:
        return (
            f"backend {backend} is not available in this build (available: "
            f"{', '.join(available())}); set cache_transceiver_config.backend to one of them"
        )
    if runtime == "PYTHON" and backend != PYTHON_RUNTIME_BACKEND:
        return (
            f"the PYTHON runtime moves KV over NIXL only, and the backend is {backend}; "
            "set transceiver_runtime: CPP (or auto) for it"
        )
    return None


def make_backend(backend: str, agent_name: str, options: BackendOptions | None = None) -> Backend:
    """The data plane's backend: the one-sided adapter, or a stand-in for two-sided ones."""
    if backend in TWO_SIDED:
        return NoOneSidedBackend(backend, agent_name)
    factory = ONE_SIDED.get(backend)
    if factory is None:
        raise StartupError(startup_problem(backend, "CPP") or f"backend {backend} is unknown")
    return factory(agent_name, options or BackendOptions())


def make_transport(
    backend: str,
    daemon_name: str,
    incarnation: str,
    secret: bytes = b"",
    per_pair_secrets: bool = False,
) -> TwoSidedTransport:
    """`secret`: the daemons' shared secret (b"" without one), which every new link of
    the transport proves (link_proof.py); `per_pair_secrets` (mutual TLS without a
    shared secret): a key per pair of daemons instead (link_secrets.py)."""
    factory = TWO_SIDED.get(backend)
    if factory is None:
        raise StartupError(f"backend {backend} is not a two-sided transport")
    return factory(daemon_name, incarnation, secret, per_pair_secrets)
