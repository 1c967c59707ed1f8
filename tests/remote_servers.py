"""Real object-storage servers on localhost for tests and benchmarks: a static HTTP server with Range support, and
moto's S3-compatible server; each in a child process, behind a middleware that injects latency and failures.

The child process keeps the test process free of the servers' threads (each test checks it leaks none) and lets a
test take the server down for real: `down` closes the listening socket and drops open keep-alive connections (a
client then sees connection refused / reset), `up` listens again on the same port with the same objects (moto's
buckets live in the child's memory, so they survive).

    with RemoteServer("s3", latency_s=0.01) as server:   # server.url: http://127.0.0.1:PORT
        server.make_bucket("data")
        server.command("fail 503 2 shard-000001")          # the next 2 requests naming it get 503
        server.command("down"); server.command("up")

`server.requests()` and `server.bytes_sent()` count what it received and sent since the last `reset`.

Run as a script it is the child: `python remote_servers.py {http ROOT|s3} [--latency-s S]`; it prints
`port N`, then answers each command on stdin with `ok ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

# fake credentials and the endpoint for s3fs / botocore; botocore reads AWS_ENDPOINT_URL itself
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class RemoteServer:
    """A server child process: `url` (http://127.0.0.1:PORT), `command(line)`, `stop()`."""

    def __init__(self, kind: str, root: Path | None = None, latency_s: float = 0.0) -> None:
        args = [sys.executable, __file__, kind, *([str(root)] if root is not None else []), "--latency-s",
                str(latency_s)]
        self.kind, self.root = kind, root
        self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.process.stdout is not None
        first = self.process.stdout.readline()
        if not first.startswith("port "):
            self.stop()
            raise RuntimeError(f"the {kind} test server did not start: {first!r}")
        self.port = int(first.split()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()

    def command(self, line: str) -> str:
        """Send one control line (`fail STATUS COUNT [MATCH]`, `latency S`, `down`, `up`, `requests`, `bytes`,
        `reset`);
        returns the child's answer after `ok`."""
        assert self.process.stdin is not None and self.process.stdout is not None
        with self._lock:
            self.process.stdin.write(line + "\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline().strip()
        if not answer.startswith("ok"):
            raise RuntimeError(f"test server command {line!r} failed: {answer!r}")
        return answer[2:].strip()

    def requests(self) -> int:
        """Requests the server has received (failed ones included)."""
        return int(self.command("requests"))

    def bytes_sent(self) -> int:
        """Bytes of response bodies the server has sent (since the start or the last `reset`)."""
        return int(self.command("bytes"))

    def make_bucket(self, name: str) -> str:
        """An S3 bucket (moto takes unsigned requests); returns `s3://name`."""
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/{name}", method="PUT"), timeout=10).close()
        return f"s3://{name}"

    def s3_env(self) -> dict[str, str]:
        return S3_ENV | {"AWS_ENDPOINT_URL": self.url}

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                assert self.process.stdin is not None
                self.process.stdin.close()  # the child exits at the end of its input
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


# --- the child process ----------------------------------------------------------------------------------------


class Faults:
    """WSGI middleware: `latency_s` before each request; the next `count` requests whose path contains `match` get
    `status`; while `down`, a request on a kept-alive connection has its socket shut (the listener is closed too)."""

    def __init__(self, app: WSGIApp, latency_s: float) -> None:
        self.app, self.latency_s, self.down = app, latency_s, False
        self.failures: list[list[Any]] = []  # [status, count left, match]
        self.requests = 0
        self.bytes = 0  # of response bodies sent
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if self.down:
            sock = environ.get("werkzeug.socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionAbortedError("server down")
        with self.lock:
            self.requests += 1
            failure = next((f for f in self.failures if f[1] > 0 and f[2] in environ.get("PATH_INFO", "")), None)
            if failure is not None:
                failure[1] -= 1
        if self.latency_s:
            time.sleep(self.latency_s)
        if failure is not None:
            status = int(failure[0])
            start_response(f"{status} {HTTPStatus(status).phrase}", [("Content-Length", "0")])
            return [b""]
        return _Counted(self.app(environ, start_response), self)


class _Counted:
    """A response body that adds the bytes it yields to `faults.bytes` (and closes the inner body, as WSGI asks)."""

    def __init__(self, body: Iterable[bytes], faults: Faults) -> None:
        self.body, self.faults = body, faults

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.body:
            with self.faults.lock:
                self.faults.bytes += len(chunk)
            yield chunk

    def close(self) -> None:
        close = getattr(self.body, "close", None)
        if close is not None:
            close()


def static_app(root: Path) -> WSGIApp:
    """Files under `root` by GET/HEAD, with Range requests (206) as object stores serve them."""
    from werkzeug.wrappers import Request, Response
    from werkzeug.wsgi import wrap_file

    base = root.resolve()

    @Request.application  # type: ignore[misc]
    def app(request: Request) -> Response:
        path = (base / request.path.lstrip("/")).resolve()
        if base not in path.parents or not path.is_file():
            return Response("not found", status=404)
        size = path.stat().st_size
        body = wrap_file(request.environ, open(path, "rb"))  # noqa: SIM115  (closed by the server after the reply)
        response = Response(body, mimetype="application/octet-stream", direct_passthrough=True)
        return response.make_conditional(request, accept_ranges=True, complete_length=size)  # seeks for a Range

    return app  # type: ignore[no-any-return]


def _serve(app: WSGIApp, port: int) -> tuple[Any, threading.Thread]:
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("http", "s3"))
    parser.add_argument("root", nargs="?", type=Path)
    parser.add_argument("--latency-s", type=float, default=0.0)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    if args.kind == "http":
        inner = static_app(args.root)
    else:
        from moto.server import DomainDispatcherApplication, create_backend_app

        os.environ.update(S3_ENV)
        inner = DomainDispatcherApplication(create_backend_app)
    faults = Faults(inner, args.latency_s)
    server, thread = _serve(faults, 0)
    port = server.server_address[1]
    print(f"port {port}", flush=True)
    for line in sys.stdin:
        words = line.split()
        answer = ""
        if not words:
            continue
        if words[0] == "fail":
            with faults.lock:
                faults.failures.append([int(words[1]), int(words[2]), words[3] if len(words) > 3 else ""])
        elif words[0] == "latency":
            faults.latency_s = float(words[1])
        elif words[0] == "requests":
            answer = str(faults.requests)
        elif words[0] == "bytes":
            answer = str(faults.bytes)
        elif words[0] == "reset":
            with faults.lock:
                faults.failures, faults.requests, faults.bytes = [], 0, 0
        elif words[0] == "down" and server is not None:
            faults.down = True
            server.shutdown()
            server.server_close()
            thread.join()
            server = None
        elif words[0] == "up" and server is None:
            faults.down = False
            server, thread = _serve(faults, port)
        print(f"ok {answer}".rstrip(), flush=True)
    if server is not None:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
