"""Issue 16, small requests: where the four processes' CPU goes, two ways that do not depend
on a sampler's idea of "busy".

`--perf`: `kvxferd bench --small` with `perf record` attached to its two daemons and two
engines for a few seconds of the kvxferd phase; each process's on-CPU samples split by the
shared object they ran in (the interpreter, the kernel, uvloop, asyncio's C module, msgspec,
NIXL/UCX, numpy, libc). A wall-clock sampler (py-spy) counts a process that was preempted
in a write, or is runnable but waiting for a core, as running where it stopped; perf counts
only what ran.

`--calls`: the same run with each of the four processes under cProfile (a sitecustomize on
PYTHONPATH turns it on in the bench's children and writes each profile at exit): Python
function calls per request of each process, and its functions by calls and own time per
request. The call counts are deterministic (the same requests take the same calls on any
host and any load), so they compare two checkouts without noise; the times are cProfile's,
inflated by its per-call cost, and only rank the functions.

`--syscalls`: `perf stat` on each of the four processes for a few seconds of the run:
syscalls, context switches and CPU microseconds a request (requests in the window: the
run's rate times the window), in alternating passes with `--base`.

    .venv/bin/python benchmarks/issue16_small_where.py --perf [--seconds 20]
    .venv/bin/python benchmarks/issue16_small_where.py --calls [--top 25] [--base DIR] [--keep DIR]
    .venv/bin/python benchmarks/issue16_small_where.py --syscalls [--passes 3] [--base DIR]

`--base DIR` (with --calls): another checkout (`git worktree add DIR COMMIT`) measured the
same way, its calls per request beside this tree's.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from issue16_small import GEOMETRY  # 32 KiB blocks, as the issue's small-request runs

ROLES = {"ctx.yaml": "context daemon", "gen.yaml": "generation daemon",
         "role context": "context engine", "role generation": "generation engine"}  # fmt: skip

# Written into a temporary directory put first on the bench's PYTHONPATH: every Python
# process of the run imports it; only the daemons and the engines profile themselves.
SITECUSTOMIZE = """
import atexit, cProfile, os, signal, sys
_out = os.environ.get("KVX_WHERE_PROFILES")
_argv = " ".join(getattr(sys, "orig_argv", sys.argv))
if _out and ("kvxferd.cli run" in _argv or "kvxferd.bench.engine" in _argv):
    _profile = cProfile.Profile()
    # Turned on by SIGUSR2 (the handler runs on the main thread, the event loop's), once
    # the run is under way: start-up and warm-up are not per-request work.
    signal.signal(signal.SIGUSR2, lambda *_: _profile.enable())

    def _dump() -> None:
        _profile.disable()
        _profile.dump_stats(os.path.join(_out, f"{os.getpid()}.prof"))
        with open(os.path.join(_out, f"{os.getpid()}.argv"), "w") as f:
            f.write(_argv)

    atexit.register(_dump)
"""


def bench_cmd(seconds: float) -> list[str]:
    return [sys.executable, "-m", "kvxferd.cli", "bench", "--configs", "nixl-python", "--small",
            *GEOMETRY, "--in-flight", "32", "--seconds", str(seconds), "--verify", "slot",
            "--json", "--no-progress"]  # fmt: skip


def role_of(argv: str) -> str:
    return next((name for key, name in ROLES.items() if key in argv), "?")


def run_bench(seconds: float, tree: str | None, env: dict[str, str]) -> subprocess.Popen[str]:
    full = {**os.environ, **env}
    path = [env.get("PYTHONPATH", ""), tree or "", os.environ.get("PYTHONPATH", "")]
    full["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return subprocess.Popen(
        bench_cmd(seconds), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=full, cwd=tree,
    )  # fmt: skip


def bench_result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"kvxferd bench: exit {proc.returncode}\n{err[-3000:]}")
    row: dict[str, Any] = json.loads(out)["results"][0]
    return row


# ------------------------------------------------------------------------------ perf


def kvxferd_pids() -> dict[int, str]:
    """The bench's daemons and engines now running: pid -> role."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        if "kvxferd.cli run" in args or "kvxferd.bench.engine" in args:
            found[int(pid)] = role_of(args)
    return found


def dso_kind(dso: str) -> str:
    kinds = [("kernel", ("kernel",)), ("interpreter", ("libpython",)), ("uvloop", ("loop.",)),
             ("asyncio C", ("_asyncio",)), ("msgspec", ("_core",)),
             ("NIXL/UCX", ("ucp", "uct", "ucs", "nixl", "plugin_UCX", "_bindings")),
             ("numpy", ("multiarray",)), ("libc", ("libc",))]  # fmt: skip
    return next((kind for kind, keys in kinds if any(k in dso for k in keys)), "other")


def under_way(proc: subprocess.Popen[str]) -> dict[int, str]:
    """The bench's four processes, a few seconds into its kvxferd phase (past the engines'
    start and the warm-up)."""
    deadline = time.monotonic() + 300
    pids: dict[int, str] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        pids = kvxferd_pids()
        if len(pids) == 4:
            break
        time.sleep(0.3)
    if len(pids) != 4:
        proc.kill()
        raise SystemExit(f"did not find the bench's four processes: {pids}")
    time.sleep(3)
    return pids


def perf_split(seconds: float, record_s: float) -> None:
    proc = run_bench(seconds, None, {})
    pids = under_way(proc)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        subprocess.run(
            ["perf", "record", "-F", "499", "-p", ",".join(map(str, pids)), "-o", data,
             "--", "sleep", str(record_s)],
            capture_output=True, check=True,
        )  # fmt: skip
        report = subprocess.run(
            ["perf", "report", "-i", data, "--no-children", "--sort", "pid,dso", "--stdio",
             "-g", "none"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    row = bench_result(proc)
    share: dict[int, dict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(float)
    )
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\d+):\S+\s+(\S+)", line)
        if m:
            share[int(m.group(2))][dso_kind(m.group(3))] += float(m.group(1))
    print(f"kvxferd {row['requests_per_s']:.0f} req/s, bare {row['bare_requests_per_s']:.0f} "
          f"({row['ratio_to_bare_rate']:.3f}x), daemons {row['cpu_ms_per_request']:.3f} ms/req, "
          f"engines {row['engines_cpu_ms_per_request']:.3f} ms/req (perf attached)\n")  # fmt: skip
    kinds = ["interpreter", "kernel", "uvloop", "asyncio C", "msgspec", "NIXL/UCX", "numpy",
             "libc", "other"]  # fmt: skip
    print("| process | share of samples | " + " | ".join(kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    # perf names threads by their own ids: a thread of a daemon (NIXL's progress thread)
    # shows under its id, summed here into "threads".
    threads = {k: v for k, v in share.items() if k not in pids}
    for pid, role in sorted(pids.items(), key=lambda kv: kv[1]):
        total = sum(share[pid].values())
        cells = [f"{100 * share[pid][k] / total:.0f} %" if total else "-" for k in kinds]
        print(f"| {role} | {total:.1f} % | " + " | ".join(cells) + " |")
    rest = sum(sum(v.values()) for v in threads.values())
    print(f"\nother threads of these processes: {rest:.1f} % of the samples")


# -------------------------------------------------------------------------- syscalls

STAT_EVENTS = ["raw_syscalls:sys_enter", "context-switches", "task-clock"]


def perf_stat(pid: int, out: str, record_s: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["perf", "stat", "-x", ",", "-e", ",".join(STAT_EVENTS), "-p", str(pid), "-o", out,
         "--", "sleep", str(record_s)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def stat_run(tree: str | None, seconds: float, record_s: float) -> dict[str, dict[str, float]]:
    """One bench run with `perf stat` attached to each of its four processes for `record_s`
    seconds of the kvxferd phase: per role, each event per request (task-clock as CPU
    microseconds). Requests in the window: the run's rate times the window."""
    proc = run_bench(seconds, tree, {})
    pids = under_way(proc)
    with tempfile.TemporaryDirectory() as tmp:
        stats = {pid: perf_stat(pid, os.path.join(tmp, f"{pid}.csv"), record_s) for pid in pids}
        for each in stats.values():
            each.wait(timeout=record_s + 60)
        counts: dict[int, dict[str, float]] = {}
        for pid in pids:
            with open(os.path.join(tmp, f"{pid}.csv")) as f:
                rows = [line.split(",") for line in f if line[:1].isdigit()]
            counts[pid] = {r[2]: float(r[0]) for r in rows}
    row = bench_result(proc)
    requests = row["requests_per_s"] * record_s
    out = {}
    for pid, role in pids.items():
        c = counts[pid]
        out[role] = {
            "syscalls": c.get("raw_syscalls:sys_enter", 0.0) / requests,
            "switches": c.get("context-switches", 0.0) / requests,
            "cpu_us": c.get("task-clock", 0.0) * 1e3 / requests,  # task-clock is in ms
        }
    out["run"] = {"req/s": row["requests_per_s"], "bare": row["bare_requests_per_s"]}
    return out


def syscalls(seconds: float, record_s: float, passes: int, base: str | None) -> None:
    runs = [("this", None)] + ([("base", os.path.abspath(base))] if base else [])
    got: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name, _ in runs}
    for i in range(passes):
        for name, tree in runs if i % 2 == 0 else runs[::-1]:
            one = stat_run(tree, seconds, record_s)
            got[name].append(one)
            print(f"pass {i + 1} {name}: {one['run']['req/s']:.0f} req/s, bare "
                  f"{one['run']['bare']:.0f}", flush=True)  # fmt: skip
    print("\nmedians over the passes, per request: syscalls / context switches / CPU us")
    print("| process | " + " | ".join(name for name, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for role in ROLES.values():
        cells = []
        for name, _ in runs:
            med = {k: statistics.median(r[role][k] for r in got[name])
                   for k in ("syscalls", "switches", "cpu_us")}  # fmt: skip
            cells.append(f"{med['syscalls']:.2f} / {med['switches']:.2f} / {med['cpu_us']:.0f}")
        print(f"| {role} | " + " | ".join(cells) + " |")


# ----------------------------------------------------------------------------- calls


def profile_run(
    tree: str | None, seconds: float, keep: str | None = None
) -> tuple[dict[str, Any], dict[str, pstats.Stats]]:
    """`keep`: a directory the four profiles are copied into, by role, for a closer look
    (`python -m pstats DIR/context_daemon.prof`)."""
    with tempfile.TemporaryDirectory() as tmp:
        site, out = os.path.join(tmp, "site"), os.path.join(tmp, "profiles")
        os.makedirs(site)
        os.makedirs(out)
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        proc = run_bench(seconds, tree, {"PYTHONPATH": site, "KVX_WHERE_PROFILES": out})
        for pid in under_way(proc):
            os.kill(pid, signal.SIGUSR2)
        row = bench_result(proc)
        stats = {}
        for path in glob.glob(os.path.join(out, "*.prof")):
            with open(path[: -len(".prof")] + ".argv") as f:
                role = role_of(f.read())
            stats[role] = pstats.Stats(path)
            if keep:
                os.makedirs(keep, exist_ok=True)
                shutil.copy(path, os.path.join(keep, role.replace(" ", "_") + ".prof"))
    if len(stats) != 4:
        raise SystemExit(f"expected four profiles, got {sorted(stats)}")
    return row, stats


def short(name: tuple[str, int, str]) -> str:
    path, line, func = name
    path = re.sub(r".*/site-packages/", "", path)
    path = re.sub(r".*/lib/python3\.\d+/", "", path)
    path = re.sub(r"^.*?/kvxferd/", "kvxferd/", path)
    return f"{path}:{line} {func}"


# An engine's report lists every request once the run is over (asdict of each record,
# then JSON): calls made there, and by what is called from there, are not the run's.
def _reporting(name: tuple[str, int, str]) -> bool:
    return bool(re.search(r"/dataclasses\.py$|/copy\.py$|/json/", name[0])) or (
        name[0] == "~" and "TextIOWrapper" in name[2]
    )


Calls = dict[tuple[str, int, str], tuple[int, float]]


def run_calls(stats: pstats.Stats) -> Calls:
    """(calls, own seconds) of each function in the run, less the calls that the end-of-run
    report made (its own functions, and what they called)."""
    out = {}
    for name, (_, nc, tt, _, callers) in stats.stats.items():  # type: ignore[attr-defined]
        if _reporting(name):
            continue
        from_report = [c for caller, c in callers.items() if _reporting(caller)]
        calls = nc - sum(c[1] for c in from_report)
        own = tt - sum(c[2] for c in from_report)
        if calls > 0:
            out[name] = (calls, own)
    return out


# A function each process calls once a request, and only then (not a coroutine: cProfile
# counts each resumption of one as a call): the profiled window's requests.
ANCHORS = {"context daemon": "conclude", "generation daemon": "conclude",
           "context engine": "on_outcome", "generation engine": "on_outcome"}  # fmt: skip
ANCHOR_FILES = {"conclude": "transceiver/sessions.py", "on_outcome": "client/book.py"}


def requests_seen(stats: pstats.Stats, role: str) -> int:
    func = ANCHORS[role]
    for (path, _, name), (_, nc, _, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == func and path.endswith(ANCHOR_FILES[func]):
            return int(nc)
    raise SystemExit(f"{role}: no calls of {func} in its profile (was it turned on?)")


def calls_per_request(calls: Calls, requests: int) -> tuple[float, float]:
    """(calls of Python functions, calls of C functions and methods) per request: a Python
    call costs a frame, a C one (len, dict.get) a small part of that."""
    python = sum(c for name, (c, _) in calls.items() if name[0] != "~")
    native = sum(c for name, (c, _) in calls.items() if name[0] == "~")
    return python / requests, native / requests


def top_functions(calls: Calls, requests: int, top: int) -> list[str]:
    items = calls.items()
    hot = [(nc / requests, tt / requests * 1e6, short(k)) for k, (nc, tt) in items
           if nc / requests >= 0.5]  # fmt: skip
    by_time = sorted(hot, key=lambda r: -r[1])[:top]
    return [f"  {c:6.2f} calls  {t:6.1f} us  {name}" for c, t, name in by_time]


def calls(seconds: float, top: int, base: str | None, keep: str | None = None) -> None:
    runs = [("this", None)] + ([("base", os.path.abspath(base))] if base else [])
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for name, tree in runs:
        row, stats = profile_run(tree, seconds, keep and os.path.join(keep, name))
        print(f"{name}: {row['requests']} requests, {row['requests_per_s']:.0f} req/s under "
              "cProfile")  # fmt: skip
        table[name] = {}
        for role in ROLES.values():
            requests = requests_seen(stats[role], role)
            calls = run_calls(stats[role])
            table[name][role] = calls_per_request(calls, requests)
            py, native = table[name][role]
            print(f"{role}: {py:.0f} Python and {native:.0f} C calls a request over "
                  f"{requests} profiled; by own time (cProfile's us a request):")  # fmt: skip
            print("\n".join(top_functions(calls, requests, top)))
        print()
    print("| process | " + " | ".join(f"{n}: Python / C calls a request" for n, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for role in ROLES.values():
        cells = [f"{table[n][role][0]:.0f} / {table[n][role][1]:.0f}" for n, _ in runs]
        print(f"| {role} | " + " | ".join(cells) + " |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--perf", action="store_true", help="on-CPU samples by shared object")
    mode.add_argument("--calls", action="store_true", help="Python calls per request")
    mode.add_argument(
        "--syscalls", action="store_true", help="syscalls, switches, CPU per request (perf stat)"
    )
    p.add_argument("--passes", type=int, default=3, help="--syscalls: alternating passes")
    p.add_argument("--seconds", type=float, default=None, help="the bench's --seconds")
    p.add_argument("--record", type=float, default=8.0, help="--perf: seconds recorded")
    p.add_argument("--top", type=int, default=25, help="--calls: functions listed per process")
    p.add_argument("--base", help="--calls/--syscalls: another checkout, measured alike")
    p.add_argument("--keep", help="--calls: a directory to keep the profiles in (this/, base/)")
    a = p.parse_args()
    if a.perf:
        perf_split(a.seconds or 20.0, a.record)
    elif a.syscalls:
        syscalls(a.seconds or 12.0, min(a.record, 6.0), a.passes, a.base)
    else:
        calls(a.seconds or 8.0, a.top, a.base, a.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
