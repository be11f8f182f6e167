"""The GPU check's summary: what it prints at its end, from its JSON document.

A line of versions, a table of the steps with their status and figures (a figure that was
not measured is "-"), and each criterion of the pass rule with its ratios and verdict.
"""

from __future__ import annotations

from typing import Any

from kvxferd.bench.gpucheck_spec import GATHER_MIN_RATIO, KVXFERD_MIN_RATIO, SEGMENTS, STEPS
from kvxferd.bench.gpucheck_spec import get as _get
from kvxferd.bench.gpucheck_spec import num as _num


def _f(x: Any, spec: str = ".1f") -> str:
    n = _num(x)
    return "-" if n is None else format(n, spec)


def _verdict_word(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _figures(doc: dict[str, Any]) -> dict[str, str]:
    """One line of figures per step, for the summary table."""
    s = doc["steps"]
    st, dc, nv, fm, kb = (s[k] for k in STEPS)
    setup = f"cuda {st.get('cuda')}, ipc {st.get('ipc_smoke')}, vmm {st.get('vmm_smoke')}"
    if st.get("why"):
        setup += f"; why: {st['why']}"
    copies = [f"memcpy {_f(dc.get('memcpy_gbps'))} GB/s"]
    for way in ("gather", "scatter"):
        for seg in SEGMENTS:
            e = _get(dc, way, seg) or {}
            cupy, kernel = _f(e.get("cupy_gbps")), _f(e.get("kernel_gbps"))
            copies.append(f"{way} {int(seg) // 1024}K {cupy} (kernel {kernel})")
    writes = []
    for k in ("64MiB", "1GiB"):
        w = _get(nv, "writes", k) or {}
        writes.append(
            f"{k} {_f(w.get('gbps'))} GB/s p50 {_f(w.get('p50_ms'), '.2f')} ms "
            f"verified {w.get('verified')}"
        )
    foreign = []
    for k in ("ipc", "vmm"):
        f = fm.get(k) or {}
        foreign.append(
            f"{k}: copy-in {_f(f.get('copy_into_gbps'))} GB/s, register "
            f"{str(f.get('register'))[:40]}, nixl-in {_f(f.get('write_into_gbps'))} "
            f"nixl-out {_f(f.get('write_from_gbps'))}"
        )
    bench = [
        f"{name} {_f(c.get('gbps'))} GB/s p50 {_f(c.get('p50_ms'), '.2f')} "
        f"p99 {_f(c.get('p99_ms'), '.2f')} ms failed {c.get('failed')}"
        for name, c in (kb.get("configs") or {}).items()
    ]
    return {
        "setup": setup,
        "device_copy": ", ".join(copies),
        "nixl_vram": ", ".join(writes),
        "foreign_memory": "; ".join(foreign),
        "kvxferd_bench": ", ".join(bench) or "-",
    }


def summary(doc: dict[str, Any], code: int) -> str:
    host = doc["host"]
    lines = [
        "",
        f"GPU check ({doc['schema']}), {doc['elapsed_s']} s, exit {code}",
        f"  gpu {host.get('gpu')}, cuda runtime {host.get('cuda_runtime')} driver "
        f"{host.get('cuda_driver')}, cupy {host.get('cupy')}, {host.get('nixl_module')} "
        f"{host.get('nixl')}, python {host.get('python')}",
        "",
        f"{'step':<16}{'status':<34}figures",
    ]
    for step, figures in _figures(doc).items():
        status = str(doc["steps"][step].get("status"))
        status = status if len(status) <= 32 else status[:29] + "..."
        lines.append(f"{step:<16}{status:<34}{figures}")
    r, p = doc["ratios"], doc["pass"]
    copies = ", ".join(
        f"{w} {int(seg) // 1024}K {_f(r[f'{w}_vs_memcpy'][seg], '.3f')}"
        for w in ("gather", "scatter")
        for seg in SEGMENTS
    )
    missing = {**doc["skipped"], **doc["errors"]}
    incomplete = ", ".join(f"{k}: {v}" for k, v in missing.items())[:400]
    lines += [
        "",
        f"kvxferd / bare NIXL 1 GiB: {_f(r['kvxferd_vs_nixl_1gib'], '.3f')} "
        f"(need >= {KVXFERD_MIN_RATIO}) -> {_verdict_word(p['kvxferd_ge_0_8_nixl'])}",
        f"gather/scatter / memcpy: {copies} (need >= {GATHER_MIN_RATIO}) -> "
        f"{_verdict_word(p['gather_scatter_ge_half_copy'])}",
        f"failed requests: {'none' if p['no_failed_requests'] else 'some, or not measured'} "
        f"-> {_verdict_word(p['no_failed_requests'])}",
        f"all: {'PASS' if p['all'] else 'not passed'}"
        + (f" (incomplete: {incomplete})" if code == 2 and incomplete else ""),
    ]
    return "\n".join(lines)
