"""kvxferd in pods like Kubernetes pods (podman pods: shared IPC, network and UTS; the
engine API socket in a volume both containers mount), the reference engine in a second
container of the same image: a context pod and a generation pod exchange KV over the
podman network, every byte verified; /healthz, /readyz and /metrics answer on the host;
the image's health check, and a stop of the context pod mid-transfer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from container_harness import (
    IMAGE,
    PEER_PORT,
    Pod,
    container_state,
    daemon_config,
    engine_report,
    http_get,
    metric,
    podman,
    poll,
)

from kvxferd.sim.cluster import summarise

pytestmark = pytest.mark.timeout(1800)  # the first test builds the image (minutes, once)

MakePod = Callable[[str], Pod]


def _pair(make_pod: MakePod, **transceiver: Any) -> tuple[Pod, Pod]:
    ctx, gen = make_pod("ctx"), make_pod("gen")
    ctx.create(daemon_config("ctx0", "context", **transceiver))
    gen.create(daemon_config("gen0", "generation", **transceiver))
    for pod in (ctx, gen):
        pod.start_daemon("--log-format", "json")
    for pod in (ctx, gen):
        pod.wait_ready()
    return ctx, gen


def test_two_pods_exchange_verified_kv(make_pod: MakePod) -> None:
    ctx, gen = _pair(make_pod)
    assert ctx.ip != gen.ip
    # The two containers of a pod share /dev/shm (IPC namespace): what the engine's
    # container writes there, the daemon's container sees.
    podman(
        "run", "--rm", "--pod", ctx.name, "--health-interval", "disable",
        "--entrypoint", "python", IMAGE, "-c",
        "open('/dev/shm/kvxferd-pod-check', 'w').write('shared')",
    )  # fmt: skip
    seen = podman("exec", ctx.daemon, "cat", "/dev/shm/kvxferd-pod-check").stdout
    assert seen == "shared"

    workload = ["--requests", "24", "--min-tokens", "1", "--max-tokens", "2048", "--seed", "7"]
    recv = gen.engine("generation", "--peer", f"{ctx.ip}:{PEER_PORT}", *workload)
    send = ctx.engine("context", *workload)
    ctx_report, gen_report = engine_report(send, 180), engine_report(recv, 180)
    summary = summarise(ctx_report, gen_report)
    assert summary["requests"] == 24
    assert summary["verified"] == 24, summary
    assert summary["failed"] == 0 and not summary["first_mismatch"], summary

    # Each daemon's endpoints from the host, through the pod's published port.
    for pod, side in ((ctx, "send"), (gen, "recv")):
        assert http_get(pod.http, "/healthz")[0] == 200
        assert http_get(pod.http, "/readyz")[0] == 200
        status, text = http_get(pod.http, "/metrics")
        assert status == 200
        assert metric(text, "kvxferd_requests_total", side=side, status="done") == 24
        assert metric(text, "kvxferd_transferred_bytes_total", side=side) == summary["bytes"]
        assert metric(text, "kvxferd_ready") == 1
        doc = json.loads(http_get(pod.http, "/v1/status")[1])
        assert doc["ready"] is True
    # The status command inside the container, as docs/operations.md says to run it.
    inside = podman("exec", ctx.daemon, "kvxferd", "status", "--address", "127.0.0.1:9400")
    assert "ctx0" in inside.stdout

    # The image's health check: healthy while the loop runs; a stopped process (a loop
    # that does not answer) is unhealthy; healthy again once it runs.
    assert podman("healthcheck", "run", gen.daemon, check=False).returncode == 0
    podman("kill", "--signal", "STOP", gen.daemon)
    try:
        sick = podman("healthcheck", "run", gen.daemon, check=False, timeout=30)
        assert sick.returncode != 0, sick.stdout + sick.stderr
    finally:
        podman("kill", "--signal", "CONT", gen.daemon)
    poll(
        "health check healthy again",
        lambda: podman("healthcheck", "run", gen.daemon, check=False).returncode == 0 or None,
        30,
        every_s=1.0,
    )

    # SIGTERM from the runtime: a drain, exit 0, well within the grace period.
    podman("stop", "-t", "40", ctx.daemon, timeout=60)
    # Exit 0: it drained and exited on SIGTERM; killed at the grace period's end it would
    # exit 137 (SIGKILL).
    state = container_state(ctx.daemon)
    assert state["ExitCode"] == 0, ctx.logs()[-3000:]
    assert "Traceback" not in ctx.logs()


def test_context_pod_stopped_mid_transfer(make_pod: MakePod) -> None:
    # Short timeouts: the receives posted after the context pod is gone fail within them.
    ctx, gen = _pair(make_pod, kv_transfer_timeout_ms=8000, handshake_timeout_ms=2000)
    n = 48
    workload = ["--requests", str(n), "--tokens", "4096", "--in-flight", "2", "--seed", "11"]
    recv = gen.engine("generation", "--peer", f"{ctx.ip}:{PEER_PORT}", *workload, held_ok=True)
    send = ctx.engine("context", *workload)

    def some_done() -> float | None:
        done = metric(http_get(gen.http, "/metrics")[1], "kvxferd_requests_total", side="recv")
        return done if done >= 2 else None

    done_before = poll("the first transfers done", some_done, 120, every_s=0.1)
    assert done_before < n, "the workload ended before the stop: make it longer"
    # The runtime stops the pod: SIGTERM to both containers, SIGKILL after the grace period.
    podman("pod", "stop", "-t", "40", ctx.name, timeout=90)
    send.communicate(timeout=60)

    # Context side: the daemon drained and exited 0 (not killed at the grace period's
    # end), each failure logged with its reason, nothing crashed.
    state = container_state(ctx.daemon)
    log = ctx.logs()
    assert state["ExitCode"] == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    assert any("draining" in x["msg"] for x in lines), log[-3000:]
    failures = [x for x in lines if x["level"] == "WARNING" and x.get("request_id")]
    assert all(
        any(s in x["msg"] for s in ("failed", "cancelled", "timed_out")) for x in failures
    ), failures

    # Generation side: every request has an outcome; what is done verified byte for byte,
    # the rest failed with a reason; its daemon is still healthy and ready.
    gen_report = engine_report(recv, 150)
    records = gen_report["records"]
    assert len(records) == n
    done = [r for r in records if r["status"] == "done"]
    others = [r for r in records if r["status"] != "done"]
    assert len(done) >= done_before
    assert all(r["verified"] for r in done), [r for r in done if not r["verified"]][:3]
    assert others, "nothing was cut short by the stop"
    assert all(r["status"] in ("failed", "cancelled", "timed_out") for r in others), others[:3]
    assert all(r["reason"] for r in others), others[:3]
    assert http_get(gen.http, "/healthz")[0] == 200
    assert http_get(gen.http, "/readyz")[0] == 200
    text = http_get(gen.http, "/metrics")[1]
    assert metric(text, "kvxferd_requests_total", side="recv", status="done") == len(done)
    # Blocks a write may still reach are held (fenced), never given back on a timer: only
    # failed receives, and the daemon counts exactly those.
    held = [r for r in records if r["blocks_held"]]
    assert all(r["status"] != "done" for r in held), held[:3]
    assert metric(text, "kvxferd_held_requests") == len(held)
