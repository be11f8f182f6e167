"""Verified requests over every route (context instance -> generation instance).

A route is one pair of reference engines: the generation engine on the generation
instance's host posts receives naming the context instance's daemons (by name), the
context engine on the context host sends. Their workloads come from the same seed, and
the request ids carry the route (`ctx0-gen1-<seed>-<i>`): request ids are unique per
context instance, and a generation daemon serving two context instances must never see
the same id from both.

Generation-first: the generation engine announces each posted receive on a pipe; a
relay thread here passes it on to the context engine and counts, so that a test can
inject a fault when a round is part-way through (not after a guessed sleep).

The generation engine's records are the outcome of each request (done and verified,
or failed with a reason); `check` says which requests had none, or two, or were wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvxferd.sim.cluster import ClusterError
from kvxferd.sim.hosts.cluster import HostCluster, Instance

# The cluster tests' and benchmark's geometry: small blocks (16 KB per rank at TP 2), so
# a request is a few of them and a run moves many requests rather than many bytes.
CLUSTER_GEOMETRY: dict[str, Any] = {
    "num_layers": 2,
    "num_kv_heads": 4,
    "head_dim": 32,
    "tokens_per_block": 16,
    "dtype": "float16",
    "layout": "block-major",
}

TERMINAL = ("done", "failed", "cancelled", "timed_out")


@dataclass
class Workload:
    requests: int = 100  # per route
    in_flight: int = 4  # receives outstanding per generation engine
    # Sends outstanding per context engine: more, since a send whose receive failed
    # at once (its peer unreachable) waits for its own deadline, and a scheduler does
    # not stop prefilling other requests for it.
    ctx_in_flight: int = 32
    min_tokens: int = 16
    max_tokens: int = 256
    tokens_per_block: int = 16
    seed: int = 1

    def pool_blocks(self, in_flight: int) -> int:
        """A pool for `in_flight` requests at their longest, and three times as many for
        blocks held after failed receives until their daemon releases them."""
        return 4 * in_flight * -(-self.max_tokens // self.tokens_per_block) + 8


@dataclass
class Route:
    ctx: Instance
    gen: Instance
    seed: int
    ctx_proc: Any = None
    gen_proc: Any = None
    announced: int = 0
    ctx_report: dict[str, Any] | None = None
    gen_report: dict[str, Any] | None = None
    ctx_error: str = ""
    gen_error: str = ""

    @property
    def label(self) -> str:
        return f"{self.ctx.name}-{self.gen.name}"


@dataclass
class Outcomes:
    """One round's outcomes, joined by request id over all routes."""

    requests: int = 0
    verified: int = 0
    failed: Counter[str] = field(default_factory=Counter)  # by reason
    failed_routes: Counter[str] = field(default_factory=Counter)  # by route
    wrong: list[str] = field(default_factory=list)  # done but not verified, or duplicated
    lost: list[str] = field(default_factory=list)  # no terminal outcome
    bytes: int = 0
    bytes_by_host: Counter[str] = field(default_factory=Counter)  # generation hosts
    held: int = 0  # outcomes that said a write might still land (fenced before reuse)
    engine_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "verified": self.verified,
            "failed": dict(self.failed),
            "failed_routes": dict(self.failed_routes),
            "wrong": len(self.wrong),
            "lost": len(self.lost),
            "bytes": self.bytes,
            "held_outcomes": self.held,
            "seconds": round(self.seconds, 3),
            "first_wrong": self.wrong[:3],
            "first_lost": self.lost[:3],
            "engine_errors": self.engine_errors[:3],
        }


class Round:
    """Every route of `cluster` at once. start(), optionally wait_announced(), finish()."""

    def __init__(
        self,
        cluster: HostCluster,
        workload: Workload,
        routes: list[tuple[Instance, Instance]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.workload = workload
        pairs = routes or [(c, g) for c in cluster.contexts for g in cluster.generations]
        self.routes = [Route(c, g, workload.seed * 1000 + n) for n, (c, g) in enumerate(pairs)]
        self._lock = threading.Condition()
        self._relays: list[threading.Thread] = []
        self._t0 = 0.0

    @property
    def total(self) -> int:
        return self.workload.requests * len(self.routes)

    @property
    def announced(self) -> int:
        with self._lock:
            return sum(r.announced for r in self.routes)

    def start(self) -> Round:
        w = self.workload
        self._t0 = time.monotonic()
        for route in self.routes:
            common = {
                "requests": w.requests,
                "seed": route.seed,
                "prefix": route.label,
                "min_tokens": w.min_tokens,
                "max_tokens": w.max_tokens,
            }
            notify_r, notify_w = os.pipe()
            wait_r, wait_w = os.pipe()
            route.ctx_proc = self.cluster.engine(
                route.ctx,
                pass_fds=(wait_r,),
                wait_fd=wait_r,
                pool_id=f"to-{route.gen.name}-{route.seed}",
                in_flight=w.ctx_in_flight,
                pool_blocks=w.pool_blocks(w.ctx_in_flight),
                **common,
            )
            route.gen_proc = self.cluster.engine(
                route.gen,
                pass_fds=(notify_w,),
                notify_fd=notify_w,
                pool_id=f"from-{route.ctx.name}-{route.seed}",
                in_flight=w.in_flight,
                pool_blocks=w.pool_blocks(w.in_flight),
                peer=[d.name for d in route.ctx.daemons],
                record_refusals=True,  # a peer gone from discovery fails its requests
                **common,
            )
            os.close(wait_r)
            os.close(notify_w)
            relay = threading.Thread(
                target=self._relay, args=(route, notify_r, wait_w), daemon=True
            )
            relay.start()
            self._relays.append(relay)
        return self

    def _relay(self, route: Route, notify_r: int, wait_w: int) -> None:
        with os.fdopen(notify_r, "rb") as src, os.fdopen(wait_w, "wb", buffering=0) as dst:
            for line in src:
                # The context engine may be gone (its daemon was killed): keep counting.
                with contextlib.suppress(OSError):
                    dst.write(line)
                with self._lock:
                    route.announced += 1
                    self._lock.notify_all()

    def wait_announced(self, count: int, timeout_s: float = 60.0) -> None:
        """Until `count` receives were posted over all routes (a point part-way through)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while sum(r.announced for r in self.routes) < count:
                left = deadline - time.monotonic()
                dead = [d.name for d in self.cluster.all_daemons() if not d.alive()]
                if dead:  # a crash: what it stops will never come
                    raise ClusterError(f"daemon(s) {', '.join(dead)} exited during the round")
                if left <= 0:
                    raise ClusterError(
                        f"only {sum(r.announced for r in self.routes)} of {count} receives "
                        f"posted after {timeout_s} s"
                    )
                self._lock.wait(min(left, 0.5))

    def finish(self, timeout_s: float = 150.0, settle_s: float = 20.0) -> Outcomes:
        """Collects every engine's report (bounded by `timeout_s` in all). A context
        engine whose generation engine died before posting every receive waits for
        announcements that cannot come: it gets `settle_s` for the sends it has, then
        is killed and reported."""
        deadline = time.monotonic() + timeout_s
        for route in self.routes:
            self._collect(route, "gen", deadline)
            ctx_deadline = deadline
            if route.announced < self.workload.requests:
                ctx_deadline = min(deadline, time.monotonic() + settle_s)
            self._collect(route, "ctx", ctx_deadline)
        for relay in self._relays:
            relay.join(10)
        outcomes = check(self.routes)
        outcomes.seconds = time.monotonic() - self._t0
        return outcomes

    @staticmethod
    def _collect(route: Route, side: str, deadline: float) -> None:
        proc = getattr(route, f"{side}_proc")
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += b"\nkilled: still running at the round's deadline"
        if proc.returncode == 0:
            setattr(route, f"{side}_report", json.loads(out.decode()))
        else:
            text = err.decode(errors="replace").strip().splitlines()
            why = text[-1] if text else "(no output)"
            setattr(route, f"{side}_error", f"exited {proc.returncode}: {why}")

    def kill(self) -> None:
        """Kills whatever engine of this round still runs (a test that failed early)."""
        for route in self.routes:
            for proc in (route.ctx_proc, route.gen_proc):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(10)


def check(routes: list[Route]) -> Outcomes:
    """Each request's outcome is its generation engine's record: done and verified, or
    ended with a reason. A request without one is lost; a done one that failed its check
    (or came twice) is wrong. A context engine that died with its daemon is reported,
    not counted: the generation side still says what became of its requests."""
    out = Outcomes()
    for route in routes:
        if route.ctx_error:
            out.engine_errors.append(f"{route.label} context engine {route.ctx_error}")
        if route.gen_report is None:
            out.engine_errors.append(f"{route.label} generation engine {route.gen_error}")
        records = route.gen_report["records"] if route.gen_report else []
        seen: Counter[str] = Counter(r["request_id"] for r in records)
        expected = route.ctx_report["records"] if route.ctx_report else records
        ids = {r["request_id"] for r in expected} | set(seen)
        out.requests += len(ids) if route.gen_report else 0
        out.wrong += [f"{i}: reported {n} times" for i, n in seen.items() if n > 1]
        for rec in records:
            rid = rec["request_id"]
            if rec["status"] not in TERMINAL:
                out.lost.append(f"{rid}: status {rec['status']!r}")
            elif rec["status"] == "done":
                if rec["verified"] and not rec["verify_error"]:
                    out.verified += 1
                    out.bytes += rec["nbytes"]
                    out.bytes_by_host[route.gen.host.name if route.gen.host else "lo"] += rec[
                        "nbytes"
                    ]
                else:
                    out.wrong.append(f"{rid}: done but {rec['verify_error'] or 'not verified'}")
            elif not rec["reason"]:
                out.wrong.append(f"{rid}: {rec['status']} without a reason")
            else:
                out.failed[rec["reason"]] += 1
                out.failed_routes[f"{route.label} {rec['reason']}"] += 1
            out.held += bool(rec.get("blocks_held"))
        if route.gen_report:
            out.lost += [f"{i}: no outcome" for i in ids if i not in seen]
    return out
