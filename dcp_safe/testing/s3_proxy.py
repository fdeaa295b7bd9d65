"""A fault-injecting HTTP reverse proxy in front of a local S3 (moto), for tests.

It binds ``127.0.0.1`` on a port the kernel picks and forwards every request (method, path,
query, headers, body) to the upstream server, buffering bodies both ways. Faults are programmed
per request, matched by HTTP method and a substring of the (URL-decoded) path, for the next
``times`` matching requests or, with ``times=None``, for good::

    with local_s3() as s3, FaultProxy(s3.endpoint_url) as proxy:
        proxy.fail(503, "SlowDown", method="PUT", key="_COMMITTED")   # the next PUT only
        proxy.drop_reply(method="PUT", key="_COMMITTED")               # applied, never answered
        proxy.strip_header("If-None-Match", method="PUT", times=None)  # a server that ignores it
        options = proxy.storage_options()                              # s3fs goes through it

Three kinds of fault, and one change of behaviour:

* ``fail``: answer with an S3 XML error (``500 InternalError``, ``503 SlowDown``, ...); the
  request never reaches the server.
* ``delay``: forward, then hold the reply for ``seconds`` (a client with a shorter read timeout
  gives up; the server has applied the request).
* ``drop_reply``: forward, so the server applies the request, then close the client's
  connection without a byte of reply — a lost reply.
* ``strip_header``: forward without the named request header, as a server that ignores it
  would (``If-None-Match``: an S3-compatible server without conditional writes). Checked apart
  from the faults above, so it combines with them.

Why a proxy rather than mocking botocore: the client stack (s3fs, aiobotocore, aiohttp) runs
for real, so what it raises on a 503 or a dropped connection is what production code sees.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal
from xml.sax.saxutils import escape

from dcp_safe.testing.s3 import local_storage_options

__all__ = ["Fault", "FaultProxy"]

logger = logging.getLogger(__name__)

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",  # the proxy answered "100 Continue" itself
        "content-length",  # recomputed from the buffered body
    }
)
_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
}


@dataclass
class Fault:
    """One programmed fault and how often it fired.

    Attributes:
        kind: ``"fail"``, ``"delay"``, ``"drop"`` or ``"strip"``.
        method: the HTTP method it applies to (any when None).
        key: a substring of the request path it applies to (any when None).
        times: how many more matching requests it applies to (for good when None).
        status, code: the error reply of a ``"fail"``.
        seconds: the hold of a ``"delay"``.
        header: the request header a ``"strip"`` removes.
        hits: matching requests it has acted on.
    """

    kind: Literal["fail", "delay", "drop", "strip"]
    method: str | None = None
    key: str | None = None
    times: int | None = 1
    status: int = 503
    code: str = "SlowDown"
    seconds: float = 0.0
    header: str = ""
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        """True when this fault is still armed and applies to the request."""
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and self.method.upper() != method.upper():
            return False
        return self.key is None or self.key in path


@dataclass
class _Stats:
    log: list[tuple[str, str]] = field(default_factory=list)
    faulted: int = 0


class FaultProxy:
    """A threaded reverse proxy to ``upstream_url`` with programmable faults.

    Args:
        upstream_url: the server to forward to, ``http://host:port``.
        upstream_timeout_s: how long to wait for the upstream server's reply.

    Attributes:
        url: the proxy's own ``http://127.0.0.1:<port>``, once started.
    """

    def __init__(self, upstream_url: str, *, upstream_timeout_s: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, got {upstream_url!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.upstream_timeout_s = upstream_timeout_s
        self.url = ""
        self._faults: list[Fault] = []
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- lifecycle

    def start(self) -> FaultProxy:
        """Bind a free loopback port and serve in a background thread."""
        server = _Server(("127.0.0.1", 0), _make_handler(self))
        server.daemon_threads = False  # joined by server_close(), so stop() leaves no thread
        server.block_on_close = True
        self._server = server
        host, port = server.server_address[:2]
        self.url = f"http://{host!s}:{port}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close every client connection and wait for the handler threads."""
        if self._server is None:
            return
        self._stopping.set()  # wakes delayed replies
        self._server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:  # wakes handlers waiting for a kept-alive client's next request
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------- faults

    def fail(
        self,
        status: int = 503,
        code: str = "SlowDown",
        *,
        method: str | None = None,
        key: str | None = None,
        times: int | None = 1,
    ) -> Fault:
        """Answer matching requests with an S3 XML error instead of forwarding them."""
        return self._add(
            Fault("fail", method=method, key=key, times=times, status=status, code=code)
        )

    def delay(
        self,
        seconds: float,
        *,
        method: str | None = None,
        key: str | None = None,
        times: int | None = 1,
    ) -> Fault:
        """Forward matching requests, then hold each reply for ``seconds``."""
        return self._add(Fault("delay", method=method, key=key, times=times, seconds=seconds))

    def drop_reply(
        self, *, method: str | None = None, key: str | None = None, times: int | None = 1
    ) -> Fault:
        """Forward matching requests (the server applies them), then close the client's
        connection without replying."""
        return self._add(Fault("drop", method=method, key=key, times=times))

    def strip_header(
        self,
        header: str,
        *,
        method: str | None = None,
        key: str | None = None,
        times: int | None = None,
    ) -> Fault:
        """Forward matching requests without ``header`` (for good, by default)."""
        return self._add(Fault("strip", method=method, key=key, times=times, header=header))

    def clear(self) -> None:
        """Remove every programmed fault (counters stay)."""
        with self._lock:
            self._faults.clear()

    def _add(self, fault: Fault) -> Fault:
        if fault.times is not None and fault.times < 1:
            raise ValueError(f"times must be at least 1 or None, got {fault.times}")
        with self._lock:
            self._faults.append(fault)
        return fault

    def _take_fault(self, method: str, path: str) -> Fault | None:
        """Log the request; the first armed fault that matches fires (and is counted)."""
        with self._lock:
            self._stats.log.append((method, path))
            for fault in self._faults:
                if fault.kind != "strip" and fault.matches(method, path):
                    fault.hits += 1
                    self._stats.faulted += 1
                    return fault
        return None

    def _take_strips(self, method: str, path: str) -> set[str]:
        """The headers (lower case) to leave out of this request."""
        with self._lock:
            strips = [f for f in self._faults if f.kind == "strip" and f.matches(method, path)]
            for fault in strips:
                fault.hits += 1
            return {fault.header.lower() for fault in strips}

    # ------------------------------------------------------------- counters

    @property
    def requests_seen(self) -> int:
        """Every request that reached the proxy."""
        with self._lock:
            return len(self._stats.log)

    @property
    def requests_faulted(self) -> int:
        """Requests a fault acted on."""
        with self._lock:
            return self._stats.faulted

    def requests(self, method: str | None = None, key: str | None = None) -> list[str]:
        """Paths of the requests seen, optionally only those matching ``method`` and ``key``."""
        with self._lock:
            log = list(self._stats.log)
        return [
            p
            for m, p in log
            if (method is None or m == method.upper()) and (key is None or key in p)
        ]

    # ------------------------------------------------------------- clients

    def storage_options(self, **extra: Any) -> dict[str, Any]:
        """s3fs options that go through this proxy, with dummy credentials; ``extra`` adds or
        overrides top-level options."""
        return local_storage_options(self.url, **extra)

    # ------------------------------------------------------------- the handler's side

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _forward(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=self.upstream_timeout_s)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() not in _HOP_BY_HOP:
                    conn.putheader(name, value)
            if body or method not in ("GET", "HEAD", "DELETE"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            data = response.read()
            return response.status, response.reason, response.getheaders(), data
        finally:
            conn.close()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-exchange is routine here, not worth a traceback on stderr.
        logger.debug("fault proxy: error serving %s", client_address, exc_info=True)


def _error_body(code: str, path: str) -> bytes:
    message = _MESSAGES.get(code, code)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(path)}</Resource><RequestId>dcp-safe-fault-proxy</RequestId></Error>"
    ).encode()


def _make_handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

        def setup(self) -> None:
            super().setup()
            proxy._track(self.connection, add=True)

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                proxy._track(self.connection, add=False)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("fault proxy: " + format, *args)

        def do_GET(self) -> None:
            self._handle()

        do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_GET

        def _handle(self) -> None:
            body = self._read_body()
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            fault = proxy._take_fault(self.command, path)
            strip = proxy._take_strips(self.command, path)
            if fault is not None and fault.kind == "fail":
                self._reply(fault.status, "", [("Content-Type", "application/xml")], path, fault)
                return
            try:
                headers = [h for h in self.headers.items() if h[0].lower() not in strip]
                status, reason, headers, data = proxy._forward(
                    self.command, self.path, headers, body
                )
            except OSError as exc:
                logger.debug("fault proxy: upstream failed: %s", exc)
                self._reply(502, "Bad Gateway", [], path, None, data=b"")
                return
            if fault is not None and fault.kind == "drop":
                self.close_connection = True  # finish() closes the socket: not a byte sent
                return
            if fault is not None and fault.kind == "delay" and proxy._stopping.wait(fault.seconds):
                self.close_connection = True
                return
            try:
                self._reply(status, reason, headers, path, None, data=data)
            except OSError:  # the client gave up waiting (a delayed reply): nobody to tell
                self.close_connection = True

        def _read_body(self) -> bytes:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return self._read_chunked()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _read_chunked(self) -> bytes:
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()

        def _reply(
            self,
            status: int,
            reason: str,
            headers: list[tuple[str, str]],
            path: str,
            fault: Fault | None,
            *,
            data: bytes | None = None,
        ) -> None:
            if fault is not None:
                data = _error_body(fault.code, path)
            payload = data or b""
            self.send_response_only(status, reason or None)
            for name, value in headers:
                is_head_length = self.command == "HEAD" and name.lower() == "content-length"
                if name.lower() not in _HOP_BY_HOP or is_head_length:
                    self.send_header(name, value)
            if self.command != "HEAD" and status not in (204, 304):
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            else:
                if fault is not None:
                    self.send_header("Content-Length", "0")
                self.end_headers()
            self.wfile.flush()

    return _Handler
