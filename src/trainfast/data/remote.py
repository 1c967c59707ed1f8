"""`ObjectStore`: a URL prefix (`http(s)://host/prefix`, `s3://bucket/prefix`) whose objects are read whole or by
byte range, and written (s3 only), through fsspec, with transient failures retried.

- The filesystem is made lazily in each process and never pickled: DataLoader workers fork, and fsspec's async
  clients (their event loop, their connection pool) do not survive a fork.
- `read_ranges` sends all the ranges of a call concurrently (fsspec's `cat_ranges`), so a batch of samples waits
  about one round-trip, not one per sample.
- Transient failures (connection refused or reset, timeouts, 5xx, 408, 429) are retried with exponential backoff
  for at most `retry_s` seconds in all (default `TRAINFAST_REMOTE_RETRY_S`, else 30 s), with a warning on the first
  retry; then, or at once for a 404 / 403 / other 4xx, `RemoteStorageError`: one line naming the request, the
  cause and the fix.
- S3 credentials, region and endpoint come from the usual AWS sources (environment, ~/.aws); an S3-compatible
  server is reached with `AWS_ENDPOINT_URL=http://host:port` (read by botocore) or
  `storage_options={"endpoint_url": ...}`.

fsspec, s3fs and aiohttp are the optional `remote` extra: without them a URL is refused with the install line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("trainfast")

SCHEMES = ("http", "https", "s3")
RETRY_ENV = "TRAINFAST_REMOTE_RETRY_S"
DEFAULT_RETRY_S = 30.0
INSTALL = "pip install 'trainfast[remote]'"
FIRST_DELAY_S, MAX_DELAY_S = 0.25, 8.0
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10.0, 60.0
RETRIED_4XX = (408, 429)  # request timeout, too many requests: worth another try
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")

T = TypeVar("T")
DataRoot = Path | str  # a local folder, or a URL (str)


class RemoteStorageError(OSError):
    """A request to remote storage failed for good (after the retries, or at once for a missing or forbidden
    object). The message is one line: the request, the status or cause, the fix. `url` and `status` (the HTTP
    status, None for a connection failure) say which."""

    def __init__(self, message: str, url: str = "", status: int | None = None) -> None:
        super().__init__(message)  # one argument: torch re-raises a worker's exception as type(e)(message)
        self.url, self.status = url, status

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RemoteSupportMissing(ImportError):
    """A URL was given but the `remote` extra (fsspec, s3fs, aiohttp) is not installed."""


def is_url(location: object) -> bool:
    """`location` is a str naming a scheme trainfast reads (http, https, s3); a local path otherwise."""
    if not isinstance(location, str):
        return False
    match = _URL.match(location)
    return match is not None and match.group(1).lower() in SCHEMES


def check_scheme(location: str) -> None:
    """A `scheme://` this module cannot read raises ValueError naming the ones it can."""
    match = _URL.match(location)
    if match and match.group(1).lower() not in SCHEMES:
        raise ValueError(f"{location!r}: the {match.group(1)}:// scheme is not supported; use a local folder, "
                         "http(s)://host/prefix or s3://bucket/prefix")


def join(root: DataRoot, *parts: str) -> DataRoot:
    """`root / parts` for a folder, `root/parts` for a URL."""
    if isinstance(root, Path):
        return root.joinpath(*parts)
    return "/".join([root.rstrip("/"), *parts])


def retry_seconds(retry_s: float | None = None) -> float:
    """The retry budget: `retry_s`, else `$TRAINFAST_REMOTE_RETRY_S`, else 30 s."""
    if retry_s is None:
        text = os.environ.get(RETRY_ENV)
        try:
            retry_s = float(text) if text else DEFAULT_RETRY_S
        except ValueError:
            raise ValueError(f"{RETRY_ENV}={text!r} is not a number; give seconds, e.g. 30") from None
    if not 0 <= retry_s < float("inf"):
        raise ValueError(f"retry_s={retry_s} is not valid; give seconds >= 0 (0: no retries)")
    return retry_s


def status_of(error: BaseException) -> int | None:
    """The HTTP status behind an fsspec error: aiohttp's `status`, botocore's response metadata, or the
    status s3fs and fsspec translate into FileNotFoundError (404) / PermissionError (403)."""
    seen: BaseException | None = error
    for _ in range(5):  # the error and the causes it chains
        if seen is None:
            break
        status = getattr(seen, "status", None)
        if isinstance(status, int):
            return status
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        seen = seen.__cause__ or seen.__context__
    if isinstance(error, FileNotFoundError):
        return 404
    if isinstance(error, PermissionError):
        return 403
    return None


def is_transient(error: BaseException) -> bool:
    """Worth another try: a connection or timeout failure, 5xx, 408, 429. Not a missing or forbidden object."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status = status_of(error)
    if status is not None:
        return status >= 500 or status in RETRIED_4XX
    if isinstance(error, (OSError, TimeoutError)):  # aiohttp's connection errors are OSErrors
        return True
    names = {c.__module__.split(".")[0] + "." + c.__name__ for c in type(error).__mro__}
    # aiohttp's and botocore's own bases (EndpointConnectionError, ReadTimeoutError, ServerDisconnectedError ...)
    return bool(names & {"aiohttp.ClientError", "botocore.BotoCoreError", "botocore.ClientError"})


def describe(error: BaseException) -> str:
    """`503 Service Unavailable`, `connection refused (...)`: the status and reason, or the error, on one line."""
    from http import HTTPStatus

    status = status_of(error)
    text = " ".join(str(error).split()) or type(error).__name__
    if status is not None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        return f"{status} {phrase}".strip()
    text = text if len(text) <= 160 else text[:157] + "..."
    plain = next((words for kind, words in _PLAIN if any(isinstance(e, kind) for e in _chain(error))), None)
    return f"{plain} ({type(error).__name__}: {text})" if plain else f"{type(error).__name__}: {text}"


_PLAIN: tuple[tuple[type[BaseException], str], ...] = (
    (ConnectionRefusedError, "connection refused"), (ConnectionResetError, "connection reset"),
    (ConnectionAbortedError, "connection aborted"), (TimeoutError, "timed out"))


def _chain(error: BaseException) -> list[BaseException]:
    """The error, the OS error aiohttp keeps (`os_error`) and the causes it chains."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo and len(seen) < 8:
        e = todo.pop()
        if e is None or e in seen:
            continue
        seen.append(e)
        os_error = getattr(e, "os_error", None)
        todo += [e.__cause__, e.__context__, os_error if isinstance(os_error, BaseException) else None]
    return seen


def _fix(status: int | None, url: str) -> str:
    if status == 404:
        where = url.rsplit("/", 1)[0]
        return ("the object does not exist: check the URL" + (f", or pack the data there with 'trainfast pack SRC "
                                                               f"{where}'" if url.startswith("s3://") else
                                                               " (the server must serve the packed folder)"))
    if status in (401, 403):
        return ("access denied: check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE for s3://) and the bucket's "
                "or server's permissions")
    if status is not None and 400 <= status < 500 and status not in RETRIED_4XX:
        return "the server refused the request: check the URL"
    return f"is the server up and reachable? Retry later, or allow longer retries with {RETRY_ENV}=<seconds>"


class ObjectStore:
    """Objects under a URL prefix: `read(name)`, `read_ranges(names, starts, ends)`, `size(name)`, `write(name,
    file)`; names are relative to the prefix (`index.json`, `train/shard-000000.tar`). `storage_options` go to
    the fsspec filesystem (s3fs: `endpoint_url`, `key`, `secret`, `client_kwargs`, ...)."""

    def __init__(self, url: str, *, retry_s: float | None = None, storage_options: dict[str, Any] | None = None,
                 writable: bool = False) -> None:
        if not is_url(url):
            check_scheme(url)
            raise ValueError(f"{url!r} is not a URL; give http(s)://host/prefix or s3://bucket/prefix")
        self.url = url.rstrip("/")
        self.protocol = url.split("://", 1)[0].lower()
        if writable and self.protocol != "s3":
            raise ValueError(f"{url!r} is read-only here: trainfast writes to a local folder or s3://bucket/prefix "
                             "(serve a packed folder over HTTP to read it from there)")
        self.retry_s = retry_seconds(retry_s)
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._warned = False
        _require(self.protocol)  # a missing extra fails here, once, not in a loader worker

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None  # each process makes its own client
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def child(self, name: str) -> ObjectStore:
        """The store under `prefix/name` with the same settings."""
        return ObjectStore(f"{self.url}/{name}", retry_s=self.retry_s, storage_options=self.storage_options)

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}" if name else self.url

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem, made on first use (again after a fork)."""
        if self._pid != os.getpid():  # forked: the parent's client and lock are not ours
            self._fs, self._lock, self._pid = None, threading.Lock(), os.getpid()
        fs = self._fs
        if fs is None:
            with self._lock:
                if self._fs is None:
                    self._fs = _filesystem(self.protocol, self.storage_options)
                fs = self._fs
        return fs

    # --- reads ------------------------------------------------------------------------------------------------

    def read(self, name: str) -> bytes:
        """The whole object."""
        url = self.url_of(name)
        data: bytes = self._retry(f"GET {url}", url, lambda: self.fs.cat_file(url))
        return data

    def read_ranges(self, names: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        """Bytes `starts[i]` to `ends[i]` (exclusive) of each object, all requested at once; only the ranges that
        failed are asked again."""
        urls = [self.url_of(n) for n in names]
        results: list[bytes | None] = [None] * len(urls)
        todo = list(range(len(urls)))
        backoff = _Backoff(self)
        while todo:
            got = self.fs.cat_ranges([urls[i] for i in todo], [starts[i] for i in todo], [ends[i] for i in todo],
                                     on_error="return", batch_size=max(len(todo), 1))
            failed: list[tuple[int, BaseException]] = []
            for i, value in zip(todo, got, strict=True):
                if isinstance(value, BaseException):
                    failed.append((i, value))
                else:
                    results[i] = value
            if not failed:
                break
            fatal = next(((i, e) for i, e in failed if not is_transient(e)), None)
            i, error = fatal or failed[0]
            backoff.wait_or_raise(error, f"GET {urls[i]} bytes {starts[i]}-{ends[i] - 1}", urls[i])
            todo = [i for i, _ in failed]
        backoff.succeeded()
        return [r if r is not None else b"" for r in results]

    def size(self, name: str) -> int | None:
        """The object's size in bytes, None when there is none."""
        url = self.url_of(name)

        def info() -> int | None:
            try:
                return int(self.fs.info(url)["size"])
            except FileNotFoundError:
                return None

        return self._retry(f"HEAD {url}", url, info)

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    # --- writes -----------------------------------------------------------------------------------------------

    def write(self, name: str, source: Path) -> None:
        """Upload the local file `source` as `name` (s3: a multipart upload when large)."""
        url = self.url_of(name)
        self._retry(f"PUT {url}", url, lambda: self.fs.put_file(str(source), url))

    def remove(self, name: str) -> None:
        url = self.url_of(name)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(url)

        self._retry(f"DELETE {url}", url, rm)

    def _retry(self, what: str, url: str, call: Callable[[], T]) -> T:
        backoff = _Backoff(self)
        while True:
            try:
                result = call()
            except Exception as e:
                backoff.wait_or_raise(e, what, url)
                continue
            backoff.succeeded()
            return result


class _Backoff:
    """One request's retries: exponential waits from 0.25 s up to 8 s, within the store's `retry_s` in all."""

    def __init__(self, store: ObjectStore) -> None:
        self.store, self.start, self.tries, self.delay = store, time.monotonic(), 0, FIRST_DELAY_S

    def wait_or_raise(self, error: BaseException, what: str, url: str) -> None:
        """Sleep before the next try, or raise `RemoteStorageError` (a permanent error, or the budget spent).
        An error that is not a storage failure at all (a bug) propagates as it is."""
        self.tries += 1
        status = status_of(error)
        if not is_transient(error):
            if status is None and not isinstance(error, OSError):
                raise error
            raise RemoteStorageError(f"{what}: {describe(error)}; {_fix(status, url)}", url, status) from error
        elapsed = time.monotonic() - self.start
        if elapsed + self.delay > self.store.retry_s:
            raise RemoteStorageError(f"{what}: {describe(error)} after {self.tries} tries over {elapsed:.0f} s; "
                                     f"{_fix(status, url)}", url, status) from error
        if not self.store._warned:  # once per outage and process: every batch in flight retries at once
            self.store._warned = True
            log.warning("%s: %s; retrying for up to %.0f s", what, describe(error), self.store.retry_s)
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, MAX_DELAY_S)

    def succeeded(self) -> None:
        if self.tries and self.store._warned:
            log.info("%s is answering again after %d failed tries", self.store.url, self.tries)
            self.store._warned = False


def _require(protocol: str) -> None:
    """Import what `protocol` needs, or raise `RemoteSupportMissing` naming the extra."""
    modules = ["fsspec", "aiohttp"] + (["s3fs"] if protocol == "s3" else [])
    for module in modules:
        try:
            __import__(module)
        except ImportError as e:
            raise RemoteSupportMissing(f"reading {protocol}:// needs the {module} package (not installed): "
                                       f"{INSTALL}") from e


def _filesystem(protocol: str, options: dict[str, Any]) -> Any:
    """An fsspec filesystem whose own retries are off (ours are bounded in time) and whose connections time out."""
    import fsspec

    if protocol == "s3":
        config = {"retries": {"total_max_attempts": 1}, "connect_timeout": CONNECT_TIMEOUT_S,
                  "read_timeout": READ_TIMEOUT_S}
        options = {"config_kwargs": config} | options
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        fs.retries = 1  # s3fs's own retry loop: one try
        return fs
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
    options = {"client_kwargs": {"timeout": timeout}} | options
    return fsspec.filesystem(protocol, skip_instance_cache=True, **options)
