"""The MOONCAKE adapter (kvxferd.backends.mooncake) across real processes on loopback.

Every backend runs in its own child process (this file run as a script:
`python test_mooncake.py child`), driven over JSON lines on stdin/stdout, so
that a peer can be stopped or killed while a write is in flight. Children
are single-threaded, like the daemon's data plane.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
MIB = 1 << 20
SENTINEL = 0xAB
REGION = 40 * MIB  # each child's registered buffer


def _pattern(seed: int, size: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)


# ---------------------------------------------------------------------------
# Child side: one MooncakeBackend, commands from stdin, answers on stdout.
# ---------------------------------------------------------------------------


def _child_main() -> None:
    from kvxferd.backends.base import XferHandle, XferStatus
    from kvxferd.backends.mooncake import MooncakeBackend

    backend: MooncakeBackend | None = None
    buffers: dict[str, np.ndarray] = {}
    registrations: dict[str, object] = {}
    handles: dict[int, XferHandle] = {}

    def segs(pairs: list[list[int]]) -> np.ndarray:
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def addr(name: str, offset: int) -> int:
        return int(buffers[name].ctypes.data) + offset

    def run(cmd: dict[str, Any]) -> dict[str, Any]:
        nonlocal backend
        op = cmd["op"]
        if op == "init":
            backend = MooncakeBackend(
                cmd["agent"], transfer_timeout_ms=cmd.get("timeout_ms"), probe_timeout_s=2.0
            )
            env = {k: v for k, v in os.environ.items() if k.startswith("MC_")}
            return {
                "session": backend.session,
                "env": env,
                "write_timeout_s": backend.write_timeout_s,
            }
        assert backend is not None
        if op == "buffer":
            buf = np.full(cmd["size"], SENTINEL, dtype=np.uint8)
            buffers[cmd["name"]] = buf
            if cmd.get("register", True):
                registrations[cmd["name"]] = backend.register(int(buf.ctypes.data), buf.nbytes)
            return {"address": int(buf.ctypes.data)}
        if op == "deregister":
            backend.deregister(registrations.pop(cmd["name"]))
            return {}
        if op == "metadata":
            return {"metadata": base64.b64encode(backend.metadata()).decode()}
        if op == "add_peer":
            return {"name": backend.add_peer(base64.b64decode(cmd["metadata"]))}
        if op == "remove_peer":
            backend.remove_peer(cmd["peer"])
            return {}
        if op == "fill":
            buf = buffers[cmd["name"]]
            buf[cmd["offset"] : cmd["offset"] + cmd["size"]] = _pattern(cmd["seed"], cmd["size"])
            return {}
        if op == "check":
            # Each (offset, size, seed) holds its pattern; every other byte is the sentinel.
            buf = buffers[cmd["name"]]
            expected = np.full(buf.nbytes, SENTINEL, dtype=np.uint8)
            for offset, size, seed in cmd["spans"]:
                expected[offset : offset + size] = _pattern(seed, size)
            return {"intact": bool(np.array_equal(buf, expected))}
        if op == "digest":
            return {"digest": hashlib.sha256(buffers[cmd["name"]].tobytes()).hexdigest()}
        if op == "post":
            local = segs([[addr(cmd["name"], o), n] for o, n in cmd["local"]])
            remote = segs(cmd["remote"])
            handle, status = backend.post_write(
                local, remote, cmd["peer"], base64.b64decode(cmd.get("notif", ""))
            )
            handles[cmd["id"]] = handle
            return {"handle": cmd["id"], "status": status.name}
        if op == "poll":
            return {"status": backend.poll(handles[cmd["handle"]]).name}
        if op == "wait":
            # Poll until the write ends or the deadline passes (then report IN_PROGRESS).
            handle = handles[cmd["handle"]]
            deadline = time.monotonic() + cmd["deadline"]
            status = XferStatus.IN_PROGRESS
            while time.monotonic() < deadline:
                status = backend.poll(handle)
                if status is not XferStatus.IN_PROGRESS:
                    break
                time.sleep(0.001)
            return {"status": status.name}
        if op == "release":
            handle = handles[cmd["handle"]]
            backend.release(handle)
            return {"released": handle.released}
        if op == "connect":
            backend.connect(cmd["peer"])
            return {}
        if op == "close":
            backend.close()
            return {}
        raise ValueError(f"unknown op {op}")

    def answer(msg: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    answer({"id": 0, "ok": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        t0 = time.monotonic()
        try:
            res = run(cmd)
            res["ok"] = True
        except Exception as exc:
            res = {"ok": False, "error": type(exc).__name__, "msg": str(exc)}
        res["id"] = cmd["id"]
        res["elapsed"] = time.monotonic() - t0
        answer(res)


# ---------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------


class Child:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
        self._next = 1
        self._read(0, 60.0)

    def _read(self, id_: int, timeout: float) -> dict[str, Any]:
        # The child answers every command in order, one line each.
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer to command {id_} in {timeout}s")
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"child exited ({self.proc.poll()}) before answering {id_}")
            if line.startswith("{"):
                msg: dict[str, Any] = json.loads(line)
                if msg["id"] == id_:
                    return msg

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        id_, self._next = self._next, self._next + 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "id": id_, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(id_, timeout)

    def ok(self, op: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        res = self.call(op, timeout, **kw)
        assert res["ok"], res
        return res

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def ask_exit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.signal(signal.SIGCONT)  # a stopped child must run to exit
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit", "id": -1}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass

    def stop(self) -> None:
        self.ask_exit()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _mooncake_loads() -> bool:
    if importlib.util.find_spec("mooncake") is None:
        return False
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.engine"], capture_output=True, timeout=60
    )
    return probe.returncode == 0


needs_mooncake = pytest.mark.skipif(
    not _mooncake_loads(),
    reason="mooncake-transfer-engine-non-cuda or its Debian libraries are missing "
    "(scripts/install.sh, scripts/system-deps.sh)",
)


class Pair:
    """A sender (a) and a receiver (b), each with a registered REGION-byte buffer
    named "buf", each knowing the other."""

    def __init__(self, timeout_ms: int | None = 20000, env: dict[str, str] | None = None):
        self.a = Child(env)
        self.b = Child(env)
        self.info_a = self.a.ok("init", agent="ctx.1", timeout_ms=timeout_ms)
        self.info_b = self.b.ok("init", agent="gen.1", timeout_ms=timeout_ms)
        self.a.ok("buffer", name="buf", size=REGION)
        self.base_b = self.b.ok("buffer", name="buf", size=REGION)["address"]
        self.peer_b = self.a.ok("add_peer", metadata=self.b.ok("metadata")["metadata"])["name"]
        self.peer_a = self.b.ok("add_peer", metadata=self.a.ok("metadata")["metadata"])["name"]

    def post(self, local: list[list[int]], remote: list[list[int]]) -> dict[str, Any]:
        return self.a.call("post", name="buf", local=local, remote=remote, peer=self.peer_b)

    def write(self, local: list[list[int]], remote_offsets: list[int]) -> dict[str, Any]:
        """Post, wait (deadline-bounded), release; the last answer that failed, else wait's."""
        remote = [[self.base_b + r, n] for r, (_, n) in zip(remote_offsets, local, strict=True)]
        posted = self.post(local, remote)
        if not posted["ok"]:
            return posted
        waited = self.a.call("wait", handle=posted["handle"], deadline=30.0)
        released = self.a.ok("release", handle=posted["handle"])
        assert released["released"]
        return waited

    def close(self) -> None:
        self.a.ask_exit()  # both engines shut down at once
        self.b.ask_exit()
        self.a.stop()
        self.b.stop()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def fresh() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    try:
        yield made
    finally:
        for p in made:
            p.close()


# ---------------------------------------------------------------------------
# Writes.
# ---------------------------------------------------------------------------


@needs_mooncake
def test_writes_of_several_sizes_land_intact(pair: Pair) -> None:
    spans: list[list[int]] = []  # (offset in b, size, seed) of what b must hold
    offset_a = 0
    offset_b = 4096 + 7  # odd offsets: nothing relies on alignment
    for seed, size in enumerate([1, 4096, MIB + 3, 16 * MIB]):
        pair.a.ok("fill", name="buf", offset=offset_a, size=size, seed=seed)
        res = pair.write([[offset_a, size]], [offset_b])
        assert res == {**res, "ok": True, "status": "DONE"}, res
        spans.append([offset_b, size, seed])
        offset_a += size
        offset_b += size + 1  # a sentinel byte between writes: no overrun, no underrun
    assert pair.b.ok("check", name="buf", spans=spans)["intact"]


@needs_mooncake
def test_one_post_with_several_segments(pair: Pair) -> None:
    """Several (local, remote) pairs in one post land where each was sent."""
    dest = pair.b.ok("buffer", name="multi", size=MIB)["address"]
    pair.a.ok("add_peer", metadata=pair.b.ok("metadata")["metadata"])
    sources = [(0, 8192), (MIB, 12345), (3 * MIB, 64)]
    for seed, (offset, size) in enumerate(sources, start=10):
        pair.a.ok("fill", name="buf", offset=offset, size=size, seed=seed)
    at = [0, 100_000, 50_000]  # out of order, non-adjacent
    posted = pair.post(
        [[o, n] for o, n in sources], [[dest + r, n] for r, (_, n) in zip(at, sources, strict=True)]
    )
    assert posted["ok"], posted
    assert pair.a.ok("wait", handle=posted["handle"], deadline=30.0)["status"] == "DONE"
    assert pair.a.ok("release", handle=posted["handle"])["released"]
    spans = [[r, n, seed] for seed, (r, (_, n)) in enumerate(zip(at, sources, strict=True), 10)]
    assert pair.b.ok("check", name="multi", spans=spans)["intact"]


@needs_mooncake
def test_writes_outside_the_peers_registered_memory_are_refused(pair: Pair) -> None:
    pair.a.ok("fill", name="buf", offset=0, size=8192, seed=99)
    # Past the end of b's region, and straddling its end.
    for remote in ([[pair.base_b + REGION + MIB, 4096]], [[pair.base_b + REGION - 4096, 8192]]):
        res = pair.post([[0, 4096 if remote[0][1] == 4096 else 8192]], remote)
        assert not res["ok"] and res["error"] == "TransferError", res
        assert "outside the memory gen.1 registered" in res["msg"], res
    # A local segment outside what a registered is refused as well.
    res = pair.post([[REGION + 4096, 4096]], [[pair.base_b, 4096]])
    assert not res["ok"] and res["error"] == "TransferError", res
    assert "local segment" in res["msg"] and "outside" in res["msg"], res


@needs_mooncake
def test_the_peers_engine_refuses_memory_it_no_longer_registers(fresh: list[Pair]) -> None:
    """Stale metadata passes the local check; b's engine refuses the write itself."""
    p = Pair()
    fresh.append(p)
    extra = p.b.ok("buffer", name="extra", size=MIB)["address"]
    p.a.ok("add_peer", metadata=p.b.ok("metadata")["metadata"])  # a now knows "extra"
    p.b.ok("deregister", name="extra")  # ... which b no longer registers
    before = p.b.ok("digest", name="extra")["digest"]
    p.a.ok("fill", name="buf", offset=0, size=4096, seed=5)
    posted = p.post([[0, 4096]], [[extra, 4096]])
    assert posted["ok"], posted
    res = p.a.call("wait", handle=posted["handle"], deadline=30.0)
    assert not res["ok"] and res["error"] == "TransferError", res
    assert "refused the write" in res["msg"], res
    assert p.a.ok("release", handle=posted["handle"])["released"]
    assert p.b.ok("digest", name="extra")["digest"] == before  # nothing landed


@needs_mooncake
def test_post_refuses_bad_arguments(pair: Pair) -> None:
    res = pair.post([[0, 4096]], [[pair.base_b, 2048]])
    assert not res["ok"] and "lengths differ" in res["msg"], res
    res = pair.a.call(
        "post", name="buf", local=[[0, 64]], remote=[[pair.base_b, 64]], peer="nobody.1"
    )
    assert not res["ok"] and res["error"] == "PeerLostError", res
    res = pair.a.call(
        "post",
        name="buf",
        local=[[0, 64]],
        remote=[[pair.base_b, 64]],
        peer=pair.peer_b,
        notif=base64.b64encode(b"x").decode(),
    )
    assert not res["ok"] and "notification" in res["msg"], res


# ---------------------------------------------------------------------------
# Peers and metadata.
# ---------------------------------------------------------------------------


@needs_mooncake
def test_garbage_metadata_is_refused_clearly(pair: Pair) -> None:
    for junk in (b"", b"\x80\x04pickle", b"[" * 100_000, b'{"kvxferd_mooncake": 2}'):
        res = pair.a.call("add_peer", metadata=base64.b64encode(junk).decode())
        assert not res["ok"] and res["error"] == "TransferError", res
        assert "metadata is invalid" in res["msg"], res
    # A peer on another Mooncake version is refused: "completed" must mean "landed".
    real = json.loads(base64.b64decode(pair.b.ok("metadata")["metadata"]))
    other = json.dumps({**real, "engine": "0.3.6"}).encode()
    res = pair.a.call("add_peer", metadata=base64.b64encode(other).decode())
    assert not res["ok"] and res["error"] == "TransferError", res
    assert "run the same version on both" in res["msg"], res


@needs_mooncake
def test_pools_update_metadata_reaches_new_regions(pair: Pair) -> None:
    """add_peer again with the same peer (a pools update) makes its new memory writable."""
    new = pair.b.ok("buffer", name="late", size=MIB)["address"]
    pair.a.ok("fill", name="buf", offset=0, size=4096, seed=7)
    res = pair.post([[0, 4096]], [[new, 4096]])
    assert not res["ok"] and "outside the memory" in res["msg"], res
    again = pair.a.ok("add_peer", metadata=pair.b.ok("metadata")["metadata"])
    assert again["name"] == pair.peer_b
    posted = pair.post([[0, 4096]], [[new, 4096]])
    assert posted["ok"], posted
    assert pair.a.ok("wait", handle=posted["handle"], deadline=30.0)["status"] == "DONE"
    assert pair.a.ok("release", handle=posted["handle"])["released"]
    intact = pair.b.ok("check", name="late", spans=[[0, 4096, 7]])["intact"]
    assert intact
    pair.b.ok("deregister", name="late")
    pair.a.ok("add_peer", metadata=pair.b.ok("metadata")["metadata"])


@needs_mooncake
def test_removed_peer_takes_no_more_writes(fresh: list[Pair]) -> None:
    p = Pair()
    fresh.append(p)
    p.a.ok("connect", peer=p.peer_b)
    p.a.ok("remove_peer", peer=p.peer_b)
    res = p.post([[0, 64]], [[p.base_b, 64]])
    assert not res["ok"] and res["error"] == "PeerLostError", res
    res = p.a.call("connect", peer=p.peer_b)
    assert not res["ok"] and res["error"] == "PeerLostError", res


# ---------------------------------------------------------------------------
# Failures, release and timeouts.
# ---------------------------------------------------------------------------


@needs_mooncake
def test_killed_peer_fails_the_write_promptly(fresh: list[Pair]) -> None:
    # timeout_ms None: Mooncake keeps its 30 s timeouts, so an error inside the
    # 10 s deadline below comes from the kill, not from a timeout.
    p = Pair(timeout_ms=None)
    fresh.append(p)
    assert p.info_a["write_timeout_s"] == 30
    p.b.signal(signal.SIGSTOP)  # the write cannot finish before the kill
    posted = p.post([[0, 32 * MIB]], [[p.base_b, 32 * MIB]])
    assert posted["ok"] and posted["status"] == "IN_PROGRESS", posted
    p.b.signal(signal.SIGKILL)
    p.b.proc.wait(timeout=10)
    res = p.a.call("wait", handle=posted["handle"], deadline=10.0)
    assert not res["ok"] and res["error"] == "PeerLostError", res
    assert "peer gone" in res["msg"], res
    assert p.a.ok("release", handle=posted["handle"])["released"]
    # A write posted after the kill fails the same way.
    posted = p.post([[0, 4096]], [[p.base_b, 4096]])
    res = posted  # refused at once, or failed when polled
    if posted["ok"]:
        res = p.a.call("wait", handle=posted["handle"], deadline=10.0)
        assert p.a.ok("release", handle=posted["handle"])["released"]
    assert not res["ok"] and res["error"] == "PeerLostError", res


@needs_mooncake
def test_stopped_peer_release_waits_for_mooncakes_timeout(fresh: list[Pair]) -> None:
    # kv_transfer_timeout_ms 2000 -> Mooncake's write timeout 1 s.
    p = Pair(timeout_ms=2000)
    fresh.append(p)
    assert p.info_a["write_timeout_s"] == 1
    p.b.signal(signal.SIGSTOP)
    posted = p.post([[0, 32 * MIB]], [[p.base_b, 32 * MIB]])
    assert posted["ok"], posted
    # In flight: Mooncake cannot cancel, so release refuses and the handle stays.
    refused = p.a.call("release", handle=posted["handle"])
    assert not refused["ok"] and "cannot cancel" in refused["msg"], refused
    res = p.a.call("wait", handle=posted["handle"], deadline=20.0)
    # Stopped, not dead: its engine's port still accepts connections.
    assert not res["ok"] and res["error"] == "TransferError", res
    assert "no progress for 1 s" in res["msg"], res
    released = p.a.ok("release", handle=posted["handle"])
    assert released["released"]
    assert p.a.ok("release", handle=posted["handle"])["released"]  # idempotent
    p.b.signal(signal.SIGCONT)
    # Resumed, the peer takes writes again.
    p.a.ok("fill", name="buf", offset=0, size=4096, seed=3)
    res = p.write([[0, 4096]], [REGION - 4096])
    assert res["ok"] and res["status"] == "DONE", res


# ---------------------------------------------------------------------------
# Start-up: timeouts, hosts, a missing package.
# ---------------------------------------------------------------------------


def _doc(**changes: Any) -> bytes:
    """Valid metadata with some fields changed."""
    doc: dict[str, Any] = {
        "kvxferd_mooncake": 1,
        "agent": "gen.1",
        "session": "127.0.0.1:15001",
        "engine": "0.3.13.post1",
        "regions": [[4096, 4096]],
    }
    return json.dumps({**doc, **changes}).encode()


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        (b"not json", "not JSON"),
        (b"[" * 100_000, "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"kvxferd_mooncake": 2}', "format 2"),
        (b'{"kvxferd_mooncake": 1, "agent": "a", "session": "h:1"}', "fields"),
        (_doc(agent="a b"), "agent"),
        (_doc(engine="0.3; rm -rf"), "engine version"),
        (_doc(session="1.2.3.4"), "HOST:PORT"),
        (_doc(session="0.0.0.0:9"), "IPv4"),
        (_doc(session="h:70000"), "HOST:PORT"),
        (_doc(session=["h", 9]), "session"),
        (_doc(regions=[[True, 4]]), "region"),
        (_doc(regions=[[4096, 0]]), "valid"),
        (_doc(regions=[[1 << 64, 8]]), "valid"),
        (_doc(regions=[[4096, 8], [4100, 8]]), "overlap"),
        (_doc(regions={"a": 1}), "regions"),
        (b"{" + b" " * 300_000 + b"}", "bytes"),
    ],
)
def test_metadata_is_decoded_strictly(doc: bytes, words: str) -> None:
    from kvxferd.backends.mooncake_meta import decode_metadata

    with pytest.raises(ValueError, match=words):
        decode_metadata(doc)


def test_metadata_round_trips() -> None:
    from kvxferd.backends.mooncake_meta import decode_metadata, encode_metadata

    doc = encode_metadata("gen.5f-1a", "127.0.0.1:15001", [(8192, 16), (4096, 8)], "0.3.13")
    meta = decode_metadata(doc)
    assert (meta.agent, meta.session, meta.regions, meta.engine) == (
        "gen.5f-1a",
        "127.0.0.1:15001",
        ((4096, 8), (8192, 16)),
        "0.3.13",
    )


def test_mooncake_timeout_is_half_of_ours_in_whole_seconds() -> None:
    from kvxferd.backends.mooncake_timeouts import mooncake_timeout_s

    assert mooncake_timeout_s(None) is None
    assert mooncake_timeout_s(500) == 1  # Mooncake's granularity
    assert mooncake_timeout_s(2000) == 1
    assert mooncake_timeout_s(20000) == 10
    assert mooncake_timeout_s(60000) == 30
    assert mooncake_timeout_s(600000) == 30  # never above Mooncake's default


@needs_mooncake
def test_timeouts_are_set_before_the_engine_and_the_operator_wins(fresh: list[Pair]) -> None:
    child = Child(env={"MC_TCP_STATUS_TIMEOUT_SEC": "7"})
    try:
        info = child.ok("init", agent="x.1", timeout_ms=20000)
    finally:
        child.stop()
    env = info["env"]
    assert env["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "10"
    assert env["MC_TCP_STATUS_TIMEOUT_SEC"] == "7"
    assert env["MC_TRANSFER_TIMEOUT"] == "10"
    assert info["write_timeout_s"] == 10


@pytest.mark.parametrize(
    ("host", "words"),
    [("0.0.0.0", "wildcard"), ("::1", "IPv6"), ("bad host!", "not an IPv4 address")],
)
def test_hosts_peers_cannot_use_are_refused(host: str, words: str) -> None:
    from kvxferd.backends.mooncake import MooncakeBackend
    from kvxferd.errors import StartupError

    with pytest.raises(StartupError, match=words):
        MooncakeBackend("x.1", host=host)


def test_legacy_unacknowledged_tcp_framing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxferd.backends.mooncake import MooncakeBackend
    from kvxferd.errors import StartupError

    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(StartupError, match="MC_TCP_PROTO=1"):
        MooncakeBackend("x.1")


def test_missing_package_is_a_clear_backend_unavailable_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvxferd.backends import mooncake
    from kvxferd.errors import BackendUnavailableError

    # Set, not deleted: monkeypatch then undoes what the adapter sets (tests/conftest.py).
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")
    monkeypatch.setitem(sys.modules, "mooncake", None)  # what an absent package looks like
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    with pytest.raises(BackendUnavailableError) as info:
        mooncake.MooncakeBackend("x.1")
    msg = str(info.value)
    assert "mooncake-transfer-engine-non-cuda" in msg
    assert "libibverbs1" in msg and "scripts/system-deps.sh" in msg
    assert "not installed" in msg


def test_a_library_that_does_not_load_names_the_debian_packages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvxferd.backends import mooncake
    from kvxferd.errors import BackendUnavailableError

    loader_text = "libibverbs.so.1: cannot open shared object file: No such file or directory"
    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> Any:
        if name.startswith("mooncake"):
            raise ImportError(loader_text)
        return real(name, package)

    # Set, not deleted: monkeypatch then undoes what the adapter sets (tests/conftest.py).
    monkeypatch.setenv("MC_LOG_LEVEL", "WARNING")
    monkeypatch.setattr(mooncake.importlib, "import_module", import_module)
    with pytest.raises(BackendUnavailableError) as info:
        mooncake.MooncakeBackend("x.1")
    msg = str(info.value)
    assert loader_text in msg and "does not load" in msg
    assert "mooncake-transfer-engine-non-cuda" in msg and "scripts/system-deps.sh" in msg


def test_registry_builds_mooncake_lazily() -> None:
    from kvxferd.backends import registry

    assert "MOONCAKE" in registry.available() and not registry.is_two_sided("MOONCAKE")
    assert registry.startup_problem("MOONCAKE", "CPP") is None
    assert "NIXL only" in (registry.startup_problem("MOONCAKE", "PYTHON") or "")


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    _child_main()
