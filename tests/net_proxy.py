"""A TCP proxy of ours in front of a real HTTP/1.1 server (moto's S3 server in tests and
benchmarks): it adds latency, counts requests and injects faults, so that nothing we
integrate with is mocked.

``NetProxy(upstream)`` listens on a free port of 127.0.0.1 and forwards each client
connection to its own upstream connection. In the client-to-server direction it follows the
HTTP/1.1 framing of keep-alive connections: it reads a request head (request line and
headers), applies the faults and the latency, forwards the head, then streams exactly the
request's body (``Content-Length`` bytes, which also covers S3's ``aws-chunked`` uploads, or
a ``Transfer-Encoding: chunked`` body up to its last chunk and trailers) and waits for the
next head. Responses are streamed back unchanged and never parsed. Clients that pipeline
requests would still be forwarded correctly (each head is delayed on its own), but the
injected error responses assume none does (curl, the AWS SDK, urllib3 and aiohttp do not).

Controls, usable from any thread while traffic flows:

* ``latency_s``: delay added once per request, before its head is forwarded (0 by default);
* ``snapshot()`` / ``reset()``: requests seen (method, target, a few headers), per method,
  connections accepted and bytes each way since the last reset;
* ``stop()``: the server goes away: new connections are refused (the listening socket is
  closed) and open ones are cut; ``resume()`` listens again on the same port;
* ``pause()``: the server hangs: requests are read but not forwarded until ``resume()``
  (or cut by ``stop()``/``close()``);
* ``fail_next(n, status=503, method=None, append=False)``: the next ``n`` requests (of one method, if
  given) are answered by the proxy with an S3 error document of that status, without
  reaching the server;
* ``delay_next(n, seconds, method=None)``: the next ``n`` requests (of one method, if given)
  are held ``seconds`` (on top of ``latency_s``) before they are forwarded: slow responses;
* ``reset_next(n, method=None, after_response_bytes=None)``: the connections of the next ``n``
  requests (of one method, if given) are cut with a TCP reset: mid-request (the head read, the
  request never forwarded), or, with ``after_response_bytes=k``, mid-response (the request
  forwarded, then ``k`` bytes of its response passed on before the reset).

Standard library only; one thread per connection and direction. ``close()`` (or the context
manager) ends everything.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

HEAD_BYTES_MAX = 64 * 1024
CHUNK_BYTES = 64 * 1024
ACCEPT_POLL_S = 0.1
PAUSE_POLL_S = 0.02
# How long an injected error on an ``Expect: 100-continue`` request waits for the client to
# close before the proxy closes the connection (so that the client reads the error, not a reset).
DRAIN_S = 1.0
# Headers kept in a request's record (lower case).
RECORDED_HEADERS = ("range", "content-length", "content-encoding", "transfer-encoding", "expect",
                    "x-amz-decoded-content-length")
S3_ERROR_CODES = {400: "BadRequest", 403: "AccessDenied", 404: "NoSuchKey", 409: "OperationAborted",
                  429: "SlowDown", 500: "InternalError", 503: "SlowDown"}


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it: ``target`` is the request line's target (path and
    query, e.g. ``/bucket/key?uploadId=...&partNumber=1``)."""

    method: str
    target: str
    headers: dict[str, str]
    connection: int  # sequence number of the client connection that carried it
    injected_status: int | None = None  # the status the proxy answered with, or None if forwarded
    injected_reset: str | None = None  # "request" or "response": where the proxy reset its connection

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def query(self) -> str:
        return self.target.split("?", 1)[1] if "?" in self.target else ""


@dataclass(frozen=True)
class Traffic:
    """What the proxy saw since the last ``reset()`` (a copy: later traffic does not change it)."""

    requests: tuple[Request, ...] = ()
    connections: int = 0
    bytes_to_server: int = 0
    bytes_to_client: int = 0
    by_method: dict[str, int] = field(default_factory=dict)
    # bytes to the client per the label ``NetProxy(client_label=...)`` gave its connection
    bytes_to_client_by: dict[str, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.requests)

    def calls(self) -> list[tuple[str, str]]:
        """``(method, target)`` of each request, in arrival order."""
        return [(r.method, r.target) for r in self.requests]


# ``_admit``'s answer for a request whose connection is reset before it is forwarded.
_RESET_REQUEST = -1


class _Dropped(Exception):
    """The connection was cut by ``stop()``/``close()`` or by a peer."""


class _Reader:
    """Buffered reads of a socket: request heads, lines, exact byte counts."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._buf = bytearray()

    def _fill(self) -> bool:
        data = self._sock.recv(CHUNK_BYTES)
        if not data:
            return False
        self._buf += data
        return True

    def until(self, delimiter: bytes, limit: int, *, eof_ok: bool = False) -> bytes | None:
        """Bytes up to and including ``delimiter``; None on a clean EOF before any byte when
        ``eof_ok``."""
        while True:
            at = self._buf.find(delimiter)
            if at >= 0:
                end = at + len(delimiter)
                out = bytes(self._buf[:end])
                del self._buf[:end]
                return out
            if len(self._buf) > limit:
                raise _Dropped(f"no {delimiter!r} within {limit} bytes")
            if not self._fill():
                if eof_ok and not self._buf:
                    return None
                raise _Dropped("connection closed inside a request")

    def exactly(self, n: int):
        """Yield the next ``n`` bytes in pieces as they arrive."""
        while n > 0:
            if not self._buf and not self._fill():
                raise _Dropped("connection closed inside a request body")
            piece = bytes(self._buf[:n])
            del self._buf[: len(piece)]
            n -= len(piece)
            yield piece


class _Connection:
    """A client connection, its upstream connection and their two pumping threads."""

    def __init__(self, proxy: NetProxy, client: socket.socket, number: int, label: str = ""):
        self.proxy = proxy
        self.client = client
        self.number = number
        self.label = label
        self.upstream: socket.socket | None = None
        self.client_send = threading.Lock()
        self._cut = False
        self._resetting = False
        # Response bytes still to pass on before a reset mid-response (None: no reset armed).
        self._reset_after: int | None = None

    def cut(self) -> None:
        """Close both sides now (any thread): blocked reads and writes end with an error."""
        self._cut = True
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    # A reset's client side sends nothing now: its close sends the RST.
                    sock.shutdown(socket.SHUT_RD if sock is self.client and self._resetting else socket.SHUT_RDWR)

    def reset(self) -> None:
        """Cut the connection with a TCP reset to the client (any thread): its reads and writes
        fail with ``ECONNRESET`` instead of seeing an orderly end."""
        self._resetting = True
        with contextlib.suppress(OSError):  # an abortive close: the final close() sends RST
            self.client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.cut()

    def serve(self) -> None:
        try:
            try:
                self.upstream = socket.create_connection(self.proxy.upstream)
            except OSError:
                return  # the client sees its connection closed, as with a dead backend
            if self._cut:
                return
            self.upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            back = threading.Thread(target=self._responses, name=f"net-proxy-resp-{self.number}", daemon=True)
            back.start()
            try:
                self._requests()
            except (_Dropped, OSError):
                self.cut()
            back.join()
        finally:
            for sock in (self.client, self.upstream):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
            self.proxy._forget(self)

    # client -> server: request by request
    def _requests(self) -> None:
        reader = _Reader(self.client)
        while True:
            head = reader.until(b"\r\n\r\n", HEAD_BYTES_MAX, eof_ok=True)
            if head is None:  # the client closed between requests
                with contextlib.suppress(OSError):
                    self.upstream.shutdown(socket.SHUT_WR)
                return
            method, target, headers = _parse_head(head)
            status, reset_after = self.proxy._admit(method, target, headers, self.number)
            if self._cut:
                raise _Dropped("cut")
            if status is not None:
                if not self._answer(reader, method, headers, status):
                    return
                continue
            if reset_after == _RESET_REQUEST:
                self.reset()
                raise _Dropped("reset mid-request")
            if reset_after is not None:
                self._reset_after = reset_after  # armed before the server can answer
            self._send_up(head)
            self._forward_body(reader, headers)

    def _send_up(self, data: bytes) -> None:
        self.upstream.sendall(data)
        self.proxy._add_bytes(up=len(data))

    def _forward_body(self, reader: _Reader, headers: dict[str, str]) -> None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                line = reader.until(b"\r\n", HEAD_BYTES_MAX)
                self._send_up(line)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the empty line
                        trailer = reader.until(b"\r\n", HEAD_BYTES_MAX)
                        self._send_up(trailer)
                        if trailer == b"\r\n":
                            return
                for piece in reader.exactly(size + 2):  # the data and its CRLF
                    self._send_up(piece)
        else:
            for piece in reader.exactly(int(headers.get("content-length", "0") or 0)):
                self._send_up(piece)

    def _answer(self, reader: _Reader, method: str, headers: dict[str, str], status: int) -> bool:
        """Answer a request with an injected error; whether the connection stays open."""
        expects_continue = headers.get("expect", "").lower() == "100-continue"
        if not expects_continue:
            for _ in _body_pieces(reader, headers):
                pass  # read and dropped: the connection stays in step for the next request
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        body = b"" if method == "HEAD" else (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
            f"{S3_ERROR_CODES.get(status, 'InjectedFault')}</Code><Message>injected by the test proxy"
            "</Message><RequestId>net-proxy</RequestId></Error>").encode()
        close = expects_continue  # the body was not read: the connection cannot continue
        response = (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/xml\r\n"
                    f"Content-Length: {len(body) if method != 'HEAD' else 0}\r\n"
                    f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n").encode() + body
        with self.client_send:
            self.client.sendall(response)
        self.proxy._add_bytes(down=len(response), label=self.label)
        if close:
            # Close only once the client has read the answer and closed its side (or after
            # DRAIN_S): closing with unread request bytes would reset the connection first.
            with contextlib.suppress(OSError):
                self.client.shutdown(socket.SHUT_WR)
                self.client.settimeout(DRAIN_S)
                while self.client.recv(CHUNK_BYTES):
                    pass
            self.cut()
            return False
        return True

    # server -> client: a raw byte stream
    def _responses(self) -> None:
        try:
            while True:
                data = self.upstream.recv(CHUNK_BYTES)
                if not data:
                    break
                left = self._reset_after
                if left is not None and len(data) >= left:  # the reset mid-response is due
                    with self.client_send:
                        self.client.sendall(data[:left])
                    self.proxy._add_bytes(down=left, label=self.label)
                    self.reset()
                    return
                if left is not None:
                    self._reset_after = left - len(data)
                with self.client_send:
                    self.client.sendall(data)
                self.proxy._add_bytes(down=len(data), label=self.label)
        except OSError:
            pass
        # The server closed (or failed): the client must see its connection end.
        self.cut()


def _body_pieces(reader: _Reader, headers: dict[str, str]):
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = reader.until(b"\r\n", HEAD_BYTES_MAX)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while reader.until(b"\r\n", HEAD_BYTES_MAX) != b"\r\n":
                    pass
                return
            yield from reader.exactly(size + 2)
    else:
        yield from reader.exactly(int(headers.get("content-length", "0") or 0))


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _Dropped(f"not an HTTP/1.x request line: {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return parts[0], parts[1], headers


class NetProxy:
    """A latency-and-fault proxy on 127.0.0.1 in front of ``upstream`` (module docstring).

    Args:
        upstream: ``(host, port)`` of the server, or its ``http://host:port`` URL.
        latency_s: initial delay per request, in seconds (``latency_s`` can change later).
        client_label: names the client of a new connection from its ``(host, port)`` (say, the
            process that holds it): ``Traffic.bytes_to_client_by`` counts per name.
    """

    def __init__(self, upstream: tuple[str, int] | str, *, latency_s: float = 0.0,
                 client_label: Callable[[tuple[str, int]], str] | None = None):
        if isinstance(upstream, str):
            host_port = upstream.split("://", 1)[-1].rstrip("/")
            host, _, port = host_port.rpartition(":")
            upstream = (host, int(port))
        self.upstream: tuple[str, int] = upstream
        self.latency_s = latency_s
        self.port: int | None = None
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accepting: threading.Thread | None = None
        self._connections: set[_Connection] = set()
        self._threads: set[threading.Thread] = set()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._stopped = False
        self._closed = False
        # (status, method or None for any) of the next requests to answer with an error
        self._fail: list[tuple[int, str | None, str | None]] = []
        # (response bytes to pass on or None for mid-request, method or None) of the next resets
        self._resets: list[tuple[int | None, str | None]] = []
        # (extra delay in seconds, method or None) of the next slow requests
        self._delays: list[tuple[float, str | None]] = []
        self._requests: list[Request] = []
        self._connection_count = 0
        self._numbered = 0
        self._up = 0
        self._down = 0
        self._down_by: dict[str, int] = {}
        self._client_label = client_label

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``: what a client uses instead of the server's endpoint."""
        if self.port is None:
            raise RuntimeError("the proxy is not started")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> NetProxy:
        if self.port is not None:
            raise RuntimeError("the proxy is already started")
        self._listen()
        return self

    def close(self) -> None:
        """Stop listening, cut every connection and wait for the proxy's threads."""
        with self._lock:
            self._closed = True
        self._running.set()
        self._unlisten()
        self._cut_all()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> NetProxy:
        return self if self.port is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- faults -------------------------------------------------------------------------

    def stop(self) -> None:
        """The server goes away: refuse new connections and cut the open ones."""
        with self._lock:
            self._stopped = True
        self._unlisten()
        self._cut_all()

    def pause(self) -> None:
        """The server hangs: requests (on open and new connections) wait, unforwarded, for
        ``resume()``."""
        self._running.clear()

    def resume(self) -> None:
        """Undo ``stop()`` (listen again on the same port) and ``pause()``."""
        with self._lock:
            was_stopped, self._stopped = self._stopped, False
        if was_stopped:
            self._listen()
        self._running.set()

    def fail_next(self, n: int = 1, status: int = 503, *, method: str | None = None, append: bool = False,
                  path_contains: str | None = None) -> None:
        """Answer the next ``n`` requests (of ``method`` only, and to a path containing
        ``path_contains`` only, when given) with an S3 error of ``status`` instead of forwarding
        them. Replaces the failures still queued (``n=0`` clears them), or, with ``append``,
        queues these after them (say, two of each method)."""
        if n < 0 or not 400 <= status <= 599:
            raise ValueError(f"fail_next needs n >= 0 and an error status, got n={n}, status={status}")
        with self._lock:
            self._fail = (self._fail if append else []) + [
                (status, method.upper() if method else None, path_contains)] * n

    def reset_next(self, n: int = 1, *, method: str | None = None, after_response_bytes: int | None = None,
                   append: bool = False) -> None:
        """Cut the connections of the next ``n`` requests (of ``method`` only, when given) with
        a TCP reset: mid-request (the request never reaches the server) by default, or
        mid-response with ``after_response_bytes=k``: the request is forwarded and the first
        ``k`` bytes of its response passed on (0: none; more than the whole response: no reset,
        the connection is reset on the next bytes it would receive). Replaces the resets still
        queued (``n=0`` clears them), or, with ``append``, queues these after them. A
        ``fail_next`` error queued for the same request wins."""
        if n < 0 or (after_response_bytes is not None and after_response_bytes < 0):
            raise ValueError(f"reset_next needs n >= 0 and after_response_bytes >= 0, got n={n}, "
                             f"after_response_bytes={after_response_bytes}")
        with self._lock:
            self._resets = (self._resets if append else []) + [
                (after_response_bytes, method.upper() if method else None)] * n

    def delay_next(self, n: int, seconds: float, *, method: str | None = None, append: bool = False) -> None:
        """Hold the next ``n`` requests (of ``method`` only, when given) ``seconds`` more than
        ``latency_s`` before forwarding them (the client sees a slow response). Replaces the
        delays still queued (``n=0`` clears them), or, with ``append``, queues these after them."""
        if n < 0 or seconds < 0:
            raise ValueError(f"delay_next needs n >= 0 and seconds >= 0, got n={n}, seconds={seconds}")
        with self._lock:
            self._delays = (self._delays if append else []) + [(seconds, method.upper() if method else None)] * n

    def failures_queued(self) -> int:
        """How many injected faults (error answers, resets and delays) have not happened yet."""
        with self._lock:
            return len(self._fail) + len(self._resets) + len(self._delays)

    # --- traffic ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the traffic seen so far (queued failures stay)."""
        with self._lock:
            self._requests = []
            self._connection_count = 0
            self._up = self._down = 0
            self._down_by = {}

    def snapshot(self) -> Traffic:
        with self._lock:
            requests = tuple(self._requests)
            return Traffic(requests=requests, connections=self._connection_count, bytes_to_server=self._up,
                           bytes_to_client=self._down, by_method=dict(Counter(r.method for r in requests)),
                           bytes_to_client_by=dict(self._down_by))

    # --- internals ----------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port or 0))
        listener.listen(128)
        listener.settimeout(ACCEPT_POLL_S)
        self.port = listener.getsockname()[1]
        thread = threading.Thread(target=self._accept, args=(listener,), name="net-proxy-accept", daemon=True)
        with self._lock:
            self._listener = listener
            self._threads.add(thread)
        thread.start()

    def _unlisten(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown first: the accept loop's poll holds the socket open past close() alone
            # (Linux), and connects must be refused as soon as this returns.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            while True:
                with self._lock:
                    if self._listener is not listener:
                        return
                try:
                    client, peer = listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return  # closed
                client.settimeout(None)
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                label = self._client_label(peer) if self._client_label is not None else ""
                with self._lock:
                    if self._stopped or self._closed:
                        client.close()
                        continue
                    self._numbered += 1
                    self._connection_count += 1
                    conn = _Connection(self, client, self._numbered, label)
                    self._connections.add(conn)
                    thread = threading.Thread(target=conn.serve, name=f"net-proxy-req-{conn.number}", daemon=True)
                    self._threads.add(thread)
                thread.start()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _admit(self, method: str, target: str, headers: dict[str, str],
               connection: int) -> tuple[int | None, int | None]:
        """Record a request and hold it as the faults and latency say: the status to answer
        with instead of forwarding it (or None to forward), and the reset due (None: none;
        ``_RESET_REQUEST``: now; k: after k bytes of the response)."""
        with self._lock:
            if self._stopped or self._closed:
                raise _Dropped("stopped")
            status = reset = where = None
            for i, (failure, only, inside) in enumerate(self._fail):
                if (only is None or only == method) and (inside is None or inside in target.split("?", 1)[0]):
                    status = failure
                    del self._fail[i]
                    break
            if status is None:
                for i, (after, only) in enumerate(self._resets):
                    if only is None or only == method:
                        reset, where = (_RESET_REQUEST, "request") if after is None else (after, "response")
                        del self._resets[i]
                        break
            delay = self.latency_s
            if status is None and reset != _RESET_REQUEST:
                for i, (extra, only) in enumerate(self._delays):
                    if only is None or only == method:
                        delay += extra
                        del self._delays[i]
                        break
            kept = {k: headers[k] for k in RECORDED_HEADERS if k in headers}
            self._requests.append(Request(method, target, kept, connection, status, where))
        while not self._running.wait(PAUSE_POLL_S):
            if self._stopped or self._closed:
                raise _Dropped("stopped while paused")
        if status is None and reset != _RESET_REQUEST and delay > 0:
            time.sleep(delay)
        return status, reset

    def _add_bytes(self, up: int = 0, down: int = 0, label: str = "") -> None:
        with self._lock:
            self._up += up
            self._down += down
            if down:
                self._down_by[label] = self._down_by.get(label, 0) + down

    def _cut_all(self) -> None:
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.cut()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)
            self._threads.discard(threading.current_thread())
