"""The settings fingerprint peers compare in the handshake, pinned to its values.

Daemons of different versions must compute the same fingerprint for the same settings, or
they refuse each other. Any change to its encoding (field names, JSON spelling, digest,
length) fails here; a deliberate change needs a new PROTOCOL_VERSION and new values below.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from kvxferd.config import ResolvedSettings, load_config_text, resolve

# (backend, runtime, pipelined) -> the first 16 hex digits of the SHA-256 of the canonical
# JSON {"backend":...,"pipelined_transfer":...,"runtime":...} (sorted keys, no spaces).
PINNED = {
    ("NIXL", "PYTHON", False): "4dceee8569e73aa7",
    ("NIXL", "PYTHON", True): "702743657d443fd1",
    ("NIXL", "CPP", False): "89ad5d6aeec57fbc",
    ("NIXL", "CPP", True): "02522dfa078d97a2",
    ("UCX", "PYTHON", False): "3dba5a9eee58a303",
    ("UCX", "CPP", False): "443745b500bd1402",
    ("MPI", "CPP", False): "c03f90568f9d6e0b",
    ("MOONCAKE", "CPP", False): "ee8ef18a2fc1725c",
}


def settings(backend: str, runtime: str, pipelined: bool, **other: object) -> ResolvedSettings:
    fields: dict[str, object] = dict(
        backend=backend,
        runtime=runtime,
        runtime_reason="r",
        bounce_buffer_mb=0,
        bounce_reason="b",
        pipelined_transfer=pipelined,
        pipelined_reason="p",
        admission_window_blocks=None,
        kv_transfer_timeout_ms=60000,
        kv_transfer_sender_future_timeout_ms=None,
        kv_transfer_poll_interval_ms=None,
        max_tokens_in_buffer=None,
    )
    fields.update(other)
    return ResolvedSettings(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("key", "expected"), sorted(PINNED.items()))
def test_fingerprint_is_pinned(key: tuple[str, str, bool], expected: str) -> None:
    assert settings(*key).fingerprint() == expected


def test_the_compared_fields_and_their_canonical_form() -> None:
    s = settings("NIXL", "PYTHON", True)
    assert s.peer_compat_fields() == {
        "backend": "NIXL",
        "runtime": "PYTHON",
        "pipelined_transfer": True,
    }
    fp = s.fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0 and fp == fp.lower()


def test_settings_peers_need_not_share_leave_the_fingerprint_alone() -> None:
    base = settings("NIXL", "PYTHON", False)
    other = settings(
        "NIXL",
        "PYTHON",
        False,
        runtime_reason="another reason",
        bounce_buffer_mb=64,
        admission_window_blocks=12,
        kv_transfer_timeout_ms=1,
        kv_transfer_poll_interval_ms=7,
        max_tokens_in_buffer=96,
        notes=("a note",),
        backend_reason="x",
    )
    assert other.fingerprint() == base.fingerprint() == PINNED[("NIXL", "PYTHON", False)]


def test_each_compared_field_changes_the_fingerprint() -> None:
    base = settings("NIXL", "PYTHON", False)
    for change in (
        {"backend": "UCX"},
        {"runtime": "CPP"},
        {"pipelined_transfer": True},
    ):
        assert dataclasses.replace(base, **change).fingerprint() != base.fingerprint()  # type: ignore[arg-type]


def test_resolved_configs_carry_the_pinned_fingerprints() -> None:
    def resolved(ctc: str) -> ResolvedSettings:
        text = "cache_transceiver_config:\n" + textwrap.indent(textwrap.dedent(ctc), "  ")
        return resolve(load_config_text(text, "fp.yaml"))

    python = resolved("transceiver_runtime: PYTHON\nbackend: NIXL\nkv_transfer_timeout_ms: 60000\n")
    assert python.fingerprint() == PINNED[("NIXL", "PYTHON", False)]
    assert python.to_json_dict()["fingerprint"] == PINNED[("NIXL", "PYTHON", False)]
    cpp = resolved("transceiver_runtime: CPP\nbackend: MPI\n")
    assert cpp.fingerprint() == PINNED[("MPI", "CPP", False)]
