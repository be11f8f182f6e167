"""GPU pool settings: engine.kv_memory, engine.cuda_device, daemon.device_zero_copy.

They are kvxferd's own (the seed's CacheTransceiverConfig has no such fields), resolved
with the seed's rules: vram needs NIXL and, with the PYTHON runtime, a bounce buffer and
no pipelining. A host daemon's fingerprint must stay byte-identical to what it was before
device pools existed (older peers still pair), and a vram daemon's must differ.
"""

from __future__ import annotations

import hashlib
import json
import textwrap

import pytest

from kvxferd.config import ResolvedSettings, load_config_text, resolve
from kvxferd.config.explain import explain_lines
from kvxferd.errors import ConfigError


def text(ctc: str = "", engine: str = "", daemon: str = "") -> str:
    out = ""
    for name, body in (
        ("cache_transceiver_config", ctc),
        ("engine", engine),
        ("daemon", daemon),
    ):
        if body:
            out += f"{name}:\n" + textwrap.indent(textwrap.dedent(body).strip(), "  ") + "\n"
    return out


def settle(ctc: str = "", engine: str = "", daemon: str = "") -> ResolvedSettings:
    return resolve(load_config_text(text(ctc, engine, daemon), "d.yaml"))


def problems(ctc: str = "", engine: str = "", daemon: str = "") -> list[str]:
    with pytest.raises(ConfigError) as info:
        settle(ctc, engine, daemon)
    return info.value.problems


def old_fingerprint(s: ResolvedSettings) -> str:
    """The fingerprint as every build before device pools computed it (three keys)."""
    fields = {
        "backend": s.backend,
        "runtime": s.runtime,
        "pipelined_transfer": s.pipelined_transfer,
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_defaults_are_host_memory_device_0_and_no_zero_copy() -> None:
    s = settle()
    assert (s.kv_memory, s.cuda_device, s.device_zero_copy) == ("host", 0, False)
    cfg = load_config_text("", "d.yaml")
    assert cfg.engine.kv_memory == "host" and cfg.engine.cuda_device == 0
    assert cfg.daemon.device_zero_copy is False


def test_vram_with_nixl_python_and_a_bounce_buffer_resolves() -> None:
    s = settle(
        "backend: NIXL\ntransceiver_runtime: PYTHON\nkv_cache_bounce_size_mb: 256",
        "kv_memory: vram\ncuda_device: 1",
        "device_zero_copy: true",
    )
    assert (s.kv_memory, s.cuda_device, s.device_zero_copy) == ("vram", 1, True)
    data = s.to_json_dict()
    assert data["kv_memory"] == "vram" and data["cuda_device"] == 1


def test_vram_with_the_cpp_runtime_needs_no_bounce_buffer() -> None:
    s = settle("transceiver_runtime: CPP", "kv_memory: vram")
    assert s.runtime == "CPP" and s.kv_memory == "vram"


@pytest.mark.parametrize("backend", ["UCX", "MPI", "MOONCAKE"])
def test_vram_needs_the_nixl_backend(backend: str) -> None:
    found = problems(f"backend: {backend}\ntransceiver_runtime: CPP", "kv_memory: vram")
    assert len(found) == 1, found
    assert "cache_transceiver_config.backend" in found[0]
    assert "engine.kv_memory is vram" in found[0] and f"backend is {backend}" in found[0]
    assert "set backend: NIXL" in found[0]


def test_vram_with_python_needs_a_bounce_buffer() -> None:
    found = problems("transceiver_runtime: PYTHON", "kv_memory: vram")
    assert len(found) == 1, found
    assert "cache_transceiver_config.kv_cache_bounce_size_mb" in found[0]
    assert "bounce buffer" in found[0] and "transceiver_runtime: CPP" in found[0]


def test_vram_with_python_refuses_pipelining() -> None:
    found = problems(
        "transceiver_runtime: PYTHON\nenable_pipelined_transfer: true",
        "kv_memory: vram\nenable_chunked_prefill: true",
    )
    # Pipelining also needs bounce 0, and vram needs a bounce buffer: both are named, and
    # the vram refusal of pipelining is its own line.
    assert any(
        "enable_pipelined_transfer" in p and "engine.kv_memory is vram" in p for p in found
    ), found
    assert any("kv_cache_bounce_size_mb" in p and "engine.kv_memory" in p for p in found)


def test_every_problem_is_reported_together() -> None:
    found = problems("backend: UCX\ntransceiver_runtime: PYTHON", "kv_memory: vram")
    kinds = {
        "backend": any("device pools move through NIXL" in p for p in found),
        "bounce": any("kv_cache_bounce_size_mb is 0" in p for p in found),
    }
    assert all(kinds.values()), found


@pytest.mark.parametrize(
    ("engine", "fragment"),
    [("kv_memory: gpu", "kv_memory"), ("cuda_device: -1", "cuda_device")],
)
def test_bad_values_are_refused_at_their_path(engine: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(text(engine=engine), "d.yaml")
    assert any(f"engine.{fragment}" in p for p in info.value.problems), info.value.problems


def test_zero_copy_on_a_host_daemon_is_a_note_not_an_error() -> None:
    s = settle(daemon="device_zero_copy: true")
    assert s.kv_memory == "host"
    assert any("daemon.device_zero_copy" in n and "unused" in n for n in s.notes), s.notes


@pytest.mark.parametrize(
    "ctc",
    [
        "",
        "transceiver_runtime: CPP",
        "backend: UCX\ntransceiver_runtime: CPP",
        "kv_cache_bounce_size_mb: 64",
        "transceiver_runtime: PYTHON\nenable_pipelined_transfer: true",
    ],
)
def test_host_fingerprints_are_unchanged(ctc: str) -> None:
    engine = "enable_chunked_prefill: true" if "pipelined" in ctc else ""
    for daemon in ("", "device_zero_copy: true"):
        s = settle(ctc, engine, daemon)
        assert s.fingerprint() == old_fingerprint(s)
        assert "kv_memory" not in s.peer_compat_fields()
        explicit = settle(ctc, engine + "\nkv_memory: host\ncuda_device: 3", daemon)
        assert explicit.fingerprint() == s.fingerprint()


def test_a_vram_fingerprint_differs_and_names_kv_memory() -> None:
    host = settle("kv_cache_bounce_size_mb: 64")
    vram = settle("kv_cache_bounce_size_mb: 64", "kv_memory: vram")
    assert vram.fingerprint() != host.fingerprint()
    assert vram.peer_compat_fields() == {**host.peer_compat_fields(), "kv_memory": "vram"}
    # Staging ordinals and zero-copy are each daemon's own: peers need not agree on them.
    other = settle(
        "kv_cache_bounce_size_mb: 64", "kv_memory: vram\ncuda_device: 2", "device_zero_copy: true"
    )
    assert other.fingerprint() == vram.fingerprint()


def test_explain_names_the_kv_memory() -> None:
    cfg = load_config_text(
        text("kv_cache_bounce_size_mb: 64", "kv_memory: vram\ncuda_device: 1"), "d.yaml"
    )
    lines = explain_lines(cfg, resolve(cfg))
    assert "KV memory:          vram on cuda:1 (zero-copy off)" in lines
    assert any("peer fingerprint" in line and "kv_memory vram" in line for line in lines)
    host = load_config_text("", "d.yaml")
    lines = explain_lines(host, resolve(host))
    assert "KV memory:          host memory (engine.kv_memory: host)" in lines
