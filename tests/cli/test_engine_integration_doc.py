"""The complete example of docs/engine-integration.md runs against the shipped configs."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli_harness import KVXFERD
from nixl_harness import nixl_or_skip

nixl_or_skip("needs NIXL (scripts/install.sh)")

ROOT = Path(__file__).resolve().parents[2]


def _start(config: str, sock: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    out = open(log, "wb")  # noqa: SIM115 - the daemon writes it for its lifetime
    proc = subprocess.Popen(
        [
            *KVXFERD,
            "run",
            "--config",
            str(ROOT / config),
            "--api-socket",
            str(sock),
            "--peer-listen",
            "127.0.0.1:0",
            "--http",
            "off",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        found = re.search(r"listening for peers on (\S+)", text)
        if found and " ready" in text:
            return proc, found.group(1)
        assert proc.poll() is None, text[-2000:]
        time.sleep(0.05)
    raise AssertionError(f"{config}: daemon not ready:\n{log.read_text()[-2000:]}")


def test_documented_example_moves_and_checks_the_kv(tmp_path: Path) -> None:
    doc = (ROOT / "docs" / "engine-integration.md").read_text()
    example = re.search(r"```python\n(import numpy.*?)```", doc, re.S)
    assert example, "the complete example is missing from the doc"
    code = example.group(1)
    ctx, ctx_addr = _start("configs/context.yaml", tmp_path / "ctx.sock", tmp_path / "ctx.log")
    gen, _ = _start("configs/generation.yaml", tmp_path / "gen.sock", tmp_path / "gen.log")
    try:
        # Point the example at these daemons instead of the configs' fixed paths and ports.
        code = re.sub(r'CTX_SOCKET = "[^"]*"', f'CTX_SOCKET = "{tmp_path / "ctx.sock"}"', code)
        code = re.sub(r'GEN_SOCKET = "[^"]*"', f'GEN_SOCKET = "{tmp_path / "gen.sock"}"', code)
        code = re.sub(r'CTX_PEER = "[^"]*"', f'CTX_PEER = "{ctx_addr}"', code)
        code = code.replace('"example-ctx-kv"', f'"example-ctx-{tmp_path.name}"')
        code = code.replace('"example-gen-kv"', f'"example-gen-{tmp_path.name}"')
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert "generation: done ok" in run.stdout
        assert "every byte arrived" in run.stdout
    finally:
        for proc in (ctx, gen):
            proc.send_signal(signal.SIGTERM)
        assert ctx.wait(30) == 0 and gen.wait(30) == 0
