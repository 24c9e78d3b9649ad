"""The Prometheus HTTP endpoint of the sidecar, behind a bearer token.

The endpoint's labels name every tenant and its usage (bytes per tier, hits, saved prefill
tokens, quota refusals). Served open on loopback, any local process could read them: a tenant
whose own ``Stats`` is scoped to itself watched every other tenant's activity there. So by
default (``[metrics] auth = "token"``) a scrape must send ``Authorization: Bearer <token>``,
the token kept in a file only the server's user may read (Prometheus reads it with
``authorization: {credentials_file: ...}``); other requests get 401.

* :func:`scrape_token` reads the token file, making it (mode 0600) the first time;
  :class:`TokenFile` reads it again when it is replaced (a rotation).
* :func:`serve_metrics` serves a registry over HTTP (``prometheus_client.make_wsgi_app`` on a
  threading ``wsgiref`` server), with the token check in front when a token is given.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from kvstore.errors import FailedPrecondition
from kvstore.paths import private_file_problem

#: printable ASCII without spaces: what an HTTP header carries unchanged
log = logging.getLogger(__name__)
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


def scrape_token(path: Path) -> str:
    """The scrape token in ``path``; a new random one written there (mode 0600) when the file
    does not exist. FailedPrecondition naming the file when other users may read or write it,
    or it holds no usable token (empty, spaces or non-ASCII inside)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_token(path)
    except OSError as exc:
        raise FailedPrecondition(f"metrics token file {path}: cannot create it: {exc.strerror or exc}") from None
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    return token


def _read_token(path: Path) -> str:
    try:
        if problem := private_file_problem(path):
            raise FailedPrecondition(f"metrics token file {path} {problem}")
        text = path.read_bytes().decode("ascii").strip()
    except UnicodeDecodeError:
        text = ""
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FailedPrecondition(f"metrics token file {path} vanished while it was read") from None
        raise FailedPrecondition(f"metrics token file {path}: cannot read it: {exc.strerror or exc}") from None
    if not text or not set(text) <= _TOKEN_CHARS:
        raise FailedPrecondition(f"metrics token file {path} holds no token (one line of printable ASCII "
                                 f"without spaces); delete it to have a new one made at start")
    return text


class TokenFile:
    """The scrape token, read again from ``path`` whenever the file changes (its inode, size,
    mtime, mode, owner or ctime): Prometheus reads ``credentials_file`` at every scrape, so replacing the file rotates
    the token. NOTE: it was read once at start, and a leaked token stayed good after the file
    was replaced or deleted. A file that turns unreadable, loose (group/other access) or empty
    refuses every scrape until it is fixed (logged once per change), never the old token."""

    def __init__(self, path: Path, token: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, ...] | None = self._signature()
        self._token: str | None = token

    def _signature(self) -> tuple[int, ...] | None:
        # NOTE: mode, owner and ctime too: a chmod that made the file world-readable changes none
        # of inode, size and mtime, and the token stayed accepted from a file anyone could read
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid, st.st_ctime_ns

    def current(self) -> str | None:
        """The token scrapes must send now; None: none is accepted (the file is not usable)."""
        seen = self._signature()
        with self._lock:
            if seen != self._seen:
                self._seen = seen
                try:
                    self._token = _read_token(self.path) if seen is not None else None
                except FailedPrecondition as exc:
                    self._token = None
                    log.warning("metrics scrapes are refused until the token file is fixed: %s", exc)
                if self._token is None and seen is None:
                    log.warning("metrics scrapes are refused: the token file %s is gone", self.path)
            return self._token


def _guarded(app: Callable[..., Iterable[bytes]], token: TokenFile) -> Callable[..., Iterable[bytes]]:
    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
        expected = token.current()
        if expected is not None and scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode(), expected.encode()):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                             ("WWW-Authenticate", 'Bearer realm="kvstore metrics"')])
        return [b"kvstore metrics: send Authorization: Bearer <token> (the token is in [metrics] token_file)\n"]

    return guarded


#: seconds a scrape's connection may stay silent, and scrapes served at once: past them the
#: connection is closed. NOTE: one thread per connection without either, a local process
#: holding ~1,000 idle connections (no token needed) took every file descriptor of the
#: sidecar, whose gRPC service then failed too
HANDLER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 64  # NOTE: 5 (socketserver's): a burst of connects waited out SYN retries

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # busy: closed at once, no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        # NOTE: socketserver printed a traceback to stderr; called inside its except block
        log.debug("metrics request from %s failed", client_address, exc_info=True)  # noqa: LOG014

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Quiet(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = HANDLER_TIMEOUT_S  # read at setup: a test may lower it
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # NOTE: one stderr line per scrape otherwise


def serve_metrics(registry: CollectorRegistry, listen: str, token: TokenFile | None = None) -> WSGIServer:
    """Serve ``registry`` on ``host:port`` (an IPv6 host in brackets: ``[::1]:9464``) in a
    daemon thread; with ``token``, only to requests that send its current token as a bearer
    token. Returns the server (``shutdown()`` to stop; ``server_address`` is the bound one)."""
    from kvstore.server_config import split_host_port

    host, port = split_host_port(listen)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    app = make_wsgi_app(registry)
    server = make_server(host, port, _guarded(app, token) if token is not None else app,
                         server_class=server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="kvstore-metrics", daemon=True).start()
    return server
