"""The bench's table (stdout) and plot (--plot FILE.png)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvxferd.bench.children import BenchError

# How a table writes a value: a format spec ("" for str()) or a function.
Format = str | Callable[[Any], str]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}" if n < 10 * 2**20 else f"{n / 2**20:.0f}"


def header_lines(report: dict[str, Any]) -> list[str]:
    g = report["geometry"]
    h = report["host"]
    lines = [
        f"kvxferd bench ({report['mode']}), {report['date']}",
        f"  geometry  {g['layers']} layers x {g['kv_heads']} KV heads x head_dim "
        f"{g['head_dim']}, {g['tokens_per_block']} tokens/block, {g['dtype']}, {g['layout']} "
        f"({_mib(g['block_bytes'])} MiB per block), blocks {report['block_order']}",
    ]
    if report["mode"] == "small":
        lines.append(
            f"  run       one-block requests, {report['in_flight']} in flight, "
            f"{report['seconds']:g} s per configuration after {report['warmup']} warm-up"
        )
    else:
        lines.append(
            f"  run       {report['requests']} timed + {report['warmup']} warm-up requests per "
            f"length, {report['in_flight']} in flight"
        )
    if report.get("verify") == "slot":
        lines.append(
            "  verify    each slot's blocks filled and checked once per group, as the raw pair "
            "does (--verify slot)"
        )
    else:
        lines.append("  verify    every request's KV filled before its send, every byte checked")
    load = h.get("loadavg_start")
    lines.append(
        f"  host      {h['cpu_count']} CPUs ({h['cpu_model'] or 'unknown'}), Python "
        f"{h['python']}, {h.get('nixl_package', 'nixl-cu12')} {h['nixl_version']}"
        + (f", load average {load[0]:.2f} at the start" if load else "")
    )
    gpu = h.get("gpu")
    if report.get("memory") == "vram" and gpu:
        # Device pools: the memcpy column is then a device-to-device copy.
        lines.append(
            f"  memory    vram on {gpu.get('name') or 'CUDA device 0'} (cupy "
            f"{gpu.get('cupy_version')}, CUDA runtime {gpu.get('cuda_runtime')}, driver "
            f"{gpu.get('cuda_driver')}); memcpy = device-to-device copy"
        )
    return lines


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]  # fmt: skip
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*headers), *(fmt.format(*r) for r in rows)]


def column_table(
    columns: Mapping[str, str],
    results: list[dict[str, Any]],
    default: Format,
    formats: Mapping[str, Format],
) -> list[str]:
    """One row per result; `columns`: the result keys shown, in order, each with its header.
    A value is written as `formats` says for its key, else as `default`."""

    def cell(value: Any, how: Format) -> str:
        if value is None:
            return "-"  # not measured (the JSON's bare_note says why)
        return format(value, how) if isinstance(how, str) else how(value)

    rows = [[cell(r.get(key), formats.get(key, default)) for key in columns] for r in results]
    return _table(list(columns.values()), rows)


_SMALL_COLUMNS = {
    "config": "config",
    "requests": "requests",
    "requests_per_s": "req/s",
    "p50_ms": "p50 ms",
    "p99_ms": "p99 ms",
    "raw_requests_per_s": "raw req/s",
    "raw_p50_ms": "raw p50",
    "raw_p99_ms": "raw p99",
    "ratio_to_raw": "vs raw",
    "bare": "bare",
    "ratio_to_bare_rate": "vs bare rate",
    "p50_minus_bare_ms": "p50 - bare",
    "cpu_ms_per_request": "CPU ms/req",
    "engines_cpu_ms_per_request": "engines ms/req",
    "cores_busy": "cores busy",
}
# Latencies (ms) to the µs, rates whole, the ratio in hundredths.
_SMALL_FORMATS: dict[str, Format] = {
    "config": "",
    "requests": "",
    "requests_per_s": ".0f",
    "raw_requests_per_s": ".0f",
    "ratio_to_raw": ".2f",
    "bare": "",
    "ratio_to_bare_rate": ".2f",
}
_SWEEP_COLUMNS = {
    "config": "config",
    "tokens": "tokens",
    "blocks": "blocks",
    "bytes": "MiB/req",
    "descriptors": "segments",
    "gbps": "GB/s",
    "p50_ms": "p50 ms",
    "p99_ms": "p99 ms",
    "raw_gbps": "raw GB/s",
    "raw_p50_ms": "raw p50",
    "ratio_to_raw": "vs raw",
    "memcpy_gbps": "memcpy GB/s",
    "ratio_to_memcpy": "vs memcpy",
    "bare": "bare",
    "bare_gbps": "bare GB/s",
    "ratio_to_bare": "vs bare",
    "cpu_s_per_gb": "CPU s/GB",
}
# Counts as they are, everything measured in hundredths.
_SWEEP_FORMATS: dict[str, Format] = {
    "config": "",
    "tokens": "",
    "blocks": "",
    "bytes": _mib,
    "descriptors": "",
    "bare": "",
}


def format_table(report: dict[str, Any]) -> str:
    lines = header_lines(report)
    lines.append("")
    if report["mode"] == "small":
        raw = report["raw"]
        lines += column_table(_SMALL_COLUMNS, report["results"], ".3f", _SMALL_FORMATS)
        lines.append(
            f"\nraw NIXL: {raw['requests']} one-block transfers in {raw['seconds']:.2f} s "
            "(post + busy poll in one process); bare: each configuration's own transport "
            "(nixl: this raw pair); CPU: both daemons' utime + stime over the timed requests; "
            "engines: both engines' the same way; cores busy: all four processes' CPU over the "
            "timed wall time"
        )
        return "\n".join(lines)
    lines += column_table(_SWEEP_COLUMNS, report["results"], ".2f", _SWEEP_FORMATS)
    lines.append(
        "\nGB/s: bytes of the timed requests / busy time (union of send-to-completion "
        "intervals); raw: bare NIXL pair, same segments; memcpy: one np.copyto, best of 3;\n"
        "bare: the configuration's own transport in the same run (nixl: the raw pair; "
        "X-rounds: X moving the staged runtime's rounds between two contiguous buffers);\n"
        "CPU s/GB: both daemons' utime + stime over the timed requests, per GB moved"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Bandwidth against request length per configuration, with raw and memcpy (sweep), or
    requests per second per configuration beside raw (small). Needs matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise BenchError(
            f"--plot needs matplotlib, which does not import ({exc}); install it with "
            "`pip install matplotlib` (or kvxferd[plot])"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = report["geometry"]
    title = (
        f"kvxferd bench: {g['layers']}L x {g['kv_heads']}H x {g['head_dim']}, "
        f"{g['tokens_per_block']} tok/block, {g['dtype']}, {g['layout']}, "
        f"{report['in_flight']} in flight"
    )
    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        if report["mode"] == "small":
            names = [r["config"] for r in report["results"]] + ["raw NIXL"]
            values = [r["requests_per_s"] for r in report["results"]]
            values.append(report["raw"]["requests_per_s"])
            ax.bar(names, values, color=["C0"] * (len(names) - 1) + ["C1"])
            ax.set_ylabel("requests/s (one-block requests)")
        else:
            tokens = report["tokens"]
            for name in report["configs"]:
                rs = [r for r in report["results"] if r["config"] == name]
                ax.plot([r["tokens"] for r in rs], [r["gbps"] for r in rs], "o-", label=name)
            ax.plot(tokens, [r["gbps"] for r in report["raw"]], "s--", label="raw NIXL")
            ax.plot(tokens, [r["gbps"] for r in report["memcpy"]], ":", color="gray",
                    label="memcpy")  # fmt: skip
            ax.set_xscale("log")
            ax.set_xticks(tokens, [str(t) for t in tokens])
            ax.minorticks_off()
            ax.set_xlabel("request length (tokens)")
            ax.set_ylabel("GB/s")
            ax.set_ylim(bottom=0)
            ax.legend()
            ax.grid(True, which="both", alpha=0.3)
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        try:
            fig.savefig(path, format="png")
        except OSError as exc:
            raise BenchError(f"cannot write the plot to {path}: {exc}") from exc
    finally:
        plt.close(fig)
