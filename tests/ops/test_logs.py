"""Logs: readable lines by default; `--log-format json` gives one JSON object per
line (ts, level, logger, msg) with the request id of per-request lines."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from typing import Any

from cli_harness import KVXFERD
from daemon_harness import SimEngine

from kvxferd.service.logs import JsonFormatter
from kvxferd.sim.cluster import DaemonProc, LocalCluster


def _json_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_json_log_lines_carry_request_ids(cluster: LocalCluster) -> None:
    config, api_socket = cluster.write_config(
        "ctx", "context", transceiver={"kv_transfer_timeout_ms": 300}
    )
    log_path = cluster.workdir / "ctx.json.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [
                *KVXFERD,
                "run",
                "--config",
                str(config),
                "--log-format",
                "json",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    d = DaemonProc("ctx", "context", config, api_socket, log_path, proc)
    try:
        deadline = time.monotonic() + 60
        while not any(r.get("msg") == "ready" for r in _json_lines(d.log_text())):
            assert d.alive() and time.monotonic() < deadline, d.log_text()[-2000:]
            time.sleep(0.05)

        async def lonely_send() -> None:
            c = await SimEngine.open(d)
            try:
                await c.send("rid-42", 32)  # nobody receives it: times out, logged
                assert (await c.client.wait("rid-42", 30)).reason == "sender_deadline"
            finally:
                await c.close()

        asyncio.run(lonely_send())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if d.alive():
            proc.kill()
            proc.wait(10)
    records = _json_lines(d.log_text())
    ours = [r for r in records if r["logger"].startswith("kvxferd")]
    assert ours and all({"ts", "level", "logger", "msg"} <= set(r) for r in ours)
    assert any(r["msg"].startswith("kvxferd ") and "starting" in r["msg"] for r in ours)
    timed_out = [r for r in ours if r.get("request_id") == "rid-42"]
    assert timed_out and timed_out[0]["level"] == "WARNING", ours
    assert "timed_out" in timed_out[0]["msg"]
    # Only third-party libraries (NIXL prints its own lines) may write anything else.
    kvxferd_text = [
        line
        for line in d.log_text().splitlines()
        if "kvxferd." in line and not line.startswith("{")
    ]
    assert not kvxferd_text, kvxferd_text


def test_json_formatter_fields_and_exceptions() -> None:
    record = logging.LogRecord(
        "kvxferd.sender", logging.WARNING, __file__, 1, "send %s: %s", ("r1", "failed"), None
    )
    record.request_id = "r1"
    doc = json.loads(JsonFormatter().format(record))
    assert doc["level"] == "WARNING" and doc["logger"] == "kvxferd.sender"
    assert doc["msg"] == "send r1: failed" and doc["request_id"] == "r1"
    assert doc["ts"].endswith("+00:00")
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("kvxferd", logging.ERROR, __file__, 1, "x", (), sys.exc_info())
    doc = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in doc["exc"] and "request_id" not in doc
