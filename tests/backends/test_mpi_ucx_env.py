"""The MPICH/UCX environment a daemon's MPI starts with (kvxferd.backends.mpi.ucx_env)."""

from __future__ import annotations

import pytest

from kvxferd.backends.mpi import ucx_env


@pytest.mark.parametrize(
    ("tls", "shared"),
    [
        (None, True),  # UCX's default: every transport
        ("", True),
        ("^cma", True),  # our default: posix and sysv stay
        ("all", True),
        ("sm", True),
        ("tcp,posix", True),
        ("tcp,sysv:aux", True),
        ("^sm", False),
        ("^shm,cma", False),
        ("^mm", False),
        ("^cma, posix, sysv", False),
        ("^posix", True),  # sysv still carries it
        ("tcp", False),
        ("tcp,self", False),
        ("rc,ud,tcp", False),
        (" TCP , Self ", False),
    ],
)
def test_which_transports_bring_the_shared_receive_queue(tls: str | None, shared: bool) -> None:
    assert ucx_env.shared_memory_tls(tls) is shared


@pytest.mark.parametrize(
    ("text", "size"),
    [("1M", 1 << 20), ("64k", 64 << 10), ("8192", 8192), ("2mb", 2 << 20), ("1x", None)],
)
def test_ucx_sizes(text: str, size: int | None) -> None:
    assert ucx_env.size_bytes(text) == size


def test_defaults_fill_only_what_is_unset() -> None:
    env = {"UCX_TLS": "tcp,self", "UCX_TCP_TX_SEG_SIZE": "4M"}
    ucx_env.apply_defaults(env)
    assert env["UCX_TLS"] == "tcp,self" and env["UCX_TCP_TX_SEG_SIZE"] == "4M"
    assert env["UCX_TCP_RX_SEG_SIZE"] == "1M" and env[ucx_env.NETMOD_CVAR] == "ucx"
    # TCP alone: MPICH's pack buffers hold the largest segment (it aborts MPI_Init else).
    assert env[ucx_env.PACK_BUFFER_CVAR] == str(8 << 20)


def test_shared_memory_keeps_mpichs_pack_buffers() -> None:
    env: dict[str, str] = {}
    ucx_env.apply_defaults(env)
    assert env["UCX_TLS"] == "^cma" and ucx_env.PACK_BUFFER_CVAR not in env


def test_an_operators_pack_buffer_size_stands() -> None:
    env = {"UCX_TLS": "tcp", ucx_env.PACK_BUFFER_CVAR: "65536"}
    ucx_env.apply_defaults(env)
    assert env[ucx_env.PACK_BUFFER_CVAR] == "65536"


def test_the_hazard_is_named_only_where_it_applies() -> None:
    shared = {"UCX_TLS": "^cma"}
    warning = ucx_env.shared_memory_hazard(shared)
    assert warning is not None and "'^cma'" in warning and "UCX_TLS=^sm" in warning
    assert ucx_env.shared_memory_hazard({"UCX_TLS": "tcp"}) is None
    assert ucx_env.shared_memory_hazard({**shared, ucx_env.NETMOD_CVAR: "ofi"}) is None
