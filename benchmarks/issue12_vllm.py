"""Disaggregated vLLM serving through kvxferd, and the same workload through vLLM's own
NixlConnector, in one run (issue 12).

kvxferd side (kvxferd.integrations.vllm.deployment: two daemons over NIXL, a prefill and a
decode vLLM server with KvxferdConnector, the example proxy). The prompts, the request flow
and the summaries are benchmarks/vllm_nixl.py's, so both sides do exactly the same:

- `sequential`: as vllm_nixl.py drives NixlConnector: the prefill request (max_tokens 1),
  then the decode request with the params the prefill returned, one prompt at a time. The
  KV transfer time is the decode daemon's receive, from being posted (the prompt's KV is
  complete by then) to the KV being in decode's blocks (the connector's outcome record).
- `proxy`: kvxferd's own flow (push, generation-first): one streamed request through the
  proxy, which sends both halves at once; the decode instance posts its receive while the
  prefill instance computes. The transfer time is the context daemon's send, from the
  prompt's KV being complete to the decode daemon confirming it landed.

Then vllm_nixl.py runs (its `stock` and `pthr-delay` variants) as a subprocess in vLLM's
environment, on the same prompts, with fresh servers. Every side's decode tokens are
compared with the prefill server answering alone. Ratios are kvxferd over NIXL (each
variant), measured in this run.
The transfer times do not measure the same span: NIXL's is its READ from post to completion
(vLLM's `vllm:nixl_xfer_time_seconds`); kvxferd's includes its control round trip (the
receive's RequestData to the context daemon, the write, the Result back).

    .venv/bin/python benchmarks/issue12_vllm.py --out benchmarks/results/DAY/issue12-vllm.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_nixl as shared  # a sibling script, not a package

from kvxferd.integrations.vllm.deployment import Deployment
from kvxferd.integrations.vllm.launch import VLLM_PYTHON, stream_completion


class DecodeReceiveProbe:
    """The decode connector's record of the request just served (kv_xfer_s: its receive)."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.seen = 0

    def before(self) -> None:
        self.seen = len(self.dep.outcomes("decode"))

    def after(self) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            records = self.dep.outcomes("decode")
            if len(records) > self.seen:
                r = records[-1]
                return {"kv_xfer_s": r["elapsed_ms"] / 1e3, "kv_bytes": r["nbytes"]}
            time.sleep(0.01)
        return {}


def kvxferd_side(prompts: list[list[int]], max_tokens: int, workdir: Path) -> dict[str, Any]:
    # vLLM's default scheduling on prefill, as vllm_nixl.py runs it (the demo and the tests
    # chunk prefill by 64 tokens, which costs this workload's longer prompts several steps).
    dep = Deployment(workdir, prefill_args=[])
    t0 = time.monotonic()
    try:
        dep.start()
        startup = time.monotonic() - t0
        assert dep.prefill is not None and dep.decode is not None
        # Warm-up: the daemons' first contact (NIXL metadata) is not part of any request.
        for _ in range(2):
            stream_completion(dep.proxy_url, prompts[0][:64], 2)
        baseline = shared.run_baseline(dep.prefill.url, prompts, max_tokens=max_tokens)
        tids = [uuid.uuid4().hex for _ in prompts]
        seq = shared.run_workload(
            dep.prefill.url,
            dep.decode.url,
            prompts,
            max_tokens=max_tokens,
            prefill_params=lambda i: {
                "do_remote_decode": True,
                "kvxferd": {"transfer_id": tids[i]},
            },
            probe=DecodeReceiveProbe(dep),
        )
        same_seq = shared.compare_tokens(seq, baseline)
        proxied = []
        for i, prompt in enumerate(prompts):
            got = stream_completion(dep.proxy_url, prompt, max_tokens, cache_salt=f"p{i}-{tids[i]}")
            sent = next(
                (
                    r
                    for r in reversed(dep.outcomes("prefill"))
                    if r["transfer_id"] == got.transfer_id
                ),
                None,
            )
            proxied.append(
                {
                    "index": i,
                    "prompt_tokens": len(prompt),
                    "e2e_ttft_s": got.ttft_s if got.token_ids else None,
                    "decode_total_s": got.total_s,
                    "kv_xfer_s": sent["elapsed_ms"] / 1e3 if sent else None,
                    "tokens": got.token_ids,
                }
            )
        same_proxy = shared.compare_tokens(proxied, baseline)
        return {
            "startup_s": round(startup, 1),
            "sequential": {"summary": shared.summarize(seq), "identical": same_seq, "records": seq},
            "proxy": {
                "summary": shared.summarize(
                    proxied, ("e2e_ttft_s", "decode_total_s", "kv_xfer_s", "baseline_ttft_s")
                ),
                "identical": same_proxy,
                "records": proxied,
            },
        }
    finally:
        dep.stop()


def nixl_side(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    out = workdir / "nixl.json"
    cmd = [
        str(VLLM_PYTHON),
        str(Path(__file__).resolve().parent / "vllm_nixl.py"),
        "--out",
        str(out),
        "--prompts",
        str(args.prompts),
        "--min-tokens",
        str(args.min_tokens),
        "--max-prompt-tokens",
        str(args.max_prompt_tokens),
        "--max-tokens",
        str(args.max_tokens),
        "--variants",
        "stock,pthr-delay",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0 or not out.is_file():
        return {"error": f"vllm_nixl.py exited {run.returncode}: {run.stderr[-2000:]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return dict(result["variants"])


def _p50(summary: dict[str, Any] | None, metric: str) -> float | None:
    row = (summary or {}).get(metric)
    return float(row["p50_ms"]) if isinstance(row, dict) else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--min-tokens", type=int, default=40)
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-nixl", action="store_true", help="skip vLLM's NixlConnector")
    args = p.parse_args()
    prompts = shared.make_prompts(args.prompts, args.min_tokens, args.max_prompt_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="kvxferd-issue12-"))
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": "issue12_vllm",
        "prompt_tokens": [len(x) for x in prompts],
        "max_tokens": args.max_tokens,
        "kvxferd": kvxferd_side(prompts, args.max_tokens, workdir / "kvxferd"),
    }
    if not args.no_nixl:
        result["nixl"] = nixl_side(args, workdir)
    ratios: dict[str, float] = {}
    variants = {k: v for k, v in result.get("nixl", {}).items() if isinstance(v, dict)}
    for variant, data in variants.items():
        nixl = data.get("summary")
        for mode in ("sequential", "proxy"):
            mine = result["kvxferd"][mode]["summary"]
            for metric in ("e2e_ttft_s", "kv_xfer_s"):
                a, b = _p50(mine, metric), _p50(nixl, metric)
                if a is not None and b:
                    ratios[f"{mode}_{metric}_p50_vs_nixl_{variant}"] = round(a / b, 3)
    # The same ratio against each run's own single-instance TTFT (measured on its prefill
    # server with its servers up): load on the host moves both alike.
    sides = {f"kvxferd_{m}": result["kvxferd"][m]["summary"] for m in ("sequential", "proxy")}
    sides.update({f"nixl_{v}": d.get("summary") for v, d in variants.items()})
    for name, summary in sides.items():
        e2e, single = _p50(summary, "e2e_ttft_s"), _p50(summary, "baseline_ttft_s")
        if e2e is not None and single:
            ratios[f"{name}_e2e_ttft_over_single_instance_p50"] = round(e2e / single, 3)
    result["ratios"] = ratios
    result["total_s"] = round(time.monotonic() - t0, 1)
    shared.print_table(
        "kvxferd, sequential (as NixlConnector)", result["kvxferd"]["sequential"]["summary"]
    )
    shared.print_table(
        "kvxferd, through the proxy (push, generation-first)", result["kvxferd"]["proxy"]["summary"]
    )
    for variant, data in variants.items():
        shared.print_table(f"vLLM NixlConnector ({variant})", data["summary"])
    if "error" in result.get("nixl", {}):
        print(f"\nNixlConnector: {result['nixl']['error']}")
    print("\nratios (kvxferd / NixlConnector, p50):", json.dumps(ratios))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
