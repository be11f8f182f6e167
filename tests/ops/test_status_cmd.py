"""`kvxferd status` and the HTTP endpoint itself: /v1/status fields, /metrics
content type, /healthz, and the CLI by address or by configuration file."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from cli_harness import kvxferd
from ops_harness import http_get

from kvxferd.commands.status_cmd import summary
from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.ports import free_port


def _status_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return kvxferd("status", *args, timeout=60)


def test_status_endpoint_and_cli(cluster: LocalCluster, tmp_path: Path) -> None:
    port = free_port()
    gen = cluster.start_daemon(
        "gen",
        "generation",
        daemon={"http": f"127.0.0.1:{port}"},
        transceiver={"max_tokens_in_buffer": 512},
    )
    code, ctype, body = http_get(gen, "/v1/status")
    assert code == 200 and ctype == "application/json"
    doc = json.loads(body)
    assert doc["ready"] is True and doc["draining"] is False
    assert doc["admission"] == {
        "window_blocks": 16,
        "in_flight_blocks": 0,
        "waiting": 0,
        "use": 0.0,
    }
    assert doc["event_loop"]["lag_ms"] >= 0 and doc["event_loop"]["max_lag_ms"] >= 0
    assert len(doc["fingerprint"]) == 16 and doc["settings"]["fingerprint"] == doc["fingerprint"]
    assert "bounce" in doc and doc["config"]["last_reload"] is None
    assert http_get(gen, "/healthz")[:2] == (200, "text/plain")
    code, ctype, body = http_get(gen, "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    assert "# TYPE kvxferd_requests_total counter" in body
    assert http_get(gen, "/nope")[0] == 404

    # By address: a human summary, or the JSON document.
    human = _status_cli("--address", gen.http_address)
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith("kvxferd gen (generation): ready")
    assert "admission: 0 block(s) in flight of 16, 0 waiting" in human.stdout
    as_json = _status_cli("--json", "--address", gen.http_address)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["name"] == "gen"

    # By configuration file: its daemon.http address.
    by_file = _status_cli("--json", "--config", str(gen.config_path))
    assert by_file.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout)["pid"] == gen.proc.pid

    # A file whose port is chosen at start-up cannot name the daemon.
    ctx_config, _ = cluster.write_config("other", "context")
    chosen = _status_cli("--config", str(ctx_config))
    assert chosen.returncode == 1 and "port 0" in chosen.stderr and "--address" in chosen.stderr

    # Nobody there: a clear error, exit 1, no traceback.
    gen.stop()
    gone = _status_cli("--address", f"127.0.0.1:{port}")
    assert gone.returncode == 1
    assert gone.stderr.startswith("kvxferd: error: no kvxferd status at http://127.0.0.1:")
    assert "Traceback" not in gone.stderr


def test_the_summary_names_stalled_peers() -> None:
    """A daemon whose live peer's transport messages stopped arriving (MPI keepalives,
    docs/backends-mpi.md) says so, and which peer, in its summary."""
    doc = {"name": "gen", "role": "generation", "ready": False, "stalled_peers": {"ctx2/7": 6.4}}
    text = summary(doc)
    assert "gen (generation): not ready" in text
    assert "STALLED: nothing from peer ctx2/7 over the transport for 6 s" in text
    assert "STALLED" not in summary({**doc, "ready": True, "stalled_peers": {}})


def test_the_summary_says_unhealthy_only_with_a_health_problem() -> None:
    doc = {"name": "gen", "role": "generation", "ready": False, "stalled_peers": {"ctx2/7": 75}}
    assert "UNHEALTHY" not in summary({**doc, "health_problem": None})
    text = summary({**doc, "health_problem": "transport: nothing from peer 'ctx2/7' for 75s"})
    line = next(line for line in text.splitlines() if "UNHEALTHY" in line)
    assert "a restart clears it" in line and "'ctx2/7' for 75s" in line


def test_the_summary_says_when_same_host_writes_are_drained() -> None:
    """A context daemon whose UCX cannot use CMA (UCX_TLS=tcp, say) drains, rather than
    cancels, a write to a peer on its host that ends in flight (kvxferd/backends/cma.py)."""
    doc: dict[str, Any] = {"name": "ctx", "role": "context", "ready": True}
    needle = "writes to peers on this host: drained, not cancelled"
    assert needle in summary({**doc, "drains": {"active": 0, "ucx_cma": False}})
    assert needle not in summary({**doc, "drains": {"active": 0, "ucx_cma": True}})
    assert needle not in summary({**doc, "drains": {"active": 0}})  # an older daemon
    gen = {**doc, "role": "generation", "drains": {"active": 0, "ucx_cma": False}}
    assert needle not in summary(gen)  # it writes into nobody
