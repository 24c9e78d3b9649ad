"""The Prometheus HTTP endpoint of the sidecar, behind a bearer token.

The endpoint's labels name every tenant and its usage (bytes per tier, hits, saved prefill
tokens, quota refusals). Served open on loopback, any local process could read them: a tenant
whose own ``Stats`` is scoped to itself watched every other tenant's activity there. So by
default (``[metrics] auth = "token"``) a scrape must send ``Authorization: Bearer <token>``,
the token kept in a file only the server's user may read (Prometheus reads it with
``authorization: {credentials_file: ...}``); other requests get 401.

* :func:`scrape_token` reads the token file, making it (mode 0600) the first time.
* :func:`serve_metrics` serves a registry over HTTP (``prometheus_client.make_wsgi_app`` on a
  threading ``wsgiref`` server), with the token check in front when a token is given.
"""

from __future__ import annotations

import errno
import hmac
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


def _guarded(app: Callable[..., Iterable[bytes]], token: str) -> Callable[..., Iterable[bytes]]:
    expected = token.encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        scheme, _, given = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                             ("WWW-Authenticate", 'Bearer realm="kvstore metrics"')])
        return [b"kvstore metrics: send Authorization: Bearer <token> (the token is in [metrics] token_file)\n"]

    return guarded


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # NOTE: one stderr line per scrape otherwise


def serve_metrics(registry: CollectorRegistry, listen: str, token: str | None = None) -> WSGIServer:
    """Serve ``registry`` on ``host:port`` (an IPv6 host in brackets: ``[::1]:9464``) in a
    daemon thread; with ``token``, only to requests that send it as a bearer token. Returns the
    server (``shutdown()`` to stop; ``server_address`` is the bound one)."""
    from kvstore.server_config import split_host_port

    host, port = split_host_port(listen)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    app = make_wsgi_app(registry)
    server = make_server(host, port, _guarded(app, token) if token is not None else app,
                         server_class=server_class, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="kvstore-metrics", daemon=True).start()
    return server
