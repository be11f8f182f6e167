"""The streamed-completion client of kvxferd.integrations.vllm.launch, against a local HTTP
server that answers as vLLM's OpenAI server does (no vLLM needed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvxferd.integrations.vllm.launch import stream_completion

# What vLLM 0.32 streams for a request that fails mid-generation (seen for a KV load that
# failed under kv_load_failure_policy "fail", behind the example proxy): HTTP 200.
FAILED = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
)
OK = (
    b'data: {"choices": [{"token_ids": [5, 6], "finish_reason": null}]}\n\n'
    b'data: {"choices": [{"token_ids": [7], "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
)


@pytest.fixture
def server() -> Iterator[tuple[str, list[bytes]]]:
    answer: list[bytes] = [OK]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(answer[0])

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", answer
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_tokens_and_finish_reason(server: tuple[str, list[bytes]]) -> None:
    url, _ = server
    got = stream_completion(url, [1, 2, 3], 3)
    assert (got.status, got.token_ids, got.finish_reason) == (200, [5, 6, 7], "length")
    assert got.error == ""


def test_an_error_event_in_a_200_stream_is_the_error(server: tuple[str, list[bytes]]) -> None:
    url, answer = server
    answer[0] = FAILED
    got = stream_completion(url, [1, 2, 3], 3)
    assert got.status == 200 and got.token_ids == []
    assert "InternalServerError" in got.error
