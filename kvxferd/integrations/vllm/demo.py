"""`make demo-vllm`: vLLM prefill and decode instances exchanging KV through kvxferd.

Makes the tiny model offline, starts a context and a generation daemon, a prefill and a
decode vLLM OpenAI server (KvxferdConnector) and the example proxy, sends a batch of
completion requests through the proxy, and compares every answer token for token with the
prefill server answering the same prompt alone (a single, non-disaggregated instance).
Prints a summary; exits 1 on any difference or failure.

    .venv/bin/python -m kvxferd.integrations.vllm.demo [--requests 16] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvxferd.bench.stats import percentile
from kvxferd.integrations.vllm.launch import LaunchError, Streamed, require_vllm, stream_completion


def prompts(n: int, seed: int, shortest: int, longest: int) -> list[list[int]]:
    """Token-id prompts of varied lengths (the tiny model's vocabulary is 512)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(5, 500) for _ in range(rng.randint(shortest, longest))] for _ in range(n)
    ]


def run_batch(url: str, batch: list[list[int]], max_tokens: int, in_flight: int) -> list[Streamed]:
    with ThreadPoolExecutor(in_flight) as pool:
        return list(pool.map(lambda p: stream_completion(url, p, max_tokens, 300.0), batch))


def summarize(
    batch: list[list[int]],
    single: list[Streamed],
    disagg: list[Streamed],
    outcomes: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for prompt, one, two in zip(batch, single, disagg, strict=True):
        sent = outcomes.get(two.transfer_id, {})
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "identical": two.status == 200
                and bool(one.token_ids)
                and one.token_ids == two.token_ids,
                "ttft_ms": round(two.ttft_s * 1e3, 2),
                "single_ttft_ms": round(one.ttft_s * 1e3, 2),
                # The context daemon's send: from the prompt's KV being complete to the
                # decode daemon confirming it landed.
                "transfer_ms": round(float(sent.get("elapsed_ms", float("nan"))), 2),
                "kv_bytes": int(sent.get("nbytes", 0)),
                "error": two.error or one.error,
            }
        )

    def stats(key: str) -> dict[str, float]:
        values = [float(r[key]) for r in rows]
        values = [v for v in values if v == v and v != float("inf")]  # no NaN (no record), inf
        return {"p50": round(percentile(values, 50), 2), "p99": round(percentile(values, 99), 2)}

    return {
        "requests": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "ttft_ms": stats("ttft_ms"),
        "single_instance_ttft_ms": stats("single_ttft_ms"),
        "transfer_ms": stats("transfer_ms"),
        "rows": rows,
    }


def print_summary(s: dict[str, Any], startup_s: float) -> None:
    print(f"{'prompt':>7} {'same':>5} {'TTFT ms':>9} {'single':>8} {'xfer ms':>8} {'KV bytes':>9}")
    for r in s["rows"]:
        print(
            f"{r['prompt_tokens']:>7} {'yes' if r['identical'] else 'NO':>5} "
            f"{r['ttft_ms']:>9.1f} {r['single_ttft_ms']:>8.1f} {r['transfer_ms']:>8.1f} "
            f"{r['kv_bytes']:>9}" + (f"  {r['error'][:60]}" if r["error"] else "")
        )
    print(
        f"\n{s['identical']}/{s['requests']} responses identical to a single vLLM instance "
        f"(started in {startup_s:.0f} s)\n"
        f"time to first token through kvxferd: p50 {s['ttft_ms']['p50']} ms, "
        f"p99 {s['ttft_ms']['p99']} ms (single instance p50 "
        f"{s['single_instance_ttft_ms']['p50']} ms)\n"
        f"KV transfer per request: p50 {s['transfer_ms']['p50']} ms, "
        f"p99 {s['transfer_ms']['p99']} ms"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxferd.integrations.vllm.demo")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--in-flight", type=int, default=4, help="requests sent at once")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=800)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--backend", default="NIXL", help="cache_transceiver_config.backend")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--keep", action="store_true", help="keep the logs and configs")
    args = p.parse_args(argv)
    try:
        require_vllm()
    except LaunchError as exc:
        print(f"demo-vllm: {exc}", file=sys.stderr)
        return 2
    from kvxferd.integrations.vllm.deployment import Deployment

    workdir = Path(tempfile.mkdtemp(prefix="kvxferd-vllm-demo-"))
    dep = Deployment(workdir, backend=args.backend)
    ok = False
    try:
        t0 = time.monotonic()
        print(f"starting two daemons and two vLLM servers in {workdir} ...", file=sys.stderr)
        dep.start()
        startup = time.monotonic() - t0
        assert dep.prefill is not None
        batch = prompts(args.requests, args.seed, args.min_prompt, args.max_prompt)
        single = run_batch(dep.prefill.url, batch, args.max_tokens, args.in_flight)
        disagg = run_batch(dep.proxy_url, batch, args.max_tokens, args.in_flight)
        sent = {r["transfer_id"]: r for r in dep.outcomes("prefill") if r["side"] == "send"}
        summary = summarize(batch, single, disagg, sent)
        summary["backend"] = args.backend
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print_summary(summary, startup)
        ok = summary["identical"] == summary["requests"]
    except (LaunchError, OSError) as exc:
        print(f"demo-vllm failed: {exc}", file=sys.stderr)
    finally:
        dep.stop()
        if args.keep or not ok:
            print(f"logs and configs: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
