"""The latency-and-fault proxy (``tests.net_proxy``) in front of real servers: moto's S3
server spoken to by pyarrow's S3 filesystem (the AWS SDK for C++, as the store and pyiceberg
use it), and a small keep-alive HTTP/1.1 server of the standard library for the request
framing that moto's server never exercises (it closes every connection after one response).

Timing checks here are lower bounds on the proxy's own delay, never on our code's speed.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.fs as pafs
import pytest

from tests import s3_server
from tests.net_proxy import NetProxy

pytestmark = pytest.mark.skipif(not s3_server.available(), reason="moto_server not installed (test extras)")

BUCKET = "net-proxy"
WAIT_S = 20


@pytest.fixture(scope="module")
def s3_endpoint(s3_server_endpoint: str) -> str:
    s3_server.create_bucket(s3_server_endpoint, BUCKET)
    return s3_server_endpoint


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[NetProxy]:
    with NetProxy(s3_endpoint) as p:
        yield p


def s3fs(endpoint: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(access_key=s3_server.ACCESS_KEY_ID, secret_key=s3_server.SECRET_ACCESS_KEY,
                             region=s3_server.REGION, endpoint_override=endpoint, scheme="http",
                             connect_timeout=5, request_timeout=WAIT_S)


def put(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as out:
        out.write(data)


def get(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_file(path) as f:
        return f.read()


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_s3_write_read_list_through_the_proxy(proxy):
    fs = s3fs(proxy.endpoint)
    big = bytes(range(256)) * (24 * 1024)  # 6 MiB
    put(fs, f"{BUCKET}/rw/small", b"hello")
    put(fs, f"{BUCKET}/rw/big", big)
    assert get(fs, f"{BUCKET}/rw/small") == b"hello"
    assert get(fs, f"{BUCKET}/rw/big") == big
    with fs.open_input_file(f"{BUCKET}/rw/big") as f:
        assert f.read_at(10, 5 * 1024 * 1024) == big[5 * 1024 * 1024: 5 * 1024 * 1024 + 10]
    listed = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/rw"))
    assert sorted((i.path, i.size) for i in listed) == [(f"{BUCKET}/rw/big", len(big)), (f"{BUCKET}/rw/small", 5)]

    traffic = proxy.snapshot()
    assert {"PUT", "POST", "GET", "HEAD"} <= set(traffic.by_method)
    assert sum(traffic.by_method.values()) == traffic.count == len(traffic.calls())
    assert traffic.bytes_to_server > len(big) and traffic.bytes_to_client > len(big)
    assert all(r.injected_status is None for r in traffic.requests)
    assert ("GET", f"/{BUCKET}/rw/big") in traffic.calls()


def test_counts_are_per_request_and_reset_forgets(proxy):
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/count/a", b"a")
    assert proxy.snapshot().count > 0
    proxy.reset()
    assert proxy.snapshot().count == 0 and proxy.snapshot().connections == 0
    fs.get_file_info(f"{BUCKET}/count/a")
    fs.get_file_info(f"{BUCKET}/count/a")
    traffic = proxy.snapshot()
    assert traffic.by_method == {"HEAD": 2}
    assert traffic.calls() == [("HEAD", f"/{BUCKET}/count/a")] * 2
    assert traffic.requests[0].path == f"/{BUCKET}/count/a" and traffic.requests[0].query == ""


def test_latency_delays_every_request_and_changes_at_run_time(proxy):
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/lat/a", b"a")
    proxy.latency_s = 0.1
    proxy.reset()
    t0 = time.perf_counter()
    for _ in range(3):
        assert get(fs, f"{BUCKET}/lat/a") == b"a"
    elapsed = time.perf_counter() - t0
    requests = proxy.snapshot().count
    assert requests >= 6  # HEAD + GET per read
    assert elapsed >= requests * 0.1  # one after the other: each pays the delay once
    proxy.latency_s = 0.0
    assert get(fs, f"{BUCKET}/lat/a") == b"a"


def test_stop_refuses_and_cuts_then_resume_serves_again(proxy):
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/stop/a", b"a")
    port = proxy.port
    proxy.stop()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(OSError, match=r"stop/a|connect"):
        get(fs, f"{BUCKET}/stop/a")
    proxy.resume()
    assert proxy.port == port
    assert get(fs, f"{BUCKET}/stop/a") == b"a"


def test_pause_holds_requests_until_resume(proxy):
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/pause/a", b"a")
    proxy.reset()
    proxy.pause()
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(get(fs, f"{BUCKET}/pause/a")))
    reader.start()
    wait_for(lambda: proxy.snapshot().count >= 1, "the held request to arrive")
    assert reader.is_alive() and got == []
    proxy.resume()
    reader.join(WAIT_S)
    assert got == [b"a"]


def test_stop_cuts_a_held_request(proxy):
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/cut/a", b"a")
    proxy.reset()
    proxy.pause()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            get(fs, f"{BUCKET}/cut/a")
        except OSError as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: proxy.snapshot().count >= 1, "the held request to arrive")
    proxy.stop()
    reader.join(WAIT_S)
    assert not reader.is_alive() and len(errors) == 1
    proxy.resume()
    assert get(fs, f"{BUCKET}/cut/a") == b"a"


def test_fail_next_answers_errors_without_forwarding(proxy):
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/fail/a", b"a")
    proxy.reset()
    proxy.fail_next(1, 503)
    assert fs.get_file_info(f"{BUCKET}/fail/a").size == 1  # the SDK retried
    assert [(r.method, r.injected_status) for r in proxy.snapshot().requests] == [("HEAD", 503), ("HEAD", None)]

    proxy.fail_next(10, 503)
    with pytest.raises(OSError, match="503"):
        fs.get_file_info(f"{BUCKET}/fail/a")
    assert 0 < proxy.failures_queued() < 10
    proxy.fail_next(0)
    assert proxy.failures_queued() == 0
    assert fs.get_file_info(f"{BUCKET}/fail/a").size == 1


def test_fail_next_of_one_method_fails_an_upload_part(proxy):
    """An upload part (a PUT sent with ``Expect: 100-continue``, its body not read) answered
    with an error: the SDK retries it on a new connection and the upload completes."""
    fs = s3fs(proxy.endpoint)
    proxy.reset()
    proxy.fail_next(1, 500, method="PUT")
    put(fs, f"{BUCKET}/fail/part", b"p" * 1000)
    assert get(fs, f"{BUCKET}/fail/part") == b"p" * 1000
    puts = [r for r in proxy.snapshot().requests if r.method == "PUT"]
    assert [r.injected_status for r in puts[:2]] == [500, None]
    assert puts[0].target == puts[1].target


# --- request framing on a keep-alive connection ---------------------------------------------


class _Echo(BaseHTTPRequestHandler):
    """Answers each request with the method and the number of body bytes it received."""

    protocol_version = "HTTP/1.1"

    def _body_length(self) -> int:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            total = 0
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return total
                total += len(self.rfile.read(size))
                self.rfile.readline()
        return len(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _answer(self) -> None:
        body = f"{self.command} {self._body_length()}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_keep_alive_requests_are_framed_delayed_and_counted_one_by_one(echo_server: str):
    with NetProxy(echo_server, latency_s=0.05) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=WAIT_S)
        body = b"x" * 100_000
        t0 = time.perf_counter()
        conn.request("PUT", "/a?x=1", body=body)
        assert conn.getresponse().read() == b"PUT 100000"
        conn.request("POST", "/b", body=iter([b"ab", b"c" * 70_000, b"d"]), encode_chunked=True)
        assert conn.getresponse().read() == b"POST 70003"
        conn.request("GET", "/c")
        assert conn.getresponse().read() == b"GET 0"
        elapsed = time.perf_counter() - t0
        conn.close()
        traffic = proxy.snapshot()
    assert traffic.calls() == [("PUT", "/a?x=1"), ("POST", "/b"), ("GET", "/c")]
    assert traffic.by_method == {"PUT": 1, "POST": 1, "GET": 1}
    assert traffic.connections == 1 and {r.connection for r in traffic.requests} == {1}
    assert elapsed >= 3 * 0.05


def test_injected_errors_keep_a_keep_alive_connection_in_step(echo_server: str):
    with NetProxy(echo_server) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=WAIT_S)
        proxy.fail_next(2, 503)
        conn.request("PUT", "/a", body=b"y" * 5000)
        response = conn.getresponse()
        assert response.status == 503 and b"<Code>SlowDown</Code>" in response.read()
        conn.request("POST", "/b", body=iter([b"z" * 3000]), encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 503 and response.read()
        conn.request("PUT", "/c", body=b"w" * 10)
        assert conn.getresponse().read() == b"PUT 10"
        conn.close()
        assert [r.injected_status for r in proxy.snapshot().requests] == [503, 503, None]
        assert proxy.snapshot().connections == 1


# --- connection resets and slow requests -------------------------------------------------------


def test_reset_next_cuts_mid_request_and_mid_response_with_a_tcp_reset(echo_server: str):
    """A reset mid-request reaches the client as ``ECONNRESET`` and the request never reaches
    the server; a reset mid-response passes the request on and cuts its response after the
    given number of bytes. Other requests, and new connections, are served as before."""
    with NetProxy(echo_server) as proxy:
        proxy.reset_next(1, method="PUT")
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=WAIT_S)
        conn.request("GET", "/before")  # another method: not reset
        assert conn.getresponse().read() == b"GET 0"
        with pytest.raises(ConnectionResetError):
            conn.request("PUT", "/a", body=b"x" * 1000)
            conn.getresponse().read()
        conn.close()

        proxy.reset_next(1, after_response_bytes=20)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=WAIT_S)
        with pytest.raises((ConnectionResetError, http.client.HTTPException)):
            conn.request("PUT", "/b", body=b"y" * 1000)
            conn.getresponse().read()
        conn.close()

        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=WAIT_S)
        conn.request("PUT", "/c", body=b"z" * 10)
        assert conn.getresponse().read() == b"PUT 10"
        conn.close()
        traffic = proxy.snapshot()
    assert [(r.method, r.target, r.injected_reset) for r in traffic.requests] == [
        ("GET", "/before", None), ("PUT", "/a", "request"), ("PUT", "/b", "response"), ("PUT", "/c", None)]
    assert proxy.failures_queued() == 0


def test_a_raw_client_sees_the_first_bytes_of_a_response_cut_by_a_reset(echo_server: str):
    """Mid-response, exactly ``after_response_bytes`` bytes arrive before the reset (read
    before the reset lands: the proxy sends them, then resets)."""
    with NetProxy(echo_server) as proxy:
        proxy.reset_next(1, after_response_bytes=12)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=WAIT_S) as sock:
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
            got = b""
            with pytest.raises(ConnectionResetError):
                while True:
                    piece = sock.recv(1024)
                    if not piece:
                        break
                    got += piece
                    time.sleep(0.05)
            assert got in (b"", b"HTTP/1.1 200")  # a reset may discard bytes not yet read


def test_pyarrow_retries_requests_whose_connection_was_reset(proxy):
    """Resets mid-request and mid-response of a HEAD, a GET and a PUT are retried by the SDK:
    the calls succeed, and the proxy saw each reset request sent again."""
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/reset/a", b"a" * 1000)
    for after in (None, 0, 100):
        proxy.reset()
        proxy.reset_next(1, after_response_bytes=after)
        assert get(fs, f"{BUCKET}/reset/a") == b"a" * 1000
        proxy.reset_next(1, method="PUT", after_response_bytes=after)
        put(fs, f"{BUCKET}/reset/b", b"b" * 1000)
        assert get(fs, f"{BUCKET}/reset/b") == b"b" * 1000
        requests = proxy.snapshot().requests
        cut = [r for r in requests if r.injected_reset is not None]
        assert len(cut) == 2, requests
        for r in cut:  # sent again after the reset
            assert any(o.method == r.method and o.target == r.target and o.injected_reset is None
                       for o in requests[requests.index(r) + 1:])


def test_delay_next_slows_only_the_next_requests(proxy):
    """``delay_next`` holds the next requests of one method, then requests flow at full speed."""
    fs = s3fs(proxy.endpoint)
    put(fs, f"{BUCKET}/slow/a", b"a")
    proxy.delay_next(1, 0.5, method="GET")
    t0 = time.perf_counter()
    assert get(fs, f"{BUCKET}/slow/a") == b"a"
    assert time.perf_counter() - t0 >= 0.5
    assert proxy.failures_queued() == 0
    t0 = time.perf_counter()
    assert get(fs, f"{BUCKET}/slow/a") == b"a"
    assert time.perf_counter() - t0 < 0.5
