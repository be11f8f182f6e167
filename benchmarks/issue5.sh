#!/usr/bin/env bash
# The measurements of docs/benchmarks.md for issue 5. Writes one JSON object per run into
# benchmarks/results/<UTC date>/ and prints the tables. Parts (PARTS, default all three):
#   bounce    the fragmented layer-major layout with and without the bounce buffer (4 KiB and
#             8 KiB segments, 1, 2 and 4 requests in flight), then the same bytes as ONE
#             segment per request (block-major, sequential blocks): raw NIXL's one-descriptor
#             write, to set beside its 4 KiB-segment write in the runs before
#   bound     what bounds the bounce path here: per-block write, one-descriptor write,
#             gather + write + scatter and pipelined variants, in one NIXL process pair
#   pipeline  --pipeline-compare
#
# Usage: [PARTS="bounce bound"] [TAG=pass1] benchmarks/issue5.sh [extra kvxferd bench options]
# TAG suffixes the JSON names, so several passes of one day keep their files.
# Run it on a quiet machine: every other process competes for the same cores.
set -euo pipefail
cd "$(dirname "$0")/.."
kvxferd=${KVXFERD:-.venv/bin/kvxferd}
python=${PYTHON:-.venv/bin/python}
parts=${PARTS:-bounce bound pipeline}
suffix=${TAG:+-$TAG}
out=benchmarks/results/$(date -u +%Y-%m-%d)
mkdir -p "$out"

run() {
    local name=$1$suffix
    shift
    echo "== kvxferd bench $* $EXTRA" >&2
    # shellcheck disable=SC2086
    "$kvxferd" bench "$@" $EXTRA --json >"$out/$name.json"
    "$python" - "$out/$name.json" <<'EOF'
import json, sys
from kvxferd.bench import fragmented, pipeline, report
r = json.load(open(sys.argv[1]))
if r["mode"] == pipeline.MODE:
    print(pipeline.format_table(r), end="\n\n")
else:
    print("\n".join([report.format_table(r), *fragmented.summary_lines(r)]), end="\n\n")
EOF
}

EXTRA="$*"
if [[ " $parts " == *" bounce "* ]]; then
    BOUNCE=(--layout layer-major --configs nixl-python,nixl-python-bounce --tokens 1000,8000
            --requests 10)
    for seg in 4096 8192; do
        for n in 1 2 4; do
            run "fragmented-$seg-if$n" "${BOUNCE[@]}" --segment-bytes "$seg" --in-flight "$n"
        done
    done
    # The 4 KiB runs' geometry (1 KV head x head_dim 64, 256 KiB blocks), block-major with
    # sequential blocks: every request is one segment, which raw NIXL writes as one descriptor.
    run contiguous-4096 --kv-heads 1 --head-dim 64 --block-order sequential \
        --configs nixl-python --tokens 1000,8000 --requests 10
fi
if [[ " $parts " == *" bound "* ]]; then
    echo "== the bounce path's bound (one NIXL process pair)" >&2
    bound_py=$(mktemp --suffix .py)
    trap 'rm -f "$bound_py"' EXIT
    cat >"$bound_py" <<'EOF'
"""Issue 5: what bounds the bounce buffer on this host (two processes, NIXL over UCX).

Same geometry as `kvxferd bench --layout layer-major --segment-bytes 4096 --tokens 8000`:
250 shuffled blocks of a 258-block layer-major pool of 4 KiB pieces (62.5 MiB, 16,000
pieces), pools in /dev/shm, bounce regions anonymous and populated, as in the daemons.
Per trial, interleaved, one process pair:
  per-block   one NIXL WRITE of the 16,000 piece pairs, pool to pool
  one-write   one NIXL WRITE of one 62.5 MiB descriptor, region to region (no copy)
  bounce      HostCopier.gather, the one write, HostCopier.scatter (today's path, no
              asyncio or messages: a floor for the daemon's)
  pipe-K-tN   K chunks: gather(k+1) on a thread while write(k) runs, scatter(k) as soon
              as the receiver hears k landed; tN: copier threads
and, once, the CPU time each thread of the writing process spends per write.
Every byte of every per-block and bounce trial is checked. Prints a table; --json FILE.
"""

import argparse
import concurrent.futures as cf
import json
import mmap
import multiprocessing as mp
import os
import statistics as st
import time

import numpy as np

from kvxferd.backends.base import XferStatus
from kvxferd.backends.nixl import NixlBackend
from kvxferd.memory.layout import LAYER_MAJOR, KvLayout, pair_segments
from kvxferd.memory.shm import ShmRegion
from kvxferd.transceiver.bounce import HostCopier

L = KvLayout(
    num_layers=32,
    kv_factor=2,
    num_kv_heads=1,
    head_dim=64,
    tokens_per_block=32,
    dtype="float16",
    major=LAYER_MAJOR,
    num_blocks=258,
)
NBLK = 250
BB = L.block_bytes
NB = NBLK * BB
_rng = np.random.default_rng(1)
SRC = [int(b) for b in _rng.permutation(L.num_blocks)[:NBLK]]
DST = [int(b) for b in _rng.permutation(L.num_blocks)[:NBLK]]
CONTENT = (np.arange(NB, dtype=np.uint32) % 251).astype(np.uint8)


def anon(n):
    m = mmap.mmap(
        -1,
        n,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0),
    )
    return m, np.frombuffer(m, dtype=np.uint8)


def write(b, peer, local, remote):
    h, s = b.post_write(np.asarray(local, np.int64), np.asarray(remote, np.int64), peer)
    while s is XferStatus.IN_PROGRESS:
        s = b.poll(h)
    b.release(h)
    if s is not XferStatus.DONE:
        raise RuntimeError("NIXL reported ERR")


def bounds(k):
    return [NBLK * i // k for i in range(k + 1)]


def receiver(conn):
    b = NixlBackend(f"bound-r-{os.getpid()}")
    pool = ShmRegion.create(f"kvxferd-bound-r-{os.getpid()}", L.pool_bytes)
    pool.unlink()
    _m, region = anon(NB)
    b.register(pool.address, L.pool_bytes)
    b.register(int(region.ctypes.data), NB)
    conn.send((b.metadata(), pool.address, int(region.ctypes.data)))
    copiers = {t: HostCopier(threads=t) for t in (1, 2)}
    while (msg := conn.recv()) != "quit":
        kind, k, threads = msg
        scatter_ms = 0.0
        if kind == "bounce":
            for _ in range(k):
                a, e = conn.recv()
                t = time.perf_counter()
                copiers[threads].scatter(region[a * BB : e * BB], pool.array, L, DST[a:e])
                scatter_ms += (time.perf_counter() - t) * 1e3
        else:
            conn.recv()
        t_end = time.monotonic_ns()
        ok = True
        if kind != "one":
            got = np.empty(NB, np.uint8)
            copiers[2].gather(pool.array, L, DST, got)
            ok = bool(np.array_equal(got, CONTENT))
            pool.array[:] = 0
        conn.send((t_end, ok, scatter_ms))


def thread_cpu():
    out = {}
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[t] = int(fields[11]) + int(fields[12])  # utime + stime, clock ticks
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=11)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    p, c = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(c,))
    proc.start()
    meta, rpool, rregion = p.recv()
    b = NixlBackend(f"bound-s-{os.getpid()}")
    pool = ShmRegion.create(f"kvxferd-bound-s-{os.getpid()}", L.pool_bytes)
    pool.unlink()
    _m, region = anon(NB)
    lreg = int(region.ctypes.data)
    b.register(pool.address, L.pool_bytes)
    b.register(lreg, NB)
    peer = b.add_peer(meta)
    b.connect(peer)
    HostCopier(threads=1).scatter(CONTENT, pool.array, L, SRC)
    lp, rp = pair_segments(L, SRC, L, DST)
    lp[:, 0] += pool.address
    rp[:, 0] += rpool
    copiers = {t: HostCopier(threads=t) for t in (1, 2)}
    ahead = cf.ThreadPoolExecutor(1)
    stages = {"gather_ms": [], "write_ms": [], "scatter_ms": []}

    def finish(t0):
        t_end, ok, scatter_ms = p.recv()
        if not ok:
            raise RuntimeError("a byte differs")
        return (t_end - t0) / 1e6, scatter_ms

    def per_block():
        p.send(("per-block", 1, 0))
        time.sleep(0.005)
        t0 = time.monotonic_ns()
        write(b, peer, lp, rp)
        p.send("landed")
        return finish(t0)[0]

    def one_write():
        p.send(("one", 1, 0))
        time.sleep(0.005)
        t0 = time.monotonic_ns()
        write(b, peer, [[lreg, NB]], [[rregion, NB]])
        p.send("landed")
        return finish(t0)[0]

    def bounce(k, threads, record=False):
        p.send(("bounce", k, threads))
        time.sleep(0.005)
        cut = bounds(k)
        copier = copiers[threads]

        def gather(i):
            a, e = cut[i], cut[i + 1]
            copier.gather(pool.array, L, SRC[a:e], region[a * BB : e * BB])

        t0 = time.monotonic_ns()
        gather(0)
        t1 = time.monotonic_ns()
        for i in range(k):
            nxt = ahead.submit(gather, i + 1) if i + 1 < k else None
            a, e = cut[i], cut[i + 1]
            write(
                b,
                peer,
                [[lreg + a * BB, (e - a) * BB]],
                [[rregion + a * BB, (e - a) * BB]],
            )
            p.send((a, e))
            if nxt is not None:
                nxt.result()
        t2 = time.monotonic_ns()
        total, scatter_ms = finish(t0)
        if record:
            stages["gather_ms"].append((t1 - t0) / 1e6)
            stages["write_ms"].append((t2 - t1) / 1e6)
            stages["scatter_ms"].append(scatter_ms)
        return total

    cases = {
        "per-block": per_block,
        "one-write": one_write,
        "bounce": lambda: bounce(1, 2, record=True),
        "bounce-t1": lambda: bounce(1, 1),
        "pipe-4-t1": lambda: bounce(4, 1),
        "pipe-16-t1": lambda: bounce(16, 1),
        "pipe-4-t2": lambda: bounce(4, 2),
    }
    for f in cases.values():
        f()  # warm-up
    for v in stages.values():
        v.clear()
    ms = {n: [] for n in cases}
    for _ in range(args.trials):
        for n, f in cases.items():
            ms[n].append(f())
    # CPU per thread of this (writing) process during one-descriptor writes.
    c0, t0 = thread_cpu(), time.perf_counter()
    for _ in range(10):
        write(b, peer, [[lreg, NB]], [[rregion, NB]])
    wall = (time.perf_counter() - t0) * 100
    c1, tick = thread_cpu(), os.sysconf("SC_CLK_TCK")
    cpu = sorted(((c1[t] - c0.get(t, 0)) * 100 / tick for t in c1), reverse=True)
    p.send("quit")
    proc.join()
    med = {n: st.median(v) for n, v in ms.items()}
    out = {
        "nbytes": NB,
        "segments": len(lp),
        "trials": args.trials,
        "loadavg": os.getloadavg(),
        "median_ms": med,
        "ms": ms,
        "per_block_over": {n: med["per-block"] / m for n, m in med.items()},
        "bounce_stages_median_ms": {k: st.median(v) for k, v in stages.items()},
        "one_write_wall_ms": wall,
        "one_write_cpu_ms_per_thread": [x for x in cpu if x],
    }
    print(
        f"{NB / 2**20:.1f} MiB in {len(lp)} segments of 4 KiB, {args.trials} trials, "
        f"load {os.getloadavg()[0]:.2f} at the end"
    )
    print(f"{'path':11} {'p50 ms':>7} {'min ms':>7} {'per-block / path':>17}")
    for n, v in ms.items():
        print(f"{n:11} {med[n]:7.2f} {min(v):7.2f} {out['per_block_over'][n]:16.2f}x")
    s = out["bounce_stages_median_ms"]
    print(
        f"bounce stages (p50): gather {s['gather_ms']:.2f} ms, write {s['write_ms']:.2f} ms, "
        f"scatter {s['scatter_ms']:.2f} ms"
    )
    print(
        f"one 62.5 MiB write: {wall:.2f} ms wall, CPU per thread of the writer: "
        + ", ".join(f"{x:.1f} ms" for x in out["one_write_cpu_ms_per_thread"])
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
EOF
    # Only the table: NIXL logs each agent's start-up.
    PYTHONPATH=$PWD "$python" "$bound_py" --json "$out/bound$suffix.json" 2>&1 | grep -v "NIXL INFO"
    echo
fi
if [[ " $parts " == *" pipeline "* ]]; then
    run pipeline --pipeline-compare --tokens 1000,8000 --chunk-tokens 512 --compute-ms 50 \
        --requests 10
fi
echo "results in $out" >&2
