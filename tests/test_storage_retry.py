"""Object-store writes against a real S3-compatible server (moto, the `s3_server` fixture) behind a real HTTP proxy
on 127.0.0.1 that answers `503 SlowDown` for as many requests as a test asks (moto injects no faults itself): a
store that fails in passing is retried within the budget and said once; one that keeps failing, or is gone, ends
the write as StorageFull (exit 74) naming the path, what was written and the error."""

from __future__ import annotations

import http.client
import http.server
import logging
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from raytrain_ddp.errors import EXIT_STORAGE_FULL, StorageFull
from raytrain_ddp.files import write_atomic
from raytrain_ddp.storage import RETRY_BUDGET_ENV, location

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


# not forwarded: they are about the client's connection to the proxy, not the proxy's to the server
HOP_BY_HOP = {"connection", "keep-alive", "expect", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class FaultyProxy(http.server.ThreadingHTTPServer):
    """Forwards every request to the S3 server, except that the next `failures` requests get 503 SlowDown."""

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream, self.failures, self.lock = urlsplit(upstream).netloc, 0, threading.Lock()

    def take_failure(self) -> bool:
        with self.lock:
            if self.failures <= 0:
                return False
            self.failures -= 1
            return True


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultyProxy

    def _relay(self) -> None:
        body = self._body()
        if self.server.take_failure():
            self._answer(503, [("Content-Type", "application/xml")], SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream.request(self.command, self.path, body=body, headers=headers)
        reply = upstream.getresponse()
        self._answer(
            reply.status,
            [(k, v) for k, v in reply.getheaders() if k.lower() not in HOP_BY_HOP | self._sized_here],
            reply.read(),
        )
        upstream.close()

    @property
    def _sized_here(self) -> set[str]:
        """Headers the proxy sets itself: a body's length, except a HEAD's (the size of the object, no body)."""
        return set() if self.command == "HEAD" else {"content-length"}

    def _body(self) -> bytes:
        """The request's body, whether sized or chunked (pyarrow's SDK streams a PUT in chunks)."""
        if "chunked" not in self.headers.get("Transfer-Encoding", ""):
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        chunks = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            chunks.append(self.rfile.read(size))
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # the trailers
            pass
        return b"".join(chunks)

    def handle_expect_100(self) -> bool:  # the client sends the body only after 100 Continue
        self.send_response_only(100)
        self.end_headers()
        return True

    def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        if not any(key.lower() == "content-length" for key, _ in headers):  # a HEAD's is the object's size
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

    def log_message(self, *args: object) -> None:  # quiet: the test's log is about the client
        pass


@pytest.fixture
def proxy(s3_server) -> Iterator[FaultyProxy]:
    server = FaultyProxy(s3_server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _run_dir(proxy: FaultyProxy, prefix: str):
    host, port = proxy.server_address[:2]
    return location(f"s3://raytrain/{prefix}?endpoint_override=http://{host}:{port}&scheme=http")


def test_a_store_that_throttles_in_passing_is_retried_and_said_once(proxy, caplog, monkeypatch):
    """More 503 SlowDown answers than pyarrow's own retries absorb: the write still lands, in one
    WARNING naming the path and the error."""
    monkeypatch.setenv(RETRY_BUDGET_ENV, "30")
    target = _run_dir(proxy, "retry-passing") / "metrics.jsonl"
    proxy.failures = 40  # pyarrow (its AWS SDK) retries each request itself: ten or so per attempt of ours
    with caplog.at_level(logging.INFO, logger="raytrain_ddp.storage"):
        write_atomic(target, '{"step": 1}\n')
    assert proxy.failures == 0
    assert target.read_text() == '{"step": 1}\n'
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "metrics.jsonl" in warnings[0] and "s3://raytrain/retry-passing/metrics.jsonl" in warnings[0]
    assert "SLOW_DOWN" in warnings[0] or "503" in warnings[0] or "SlowDown" in warnings[0], warnings[0]


def test_a_store_that_keeps_failing_ends_the_write_in_one_line_after_the_budget(proxy, caplog, monkeypatch):
    """503 for ever: StorageFull (exit 74) once the budget is spent, naming what, where and the error; the
    object that was there before is left as it was."""
    monkeypatch.setenv(RETRY_BUDGET_ENV, "8")  # pyarrow spends some 5 s on its own retries of one attempt
    target = _run_dir(proxy, "retry-for-ever") / "summary.json"
    write_atomic(target, "{}")
    proxy.failures = 10**6
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp.storage"), pytest.raises(StorageFull) as ended:
        write_atomic(target, '{"finished": true}')
    proxy.failures = 0
    line = str(ended.value)
    assert "\n" not in line
    assert line.startswith("storage failed: the object store failed (")
    assert "writing summary.json to s3://raytrain/retry-for-ever/summary.json" in line
    assert "bring the store back" in line and "run the same command again to resume" in line
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert target.read_text() == "{}"
    assert EXIT_STORAGE_FULL == 74


def test_a_store_that_is_gone_ends_the_write_in_one_line(s3_server, monkeypatch):
    """Nothing listening on the store's port (a stopped server): connection refused, retried, then StorageFull."""
    monkeypatch.setenv(RETRY_BUDGET_ENV, "2")
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forward) as closed:
        port = closed.server_address[1]  # closed at the end of the block: nothing answers there after it
    target = location(f"s3://raytrain/gone?endpoint_override=http://127.0.0.1:{port}&scheme=http") / "steps.jsonl"
    with pytest.raises(StorageFull) as ended:
        write_atomic(target, "{}\n")
    assert "writing steps.jsonl to s3://raytrain/gone/steps.jsonl" in str(ended.value)
