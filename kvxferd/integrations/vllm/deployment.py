"""A disaggregated vLLM deployment on one machine: two kvxferd daemons, a prefill and a
decode vLLM OpenAI server with KvxferdConnector, and the example proxy in front of them.

Used by `make demo-vllm`, the tests and the benchmark. Runs in kvxferd's own environment
(the daemons and the proxy run from it); vLLM runs from its own (launch.VLLM_PYTHON).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvxferd.integrations.vllm.launch import (
    TINY_GEOMETRY,
    LaunchError,
    VllmServer,
    connector_config,
    http_json,
    make_tiny_model,
    start_vllm,
)
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.ports import free_port

#: Prefill runs chunked (64-token chunks), so longer prompts' KV is written over several
#: steps before it is sent.
PREFILL_ARGS = ["--enable-chunked-prefill", "--max-num-batched-tokens", "64"]


@dataclass
class Deployment:
    workdir: Path
    decode_policy: str = "fail"
    backend: str = "NIXL"
    prefill_args: list[str] = field(default_factory=lambda: list(PREFILL_ARGS))
    decode_args: list[str] = field(default_factory=list)
    model_dir: Path | None = None
    cluster: LocalCluster | None = None
    ctx: DaemonProc | None = None
    gen: DaemonProc | None = None
    prefill: VllmServer | None = None
    decode: VllmServer | None = None
    proxy: subprocess.Popen[bytes] | None = None
    proxy_url: str = ""
    ctx_port: int = 0
    # More decode servers (name -> kv_load_failure_policy), not behind the proxy.
    more_decoders: dict[str, str] = field(default_factory=dict)
    decoders: dict[str, VllmServer] = field(default_factory=dict)

    def start(self, timeout_s: float = 420.0) -> Deployment:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir = make_tiny_model(self.workdir / "model")
        self.cluster = LocalCluster(
            self.workdir / "daemons",
            geometry=dict(TINY_GEOMETRY),
            transceiver={"backend": self.backend},
        )
        self.ctx = self.start_ctx()
        self.gen = self.cluster.start_daemon("gen", "generation")
        self.prefill = start_vllm(
            "prefill",
            self.model_dir,
            self.workdir,
            kv_transfer_config=connector_config(
                "kv_producer",
                self.ctx.api_socket,
                engine="vllm-prefill",
                outcome_log=str(self.workdir / "prefill-outcomes.jsonl"),
            ),
            cores="0",
            extra_args=self.prefill_args,
        )
        self.decode = self.start_decode(self.decode_policy)
        for name, policy in self.more_decoders.items():
            self.decoders[name] = self.start_decode(policy, name)
        deadline = time.monotonic() + timeout_s
        for server in (self.prefill, self.decode, *self.decoders.values()):
            server.wait_healthy(max(deadline - time.monotonic(), 1.0))
        self.start_proxy()
        return self

    def start_ctx(self) -> DaemonProc:
        """The context daemon, always on the same peer port: one that restarts is found at
        the address the decode side and the proxy know."""
        assert self.cluster is not None
        if not self.ctx_port:
            self.ctx_port = free_port()
        self.ctx = self.cluster.start_daemon(
            "ctx", "context", daemon={"peer_listen": f"127.0.0.1:{self.ctx_port}"}
        )
        return self.ctx

    def start_decode(self, policy: str, name: str = "decode") -> VllmServer:
        assert self.gen is not None and self.ctx is not None and self.model_dir is not None
        return start_vllm(
            name,
            self.model_dir,
            self.workdir,
            kv_transfer_config=connector_config(
                "kv_consumer",
                self.gen.api_socket,
                policy=policy,
                engine=f"vllm-{name}",
                peer=self.ctx.peer_address,
                outcome_log=str(self.workdir / f"{name}-outcomes.jsonl"),
            ),
            cores="1",
            extra_args=self.decode_args,
        )

    def start_proxy(self, timeout_s: float = 60.0) -> None:
        assert self.prefill is not None and self.decode is not None and self.ctx is not None
        port = free_port()
        log = open(self.workdir / "proxy.log", "ab")  # noqa: SIM115 - the child owns it
        self.proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvxferd.integrations.vllm.proxy",
                "--prefill",
                self.prefill.url,
                "--decode",
                self.decode.url,
                "--prefill-peer",
                self.ctx.peer_address,
                "--decode-peer",
                self.gen.name if self.gen is not None else "",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.proxy_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proxy.poll() is not None:
                raise LaunchError(
                    "the proxy exited:\n" + (self.workdir / "proxy.log").read_text()[-2000:]
                )
            try:
                with urllib.request.urlopen(self.proxy_url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise LaunchError(f"the proxy did not answer within {timeout_s} s")

    @staticmethod
    def status(daemon: DaemonProc) -> dict[str, Any]:
        """The daemon's /v1/status."""
        code, body = http_json(f"http://{daemon.http_address}/v1/status", timeout_s=10)
        if code != 200:
            raise LaunchError(f"daemon {daemon.name}: /v1/status answered {code}: {body}")
        return body

    def outcomes(self, name: str) -> list[dict[str, Any]]:
        """What the connector of vLLM server `name` reported, one record per transfer."""
        path = self.workdir / f"{name}-outcomes.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
        for server in (*self.decoders.values(), self.decode, self.prefill):
            if server is not None:
                server.stop()
        if self.cluster is not None:
            for d in self.cluster.daemons:
                d.stop()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
