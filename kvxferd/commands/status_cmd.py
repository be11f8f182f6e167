"""`kvxferd status`: what a running daemon reports on /v1/status.

The daemon is named by its configuration file (its `daemon.http` address) or by
HOST:PORT. Prints a short human summary, or the JSON document with --json.
Exits 0 when the daemon answered and is ready, 3 when it answered but is not
ready (starting, draining, or a live peer's transfers stalled), 1 when it cannot be
reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from kvxferd.errors import KvxferdError

EXIT_NOT_READY = 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="show the status of a running daemon")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the daemon's configuration file")
    where.add_argument("--address", metavar="HOST:PORT", help="the daemon's HTTP address")
    p.add_argument("--role", choices=["context", "generation", "both"], help="as for `run`")
    p.add_argument("--json", action="store_true", help="print the JSON status document")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds (default 5)")
    p.set_defaults(handler=_status)


def _address(args: argparse.Namespace) -> str:
    if args.address:
        return str(args.address)
    from kvxferd.config import load_config

    cfg = load_config(args.config, role=args.role)
    hostport = cfg.daemon.http_hostport()
    if hostport is None:
        raise KvxferdError(f"{args.config}: daemon.http is null, so the daemon serves no status")
    host, port = hostport
    if port == 0:
        raise KvxferdError(
            f"{args.config}: daemon.http has port 0 (chosen at start-up); "
            "pass the address the daemon logged with --address"
        )
    # A wildcard listen address is reached on loopback.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def fetch_status(address: str, timeout_s: float) -> dict[str, Any]:
    url = f"http://{address}/v1/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise KvxferdError(f"no kvxferd status at {url}: {reason}") from None
    return doc


def _security(sec: dict[str, Any]) -> str:
    tls = sec.get("tls")
    parts = []
    if tls:
        parts.append(
            f"mutual TLS as {', '.join(tls.get('names') or ['?'])}, "
            f"certificate expires {tls.get('not_after') or '?'}"
        )
    if sec.get("shared_secret"):
        parts.append("shared secret")
    return " + ".join(parts) or "not authenticated, loopback only"


def pool_memory(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each pool's memory row; a daemon older than GPU pools lists ids only (host pools)."""
    rows: dict[str, dict[str, Any]] = doc.get("pool_memory") or {}
    return {pool_id: rows.get(pool_id, {"memory": "host"}) for pool_id in doc.get("pools", [])}


def _pool_line(pool_id: str, row: dict[str, Any]) -> str:
    """ "pool p0: vram cuda:0 (cuda_ipc, copy-only)" or "pool p0: host (memfd)"."""
    if row.get("memory") == "vram":
        how = "zero-copy" if row.get("zero_copy") else "copy-only"
        return f"  pool {pool_id}: vram cuda:{row.get('device')} ({row.get('sharing')}, {how})"
    sharing = row.get("sharing")
    how = ", ".join(x for x in (sharing, pages_label(row.get("pages"))) if x)
    return f"  pool {pool_id}: host" + (f" ({how})" if how else "")


def pages_label(pages: dict[str, Any] | None) -> str:
    """ "hugetlb 2 MiB pages", "4 KiB pages (hugetlb: 0 free 2 MiB pages, ...)" or ""."""
    if not pages:
        return ""
    reason = pages.get("reason")
    return f"{pages.get('label')} pages" + (f" ({reason})" if reason else "")


def regions_line(doc: dict[str, Any]) -> str | None:
    """The daemon's own bounce or staging regions: size and the pages they are on."""
    for name in ("bounce", "staging"):
        regions = doc.get(name)
        if regions:
            where = pages_label(regions.get("pages")) or regions.get("memory", "?")
            mib = regions.get("region_bytes", 0) / (1 << 20)
            return f"  {name} regions: 2 x {mib:.1f} MiB, {where}"
    return None


def discovery_line(disc: dict[str, Any]) -> str:
    """ "discovery: etcd up for 12 s, 4 member(s), registered" or down since, with why."""
    kind = disc.get("kind")
    if kind == "static":
        return f"  discovery: static, {disc.get('members', 0)} configured peer(s)"
    state = "up" if disc.get("up") else "DOWN"
    line = (
        f"  discovery: {kind} {state} for {disc.get('for_s', 0):.0f} s, "
        f"{disc.get('members', 0)} member(s), "
        + ("registered" if disc.get("registered") else "not registered")
    )
    if not disc.get("up") and disc.get("last_error"):
        line += f"; last error: {disc['last_error']}"
    return line


def summary(doc: dict[str, Any]) -> str:
    state = "draining" if doc.get("draining") else "ready" if doc.get("ready") else "not ready"
    settings = doc.get("settings", {})
    lines = [
        f"kvxferd {doc.get('name')} ({doc.get('role')}): {state}",
        f"  version {doc.get('version')}, pid {doc.get('pid')}, "
        f"up {doc.get('uptime_s', 0):.0f} s, incarnation {doc.get('incarnation')}",
        f"  {settings.get('runtime')} runtime over {settings.get('backend')}, "
        f"fingerprint {doc.get('fingerprint')}",
        f"  timeouts: transfer {settings.get('kv_transfer_timeout_ms')} ms, "
        f"sender slice {settings.get('kv_transfer_sender_future_timeout_ms')} ms, "
        f"poll {settings.get('kv_transfer_poll_interval_ms')} ms",
        f"  engine API {doc.get('api_socket')} ({doc.get('engines')} engine(s)), "
        f"peers on {doc.get('peer_listen')} ({_security(doc.get('peer_security') or {})})",
    ]
    for key, seconds in sorted((doc.get("stalled_peers") or {}).items()):
        lines.append(
            f"  STALLED: nothing from peer {key} over the transport for {seconds:.0f} s "
            "although it is alive (docs/backends-mpi.md, 'How the daemon notices')"
        )
    if doc.get("health_problem"):
        lines.append(
            "  UNHEALTHY (/healthz 503, a restart clears it): "
            + "; ".join(doc["health_problem"].splitlines())
        )
    cpu = doc.get("cpu_policy")
    if cpu:  # a daemon from before daemon.cpu_policy says nothing of it
        lines.append(
            f"  CPU scheduling policy {cpu.get('policy') or 'unknown'} "
            f"(daemon.cpu_policy: {cpu.get('configured')})"
        )
    device = doc.get("device")
    if device:
        lines.append(
            f"  GPU pools: cuda:{device.get('cuda_device')} ({device.get('uuid') or 'UUID ?'}), "
            f"CUDA runtime {device.get('cuda_runtime')}, driver {device.get('cuda_driver')}, "
            f"cupy {device.get('cupy') or '?'}, NIXL module {device.get('nixl_module') or '?'}, "
            f"zero-copy {'on' if device.get('zero_copy') else 'off'}"
        )
    lines += [_pool_line(pool_id, row) for pool_id, row in sorted(pool_memory(doc).items())]
    regions = regions_line(doc)
    if regions:
        lines.append(regions)
    disc = doc.get("discovery")
    if disc:
        lines.append(discovery_line(disc))
    peers = doc.get("peers", [])
    lines.append(f"  peers: {len(peers)}")
    lines += [
        f"    {p['name']} ({p['role']}) via {p['address']}"
        + (f", {p['tls']}" if p.get("tls") else "")
        for p in peers
    ]
    for side, counts in doc.get("sessions", {}).items():
        text = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        lines.append(f"  sessions {side}: {text}")
    adm = doc.get("admission", {})
    window = adm.get("window_blocks")
    lines.append(
        f"  admission: {adm.get('in_flight_blocks')} block(s) in flight"
        + (f" of {window}" if window is not None else " (no window)")
        + f", {adm.get('waiting')} waiting"
    )
    holds = doc.get("holds") or {}
    connected = {p.get("name") for p in doc.get("peers") or []}
    if holds.get("requests"):
        lines.append(
            f"  held: {holds['requests']} ended receive(s) keep {holds['blocks']} block(s) and "
            f"{holds['reservation_bytes']} staging byte(s) until their writer is fenced "
            f"(oldest {holds['oldest_s']:.1f} s)"
        )
        lines += [
            f"    {peer}: {row['holds']} hold(s), {row['blocks']} block(s), "
            f"oldest {row['oldest_s']:.1f} s"
            + (
                ""
                if peer in connected
                else f" (not connected; gone for good? kvxferd fence {peer})"
            )
            for peer, row in sorted(holds.get("by_peer", {}).items())
        ]
    else:
        lines.append("  held: none")
    drains = doc.get("drains") or {}
    if drains.get("active"):
        # Writes that ended in flight and could still land: their sends' blocks stay lent.
        lines.append(
            f"  drained writes: {drains['active']} still in flight after their request "
            "ended (their sends' blocks stay lent until the transport ends them)"
        )
    if drains.get("ucx_cma") is False and doc.get("role") in ("context", "both"):
        # An operator who set UCX_TLS=tcp on one host should know what it costs.
        lines.append(
            "  writes to peers on this host: drained, not cancelled, when their request ends "
            "in flight (UCX cannot use CMA here: its UCX_TLS, UCX_SHM_DEVICES or UCX_MODULES, "
            "in the environment or a ucx.conf, ptrace_scope or seccomp, or the backend is "
            "not UCX's)"
        )
    bounce = doc.get("bounce")
    if bounce:
        lines.append(f"  bounce: {json.dumps(bounce, sort_keys=True)}")
    lent = (doc.get("staging") or {}).get("recv_lent_bytes")
    if lent:
        lines.append(
            f"  staging: {lent} receive byte(s) still lent to the transport after their "
            "request ended (an MPI message under way when its peer went)"
        )
    loop = doc.get("event_loop", {})
    lines.append(
        f"  event loop lag: {loop.get('lag_ms')} ms (max {loop.get('max_lag_ms')} ms recently)"
    )
    last = (doc.get("config") or {}).get("last_reload")
    if last:
        line = f"  last reload: {last['result']}"
        if last.get("problems"):
            line += f": {last['problems'][0]}"
        if last.get("restart_needed"):
            line += f"; restart needed for {len(last['restart_needed'])} change(s)"
        lines.append(line)
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    doc = fetch_status(_address(args), args.timeout)
    try:
        if args.json:
            print(json.dumps(doc, indent=2, sort_keys=True))
        else:
            print(summary(doc))
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush stays quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 0 if doc.get("ready") else EXIT_NOT_READY
