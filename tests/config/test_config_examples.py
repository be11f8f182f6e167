"""Every shipped example in configs/ validates and resolves as its comments say."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvxferd.config import load_config, load_disagg_pair, resolve
from kvxferd.config.loader import is_disagg_text

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXAMPLES = sorted(CONFIGS.glob("*.yaml"))
NATIVE = [p for p in EXAMPLES if not is_disagg_text(p.read_text(), str(p))]


def test_expected_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "context.yaml",
        "generation.yaml",
        "pipelined.yaml",
        "bounce.yaml",
        "staged-ucx.yaml",
        "trtllm-disagg.yaml",
    } <= names


@pytest.mark.parametrize("path", NATIVE, ids=lambda p: p.name)
def test_native_example_validates(path: Path) -> None:
    cfg = load_config(path)
    resolve(cfg)
    assert cfg.daemon.api_socket == f"/tmp/kvxferd-{cfg.daemon.name}.sock"
    assert path.read_text().lstrip().startswith("#"), "examples explain themselves"


@pytest.mark.parametrize(
    ("name", "backend", "runtime", "pipelined", "bounce"),
    [
        ("context.yaml", "NIXL", "PYTHON", False, 0),
        ("generation.yaml", "NIXL", "PYTHON", False, 0),
        ("pipelined.yaml", "NIXL", "PYTHON", True, 0),
        ("bounce.yaml", "NIXL", "PYTHON", False, 256),
        ("staged-ucx.yaml", "UCX", "CPP", False, 0),
    ],
)
def test_example_resolves_as_described(
    name: str, backend: str, runtime: str, pipelined: bool, bounce: int
) -> None:
    settings = resolve(load_config(CONFIGS / name))
    assert (settings.backend, settings.runtime) == (backend, runtime)
    assert settings.pipelined_transfer is pipelined
    assert settings.bounce_buffer_mb == bounce
    assert not settings.notes


def test_context_and_generation_can_share_a_host() -> None:
    ctx, gen = load_config(CONFIGS / "context.yaml"), load_config(CONFIGS / "generation.yaml")
    assert (ctx.engine.role, gen.engine.role) == ("context", "generation")
    assert ctx.daemon.peer_listen_hostport()[1] != gen.daemon.peer_listen_hostport()[1]
    assert ctx.daemon.http_hostport() != gen.daemon.http_hostport()
    assert ctx.daemon.api_socket_path() != gen.daemon.api_socket_path()
    # each names the other as a static peer, at the other's listen address
    assert ctx.daemon.peers[gen.daemon.name] == gen.daemon.peer_listen
    assert gen.daemon.peers[ctx.daemon.name] == ctx.daemon.peer_listen
    assert resolve(ctx).fingerprint() == resolve(gen).fingerprint()


def test_trtllm_example_pair_is_consistent() -> None:
    ctx, gen = load_disagg_pair(CONFIGS / "trtllm-disagg.yaml")
    ctx_settings, gen_settings = resolve(ctx), resolve(gen)
    assert ctx_settings.fingerprint() == gen_settings.fingerprint()
    assert ctx.engine.block_reuse == "disabled" and gen.engine.block_reuse == "all_reusable"
    assert ctx.engine.scheduling == "generation-first"
