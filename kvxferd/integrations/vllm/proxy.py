"""An example router in front of a prefill and a decode vLLM OpenAI server using kvxferd.

    python -m kvxferd.integrations.vllm.proxy --prefill http://P:8100 --decode http://D:8200 \\
        --prefill-peer P_DAEMON_HOST:PORT --port 8000

For each /v1/completions or /v1/chat/completions request it makes a transfer id and sends,
at the same time, the request with `max_tokens` 1 to the prefill server
(`{"do_remote_decode": true, "kvxferd": {"transfer_id": ID}}`) and the request itself to the
decode server (`{"do_remote_prefill": true, "kvxferd": {"transfer_id": ID, "peer": PEER}}`),
and answers with the decode server's response, streamed or not. The decode instance posts its
receive at once; the prefill instance's daemon writes the prompt's KV into it when the prompt
is done (push, generation-first). If the prefill request fails, the decode request is
dropped (vLLM aborts it, the connector cancels its receive) and the client gets the prefill
server's error.

One prompt per request: vLLM returns only the first prompt's kv_transfer_params of a batch.
A client-supplied `kv_transfer_params` is replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvxferd.vllm.proxy")

_ROUTES = ("/v1/completions", "/v1/chat/completions")
TRANSFER_HEADER = "X-Kvxferd-Transfer-Id"


def split_request(
    body: dict[str, Any], transfer_id: str, prefill_peer: str, decode_peer: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prefill body, decode body) for one client request."""
    prefill = dict(body)
    served: dict[str, Any] = {"transfer_id": transfer_id}
    if decode_peer:
        served["peer"] = decode_peer  # only that daemon is served (no squatting)
    prefill.update(
        {
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "kvxferd": served},
        }
    )
    prefill.pop("max_completion_tokens", None)
    prefill.pop("stream_options", None)
    decode = dict(body)
    section = {"transfer_id": transfer_id}
    if prefill_peer:
        section["peer"] = prefill_peer
    decode["kv_transfer_params"] = {"do_remote_prefill": True, "kvxferd": section}
    return prefill, decode


class Proxy:
    def __init__(self, prefill: str, decode: str, prefill_peer: str, decode_peer: str = "") -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.prefill_peer = prefill_peer
        self.decode_peer = decode_peer
        self._session: aiohttp.ClientSession | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response({"error": "the body is not JSON"}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": "the body must be a JSON object"}, status=400)
        if (
            isinstance(body.get("prompt"), list)
            and body["prompt"]
            and not isinstance(body["prompt"][0], int)
        ):
            return web.json_response(
                {"error": "one prompt per request (vLLM returns one prompt's transfer)"},
                status=400,
            )
        transfer_id = uuid.uuid4().hex
        p_body, d_body = split_request(body, transfer_id, self.prefill_peer, self.decode_peer)
        http = await self._http()
        path = request.path
        prefill = asyncio.create_task(self._prefill(http, path, p_body))
        decode = asyncio.create_task(http.post(self.decode + path, json=d_body))
        try:
            # The prefill result decides first: a failed prefill means no KV is coming, and
            # dropping the decode request makes vLLM abort it (its receive is cancelled).
            p_status, p_text = await prefill
            if p_status != 200:
                log.warning("transfer %s: prefill answered %d", transfer_id, p_status)
                return web.Response(status=p_status, text=p_text, content_type="application/json")
            resp = await decode
            # The transfer id names the request in both daemons' logs and metrics.
            headers = {TRANSFER_HEADER: transfer_id}
            try:
                if not body.get("stream"):
                    return web.Response(
                        status=resp.status,
                        text=await resp.text(),
                        content_type="application/json",
                        headers=headers,
                    )
                out = web.StreamResponse(
                    status=resp.status,
                    headers={"Content-Type": "text/event-stream", **headers},
                )
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
            finally:
                resp.release()
        except aiohttp.ClientError as exc:
            return web.json_response({"error": f"decode server: {exc}"}, status=502)
        finally:
            for task in (prefill, decode):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                        await task

    async def _prefill(
        self, http: aiohttp.ClientSession, path: str, body: dict[str, Any]
    ) -> tuple[int, str]:
        try:
            async with http.post(self.prefill + path, json=body) as resp:
                text = await resp.text()
        except aiohttp.ClientError as exc:
            return 502, json.dumps({"error": f"prefill server: {exc}"})
        if resp.status == 200:
            try:
                finish = json.loads(text)["choices"][0].get("finish_reason")
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                finish = None
            if finish == "error":  # vLLM answers 200 for an engine-side error
                return 502, json.dumps({"error": "the prefill instance failed the request"})
        return resp.status, text

    async def passthrough(self, request: web.Request) -> web.Response:
        http = await self._http()
        async with http.get(self.decode + request.path) as resp:
            return web.Response(
                status=resp.status, body=await resp.read(), content_type=resp.content_type
            )


def make_app(proxy: Proxy) -> web.Application:
    app = web.Application()
    for route in _ROUTES:
        app.router.add_post(route, proxy.handle)
    app.router.add_get("/v1/models", proxy.passthrough)
    app.router.add_get("/health", proxy.passthrough)

    async def _close(_: web.Application) -> None:
        await proxy.close()

    app.on_cleanup.append(_close)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxferd.integrations.vllm.proxy")
    p.add_argument("--prefill", required=True, help="the prefill vLLM server's base URL")
    p.add_argument("--decode", required=True, help="the decode vLLM server's base URL")
    p.add_argument(
        "--prefill-peer",
        default="",
        help="the prefill daemon's peer address HOST:PORT (default: the decode connector's)",
    )
    p.add_argument(
        "--decode-peer",
        default="",
        help="the decode daemon's name (its daemon.name): the prefill daemon then serves it "
        "only (default: whoever asks first for the transfer id)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    web.run_app(
        make_app(Proxy(args.prefill, args.decode, args.prefill_peer, args.decode_peer)),
        host=args.host,
        port=args.port,
        print=lambda msg: log.info("%s", msg),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
