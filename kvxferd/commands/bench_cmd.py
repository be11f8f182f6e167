"""`kvxferd bench`: the transfer benchmark (daemon path vs bare NIXL vs memcpy)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import textwrap
from typing import Any

from kvxferd.commands.kv_memory import add_kv_memory_args

EXIT_USAGE = 2


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help="measure KV transfer through the daemons beside bare NIXL and memcpy",
        description=textwrap.fill(
            "Moves KV requests between a context and a generation daemon (real processes, "
            "every byte verified) and, in the same run, the same bytes with the same segments "
            "through a bare NIXL agent pair (raw) and one memcpy. Reports GB/s (bytes over busy "
            "time), send-to-completion latency p50/p99, and the ratios to raw and memcpy. "
            "Each configuration is also reported against its own bare transport, measured "
            "right before it (ratio_to_bare: raw NIXL for the PYTHON runtime; for the staged "
            "runtime its backend moving the same staging rounds between two buffers), with "
            "both daemons' CPU seconds per GB moved. "
            "--small measures per-request overhead instead: one-block requests for --seconds.",
            78,
        ),
        formatter_class=_Formatter,
    )
    g = p.add_argument_group("KV geometry (both pools)")
    g.add_argument("--layers", type=int, default=32, help="transformer layers")
    g.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer")
    g.add_argument("--head-dim", type=int, default=128, help="elements per head")
    g.add_argument("--tokens-per-block", type=int, default=32, help="tokens per KV block")
    g.add_argument(
        "--dtype",
        default="float16",
        choices=["float16", "bfloat16", "float32", "float8", "int8"],
        help="KV element type",
    )
    g.add_argument(
        "--layout", choices=["block-major", "layer-major"], default="block-major",
        help="block-major: a block is one contiguous run; layer-major: one run per layer",
    )  # fmt: skip
    m = p.add_argument_group("KV memory")
    add_kv_memory_args(
        m,
        "where both engines' pools live: host (shared memory) or vram (GPU memory, filled "
        "and verified on the device; needs cupy and a CUDA device; NIXL configurations only, "
        "default nixl-python-bounce,nixl-cpp, and the raw pair moves VRAM to VRAM)",
    )
    r = p.add_argument_group("requests")
    r.add_argument(
        "--tokens", default="100,1000,8000", help="request lengths in tokens, comma-separated"
    )
    r.add_argument("--requests", type=int, default=5, help="timed requests per length")
    r.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests per length")
    r.add_argument("--in-flight", type=int, default=1, help="requests outstanding at a time")
    r.add_argument(
        "--configs",
        default=None,
        help="configurations to compare, comma-separated (see the list below); default "
        "nixl-python (with --memory vram: nixl-python-bounce,nixl-cpp)",
    )
    r.add_argument(
        "--backend",
        choices=["DEFAULT", "NIXL", "UCX", "MPI", "MOONCAKE"],
        help="instead of --configs: measure this cache_transceiver_config backend "
        "(with --runtime; default runtime auto)",
    )
    r.add_argument(
        "--runtime",
        choices=["PYTHON", "CPP", "auto"],
        help="instead of --configs: the transceiver_runtime to measure (with --backend; "
        "default backend DEFAULT)",
    )
    r.add_argument(
        "--block-order",
        choices=["shuffled", "sequential"],
        default="shuffled",
        help="shuffled: a request's blocks are scattered over the pool, as in an engine's "
        "cache; sequential: consecutive ids (block-major requests coalesce into one segment)",
    )
    r.add_argument("--seed", type=int, default=1, help="seed of the block lists")
    r.add_argument(
        "--verify",
        choices=["each", "slot"],  # kvxferd.bench.plan VERIFY_CHOICES (not imported: numpy)
        default="each",
        help="each (default): the engines fill every request's KV before its send and check "
        "every byte after it arrives; slot: as the raw pair does with several requests in "
        "flight (and with --small), each slot's blocks are filled once per group and checked "
        "at the group's end, so the engines' content work leaves the comparison",
    )
    s = p.add_argument_group("per-request overhead")
    s.add_argument(
        "--small",
        action="store_true",
        help="one-block requests, --in-flight outstanding, for --seconds: requests/s and "
        "latency, beside raw NIXL doing the same",
    )
    s.add_argument("--seconds", type=float, default=10.0, help="--small: seconds per measurement")
    f = p.add_argument_group("fragmented layout and pipelining (issue 5)")
    f.add_argument(
        "--segment-bytes",
        type=int,
        default=None,
        metavar="N",
        help="with --layout layer-major: choose kv-heads x head-dim so that one (layer, K/V) "
        "piece of a block is N bytes (tokens-per-block x kv-heads x head-dim x itemsize = N; "
        "head-dim kept when it divides); shuffled blocks then move as N-byte segments",
    )
    f.add_argument(
        "--pipeline-compare",
        action="store_true",
        help="the context engine computes each request in chunks and sends each chunk; report "
        "the transfer time left exposed after the last chunk, pipelined vs sequential",
    )
    f.add_argument(
        "--chunk-tokens", type=int, default=512, help="--pipeline-compare: tokens per chunk"
    )
    f.add_argument(
        "--compute-ms",
        type=float,
        default=50.0,
        help="--pipeline-compare: compute time per chunk (the engine sleeps)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    o.add_argument("--plot", metavar="FILE.png", help="draw GB/s against request length")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument(
        "--timeout", type=float, default=900.0, help="seconds allowed per measurement phase"
    )
    o.add_argument("--keep", action="store_true", help="keep the work directory (logs, records)")
    m.add_argument(
        "--huge-pages",
        nargs="?",
        const="auto",
        choices=["auto", "reserve"],
        help="host pools (engines' and raw's) on huge pages, or fail saying what the host "
        "lacks: auto uses what the host has; reserve first reserves hugetlb pages (root) "
        "and restores vm.nr_hugepages afterwards (kvxferd/bench/huge_pages.py)",
    )
    p.epilog = _configs_epilog()
    p.set_defaults(handler=_bench)


def _configs_epilog() -> str:
    from kvxferd.bench.configs import REGISTRY

    lines = ["configurations (--configs):"]
    for c in REGISTRY:
        lines.append(f"  {c.name:<23}{c.description}")
    lines.append(
        "  or --backend B --runtime R: any backend and runtime pair of cache_transceiver_config"
    )
    lines += [
        "",
        "examples:",
        "  kvxferd bench                                   # 100, 1000, 8000 tokens, default",
        "                                                  # geometry (4 MiB blocks)",
        "  kvxferd bench --small --in-flight 32 --seconds 10",
        "  kvxferd bench --layout layer-major --json --plot bench.png",
        "  kvxferd bench --layout layer-major --segment-bytes 4096 --in-flight 2 \\",
        "      --configs nixl-python,nixl-python-bounce   # bounce vs per-block, 4 KiB segments",
        "  kvxferd bench --pipeline-compare --tokens 8000 --chunk-tokens 512 --compute-ms 50",
        "  kvxferd bench --backend UCX --runtime CPP --tokens 1000,8000",
        "  kvxferd bench --memory vram --tokens 8000     # GPU pools, NIXL VRAM (needs a GPU)",
    ]
    return "\n".join(lines)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


class _UsageError(Exception):
    pass


def _positive_int(name: str, value: int, minimum: int = 1) -> int:
    if value < minimum:
        raise _UsageError(f"--{name} must be at least {minimum}, got {value}")
    return value


def _lengths(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise _UsageError(f"--tokens: {part!r} is not an integer") from None
        if value <= 0:
            raise _UsageError(f"--tokens: request lengths must be positive, got {value}")
        if value not in out:
            out.append(value)
    if not out:
        raise _UsageError("--tokens: give at least one request length")
    return out


def _options(args: argparse.Namespace) -> Any:
    from kvxferd.bench.configs import VRAM_DEFAULT, for_memory, resolve
    from kvxferd.bench.plan import Geometry
    from kvxferd.bench.runner import Options
    from kvxferd.memory.layout import LayoutError

    for name in ("layers", "kv_heads", "head_dim", "tokens_per_block", "requests", "in_flight"):
        _positive_int(name.replace("_", "-"), getattr(args, name))
    if args.memory == "vram":
        from kvxferd.sim.device_content import vram_problem

        # First: without a device nothing else about the run matters.
        problem = vram_problem()
        if problem is not None:
            raise _UsageError(problem)
        if args.pipeline_compare:
            raise _UsageError(
                "--pipeline-compare measures the PYTHON runtime's pipelined writes, which "
                "device pools do not take (--memory vram bounces whole requests)"
            )
    _positive_int("warmup", args.warmup, 0)
    if not args.seconds > 0:
        raise _UsageError(f"--seconds must be positive, got {args.seconds}")
    if not args.timeout > 0:
        raise _UsageError(f"--timeout must be positive, got {args.timeout}")
    # The KV geometry flags are named after Geometry's fields.
    geometry = Geometry(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Geometry)})
    try:
        geometry.kv_layout(1)
    except LayoutError as exc:
        raise _UsageError(str(exc)) from None
    if args.segment_bytes is not None:
        from kvxferd.bench.fragmented import SegmentError, segment_geometry

        try:
            geometry = segment_geometry(args.segment_bytes, geometry)
        except SegmentError as exc:
            raise _UsageError(str(exc)) from None
    if args.pipeline_compare:
        if args.small:
            raise _UsageError("--pipeline-compare and --small are two different measurements")
        if args.verify != "each":
            raise _UsageError(
                "--pipeline-compare times each request's prefill chunk by chunk: it fills and "
                "checks every request (--verify each)"
            )
        _positive_int("chunk-tokens", args.chunk_tokens)
        if not args.compute_ms >= 0:
            raise _UsageError(f"--compute-ms must not be negative, got {args.compute_ms}")
        if not [t for t in _lengths(args.tokens) if t > args.chunk_tokens]:
            raise _UsageError(
                f"--pipeline-compare: no --tokens length is longer than one chunk "
                f"(--chunk-tokens {args.chunk_tokens})"
            )
    if args.backend is not None or args.runtime is not None:
        from kvxferd.bench.configs import from_flags

        if args.configs is not None:
            raise _UsageError(
                "--configs names whole configurations; --backend/--runtime build one: "
                "give one or the other"
            )
        configs = [from_flags(args.backend or "DEFAULT", args.runtime or "auto")]
    else:
        default = ",".join(VRAM_DEFAULT) if args.memory == "vram" else "nixl-python"
        configs = resolve((args.configs or default).split(","))
    configs = for_memory(configs, args.memory)
    if not args.small:
        from kvxferd.bench.fragmented import fit_bounce

        configs = fit_bounce(configs, geometry, _lengths(args.tokens), args.in_flight)
    return Options(
        geometry=geometry,
        lengths=_lengths(args.tokens),
        requests=args.requests,
        warmup=args.warmup,
        in_flight=args.in_flight,
        configs=configs,
        small=args.small,
        seconds=args.seconds,
        shuffle=args.block_order == "shuffled",
        seed=args.seed,
        timeout_s=args.timeout,
        keep=args.keep,
        memory=args.memory,
        vram_share=args.vram_share,
        verify=args.verify,
        command="kvxferd " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "",
    )


def _bench(args: argparse.Namespace) -> int:
    from kvxferd.bench.configs import BenchConfigError

    try:
        opts = _options(args)
    except (_UsageError, BenchConfigError) as exc:
        print(f"kvxferd bench: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.plot and args.pipeline_compare:
        print("kvxferd bench: error: --plot does not apply to --pipeline-compare", file=sys.stderr)
        return EXIT_USAGE
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            print(
                "kvxferd bench: error: --plot needs matplotlib, which is not installed; "
                "install it with `pip install matplotlib` (or kvxferd[plot])",
                file=sys.stderr,
            )
            return EXIT_USAGE

    from kvxferd.bench import report as rep
    from kvxferd.bench import runner

    if args.pipeline_compare:
        from kvxferd.bench import pipeline

        popts = pipeline.PipelineOptions(args.chunk_tokens, args.compute_ms)
        result = pipeline.run(opts, popts, progress=not args.no_progress)
        print(json.dumps(result) if args.json else pipeline.format_table(result))
        return 0
    from kvxferd.bench.huge_pages import huge_pages_run, summary_line

    pool_bytes = runner.build_plan(opts, "r").layout().pool_bytes
    with huge_pages_run(args.huge_pages, pool_bytes) as huge:
        result = runner.run(opts, progress=not args.no_progress)
    if huge is not None:
        result["huge_pages"] = huge
        print(summary_line(huge), file=sys.stderr)
    if args.segment_bytes is not None:
        result["segment_bytes"] = args.segment_bytes
    if args.json:
        print(json.dumps(result))
    else:
        from kvxferd.bench.fragmented import summary_lines

        print("\n".join([rep.format_table(result), *summary_lines(result)]))
    if args.plot:
        rep.plot(result, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
