"""The kvstore sidecar: a gRPC server around one in-process Store.

* :func:`create_server(config) -> (server, port)` builds everything (Store, auth registry, audit
  log, metrics, servicers, health checking, reflection) and binds, without starting; tests use
  ``listen = "127.0.0.1:0"``.
* :func:`bootstrap(config)` creates the data directory and, on first start, the admin principal;
  it returns the admin token exactly once (None afterwards).
* :func:`serve(config)` = bootstrap + create_server + start, prints the token once, and stops
  gracefully on SIGINT/SIGTERM.

Transport security: with ``[tls]`` the port is TLS (mutual TLS when ``client_ca_file`` is set).
Without it the server refuses to bind a non-loopback address unless ``allow_insecure_remote``.

Concurrency: ``workers`` threads serve the calls, each holding one while it runs. One tenant
cannot take them all (``limits.max_calls_per_principal``, ``max_streams_per_principal``; the
tenants together leave ``admin_workers`` to the admin and health checks), a stream that moves
nothing for ``limits.stream_idle_s`` is cancelled, and past ``workers + max_queued_calls`` calls
new ones are refused with RESOURCE_EXHAUSTED instead of queued, and counted (see
:class:`kvstore.service_rpc.RpcRunner`, :class:`kvstore.service_limits.QueueBound`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from kvstore.audit import AuditLog
from kvstore.auth import SHARED_PREFIX, AuthRegistry
from kvstore.dirlock import DirLock
from kvstore.errors import FailedPrecondition, InvalidArgument
from kvstore.metrics import ServiceMetrics, StoreCollector
from kvstore.metrics_http import TokenFile, scrape_token, serve_metrics
from kvstore.server_config import ServerConfig, check_certificates, check_key_pair
from kvstore.service import AdminPlane, DataPlane, RpcRunner, add_services
from kvstore.service_limits import REFUSALS_IN_FLIGHT, CallQueue, QueueBound
from kvstore.shm import is_local_target
from proto.kvstore.v1 import admin_pb2, kvstore_pb2

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)


def _credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """The port's TLS credentials, the files checked first: a key that is not the
    certificate's, or a file that holds no PEM, is an InvalidArgument naming the files (grpc
    reported it as a failure to bind the port)."""
    tls = config.tls
    if tls is None:
        return None
    check_key_pair(tls.cert_file, tls.key_file)
    if tls.client_ca_file is not None:
        check_certificates(tls.client_ca_file, "tls.client_ca_file")
    try:
        key, cert = tls.key_file.read_bytes(), tls.cert_file.read_bytes()
        ca = tls.client_ca_file.read_bytes() if tls.client_ca_file else None
    except OSError as exc:
        raise InvalidArgument(f"cannot read TLS files: {exc}") from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


class SidecarServer:
    """A started-or-not gRPC server plus what it owns; ``stop`` closes all of it.

    Behaves like ``grpc.Server`` for ``start``/``stop``/``wait_for_termination``.
    """

    def __init__(self, grpc_server: grpc.Server, store: Any, registry: AuthRegistry, audit: AuditLog,
                 data: DataPlane, health_servicer: health.HealthServicer, metrics_registry: CollectorRegistry,
                 config: ServerConfig, rpc: RpcRunner | None = None) -> None:
        self.grpc_server = grpc_server
        self.store, self.registry, self.audit, self.data = store, registry, audit, data
        self.rpc = rpc  # its limiter counts the calls running (limits.max_calls_per_principal, ...)
        self.health = health_servicer
        self.metrics_registry = metrics_registry
        self.config = config
        self._metrics_http: Any = None
        self._stopped = threading.Event()
        self._closed = False
        self._sweeper: threading.Thread | None = None

    def start(self) -> None:
        m = self.config.metrics
        if m.enabled and m.listen:  # NOTE: first: a port in use fails the start before gRPC serves
            try:
                path = self.config.metrics_token_file
                token = TokenFile(path, scrape_token(path)) if m.auth == "token" else None
                self._metrics_http = serve_metrics(self.metrics_registry, m.listen, token)
            except FailedPrecondition:
                self.stop(0)
                raise
            except OSError as exc:
                self.stop(0)
                raise FailedPrecondition(f"cannot serve metrics on {m.listen!r}: {exc.strerror or exc} "
                                         f"(set [metrics] listen, or enabled = false)") from None
        self.grpc_server.start()
        for name in ("", *SERVICE_NAMES):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.expire_interval_s > 0:
            self._sweeper = threading.Thread(target=self._sweep, name="kvstore-expiry", daemon=True)
            self._sweeper.start()

    def _sweep(self) -> None:
        """Delete expired blocks every ``expire_interval_s`` until stopped."""
        while not self._stopped.wait(self.config.expire_interval_s):
            try:
                self.store.expire()
                self.data.regions.prune()
            except FailedPrecondition:
                return  # the store closed under us
            except Exception:
                log.exception("expiry sweep failed")

    def halt(self, grace: float | None = None) -> None:
        """Stop serving: in-flight calls get ``grace`` seconds, then are cancelled; then wait up
        to ``drain_s`` for their handlers to end. The audit log and the Store stay open."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.grpc_server.stop(self.config.grace_s if grace is None else grace).wait()
        if self._sweeper is not None:
            self._sweeper.join()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()  # NOTE: shutdown() alone kept the port bound
        # NOTE: grpc's stop cancels the calls still running but not their threads: a delete in
        # its Redis part went on, and found the audit log closed (its outcome lost) and the
        # Store closing (whose wait for it serve() reported as the NVMe commit's time)
        if self.rpc is not None and (left := self.rpc.drain(self.config.drain_s)):
            log.warning("%d calls still running %.0f s after the server stopped; closing the audit "
                        "log under them (their outcome may be missing from it)", left, self.config.drain_s)

    def stop(self, grace: float | None = None, *, progress: Callable[[int, int], None] | None = None) -> int:
        """:meth:`halt`, then close regions, the audit log and the Store; returns how many memory
        blocks the Store committed to NVMe as it closed (``progress``: see ``Store.close``)."""
        if self._closed:
            return 0
        self.halt(grace)
        self._closed = True
        self.data.close()
        self.audit.close()
        return int(self.store.close(progress=progress) or 0)

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` the metrics endpoint listens on (the port bound when the config gave
        0: it printed ``:0`` before), None when it does not run."""
        if self._metrics_http is None:
            return None
        host, port = self._metrics_http.server_address[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self.grpc_server.wait_for_termination(timeout)


class _Counted:
    """A ``progress(done, total)`` that remembers the total and the time since it was made,
    and passes each report on as ``progress(what, done, total)``."""

    def __init__(self, what: str, progress: Callable[[str, int, int], None] | None) -> None:
        self.what, self._progress = what, progress
        self.total = self.done = 0
        self._began = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._began

    def __call__(self, done: int, total: int) -> None:
        self.done, self.total = done, total
        if self._progress is not None:
            self._progress(self.what, done, total)


def open_store(config: ServerConfig, clock: Callable[[], float],
               progress: Callable[[int, int], None] | None = None, dir_lock: DirLock | None = None) -> Any:
    from kvstore.store import Store  # the Store pulls in torch and the tiers

    return Store.open(config.store, clock=clock, progress=progress, dir_lock=dir_lock)


def _make_data_dir(config: ServerConfig) -> None:
    """The data directory (``store.path``, ``--data-dir``), private; InvalidArgument naming
    the path when it is not a directory, cannot be made one or cannot be written in (before:
    a traceback)."""
    path = config.data_dir
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:
        raise InvalidArgument(f"store.path (--data-dir) {str(path)!r} is a file, not a directory") from None
    except OSError as exc:
        raise InvalidArgument(f"store.path (--data-dir) {str(path)!r}: cannot create the data directory: "
                              f"{exc.strerror or exc}") from None
    try:
        tempfile.TemporaryFile(dir=path).close()  # NOTE: root passes os.access even on /proc
    except OSError as exc:
        raise InvalidArgument(f"store.path (--data-dir) {str(path)!r}: cannot write in the data directory: "
                              f"{exc.strerror or exc}") from None


def _refuse_live_socket(listen: str) -> None:
    """FailedPrecondition when ``listen`` is a ``unix:`` path that a running server answers on,
    or a file that is not a socket; a stale socket (nothing answers) is left for grpc to replace.
    NOTE: grpc unlinks the path before it binds: a second server on the same socket took it
    from the first, which went on running where no client could ever reach it again."""
    if not listen.startswith("unix:"):
        return  # TCP: the bind itself fails (so_reuseport is off); unix-abstract: the same
    path = listen[len("unix:"):]
    path = path.removeprefix("//")  # unix:///abs/path
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise FailedPrecondition(f"{path}: {exc.strerror or exc}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise FailedPrecondition(f"{path} exists and is not a socket: give the server another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return  # stale: nothing listens
    raise FailedPrecondition(f"another server is listening on {path}; stop it or give this one another path")


def bootstrap(config: ServerConfig, *, clock: Callable[[], float] = time.time) -> str | None:
    """Create the data directory and the first admin; return its token once, else None (for
    embedding: :func:`serve` creates the admin itself, once the server has started)."""
    _make_data_dir(config)
    lock = DirLock(config.data_dir)  # NOTE: not into the directory of a running server
    try:
        registry = AuthRegistry(config.auth_file, clock=clock)
        admin = registry.ensure_admin()
        if admin is None:
            return None
        registry.admin_token_shown(admin)  # NOTE: returned is shown: the caller holds it now
        return admin.token
    finally:
        lock.release()


def create_server(config: ServerConfig, *, store: Any = None, clock: Callable[[], float] = time.time,
                  progress: Callable[[int, int], None] | None = None) -> tuple[SidecarServer, int]:
    """Build and bind (not start) the sidecar; returns it and the bound port (0 for unix sockets).
    ``progress(done, total)``: the Store's index rebuilt from NVMe (see ``Store.open``)."""
    creds = _credentials(config)
    if creds is None and not is_local_target(config.listen) and not config.allow_insecure_remote:
        raise FailedPrecondition(
            f"refusing plaintext on non-loopback address {config.listen!r}: configure [tls] "
            "or set allow_insecure_remote = true")
    m = config.metrics
    if m.enabled and m.listen and not m.allow_remote and not is_local_target(m.listen):
        raise FailedPrecondition(
            f"refusing to serve metrics on non-loopback address {m.listen!r}: the endpoint is plain "
            "HTTP and names every tenant; set [metrics] allow_remote = true to allow it")
    _make_data_dir(config)
    # NOTE: the directory's lock first (a Store given in holds it already): a second server
    # started on a live directory was refused by its Store's lock only after its audit log had
    # opened, closed the live server's action in flight as UNKNOWN and appended a second entry
    # of the same seq (the log's chain broken)
    lock = DirLock(config.data_dir) if store is None else None
    try:
        registry = AuthRegistry(config.auth_file, clock=clock)
        audit = AuditLog(config.audit_file, clock=clock, fsync=config.audit_fsync)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if store is None:
        try:
            store = open_store(config, clock, progress, dir_lock=lock)
        except BaseException:
            audit.close()
            assert lock is not None
            lock.release()  # idempotent: the Store released it if it got that far
            raise
    metrics_registry = CollectorRegistry()
    metrics = ServiceMetrics(metrics_registry, config.metrics.max_tenant_labels)
    metrics_registry.register(StoreCollector(store.stats, metrics.tenants))
    limits = config.limits
    data = DataPlane(store, audit, limits, metrics, copy_threads=config.copy_threads, auth=registry)
    admin = AdminPlane(store, registry, audit, data.regions, metrics, limits.max_message_bytes)
    admin.apply_policies()
    # NOTE: a tenant deletion the server stopped in the middle of (its principal marked, saved)
    # is finished before anything is served: its blocks and data key were left, and a tenant
    # created later under the name read them. Only marked ones: a name with data and no
    # principal may be a principals file lost, to be restored from a backup (see serve)
    admin.finish_deletions()
    calls = config.call_limits
    rpc = RpcRunner(registry, metrics, lambda: store.drop_epoch, calls=calls)

    options = [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    # NOTE: past workers + limits.max_queued_calls calls at once new ones are refused with
    # RESOURCE_EXHAUSTED; without a bound they queued for ever behind calls that never ended.
    # grpc's own bound refused them uncounted: it is a backstop now (see QueueBound)
    pool = CallQueue(config.workers, calls.max_concurrent_rpcs)
    reserved = config.workers - calls.tenant_calls  # admin_workers: the Admin service's and health checks'
    bound = QueueBound(pool, rpc.count_queued, rpc.abort_queued, reserved)
    server = grpc.server(pool, options=options, interceptors=(bound,),
                         maximum_concurrent_rpcs=calls.max_concurrent_rpcs + reserved + REFUSALS_IN_FLIGHT)
    add_services(server, data, admin, rpc)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *SERVICE_NAMES):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    try:
        _refuse_live_socket(config.listen)
        port = server.add_secure_port(config.listen, creds) if creds else server.add_insecure_port(config.listen)
    except (RuntimeError, FailedPrecondition) as exc:
        store.close()
        audit.close()
        raise FailedPrecondition(f"cannot bind {config.listen!r}: {exc}") from None
    return SidecarServer(server, store, registry, audit, data, health_servicer, metrics_registry, config,
                         rpc), port


#: the Store's counters of NVMe records dropped as the index is rebuilt at open
_DROPPED_AT_OPEN = ("orphans_dropped", "keyless_dropped", "unreadable_dropped")


class _Abandoned(BaseException):
    """A second signal during the stop: the commit of memory blocks is given up."""


def _second_signal_abandons(echo: Callable[[str], None], persisted: _Counted) -> None:
    """While the server stops: a signal says the stop is under way (with the commit's
    progress), the next one abandons it. NOTE: the handlers were restored before the stop, so
    a second Ctrl-C or SIGTERM during a commit of many blocks killed the process at once,
    without a word (the progress bar erased), most of the blocks lost."""
    signals = 0

    def during_stop(signum: int, frame: Any) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            raise _Abandoned
        if persisted.total:
            echo(f"stopping: committing memory blocks to NVMe ({persisted.done} of {persisted.total} so "
                 f"far); signal again to abandon the rest (they are lost)")
        else:
            echo("stopping: waiting for the calls in flight to end; signal again to stop at once "
                 "(memory blocks are not committed to NVMe then)")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, during_stop)


def serve(config: ServerConfig, *, echo: Callable[[str], None] = print,
          clock: Callable[[], float] = time.time,
          progress: Callable[[str, int, int], None] | None = None) -> None:
    """Run the sidecar until SIGINT/SIGTERM. Prints the admin token the first time only (or at
    the next start, a new one, when the start that made it died before printing it), how
    many blocks were recovered from NVMe at start and how many were committed to it at stop;
    ``progress(what, done, total)`` while either runs."""
    done = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        done.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = None
    key_file: os.PathLike[str] | None = None
    ready = False
    if config.torch_threads:
        import torch  # the Store imports it anyway

        torch.set_num_threads(config.torch_threads)
    try:
        # NOTE: the admin is created only once the server is up (below): created first, by a
        # start that then failed (a busy port, a refused config), its token was never shown
        # and no later start printed one
        _make_data_dir(config)
        had_principals = config.auth_file.exists()
        key_file = config.store.master_key_file or config.data_dir / "master.key"
        new_key = config.store.master_key is None and not key_file.exists()
        # NOTE: marked before the Store can write the key (the key's write fsyncs the directory
        # after, so the mark is on disk first), removed only once the notice was printed: a
        # start killed in between (the key written, the notice not yet printed) left a key that
        # nobody was told to back up, and no later start said it, since the file existed
        unshown = key_file.with_name(f"{key_file.name}.unshown")
        if new_key and (config.store.nvme_bytes or config.store.remote is not None):
            try:
                unshown.parent.mkdir(parents=True, exist_ok=True)
                unshown.touch()
            except OSError as exc:  # the notice still comes from this start, if it lives
                log.warning("could not mark the master key's notice as not yet shown (%s): %s", unshown, exc)

        def announce_key() -> None:
            # NOTE: said only once the server was ready: a first start that failed after the
            # Store made the key (the metrics or gRPC port busy) never said it, and no later
            # start did, since the file existed by then: nobody was told to back it up
            nonlocal new_key
            if (new_key or unshown.exists()) and key_file.exists():
                echo(f"generated master key: {key_file} (back it up: without it NVMe blocks are unreadable)")
                if echo is print:  # NOTE: print buffers a pipe: shown is written out
                    print(end="", flush=True)
            new_key = False
            unshown.unlink(missing_ok=True)  # shown, or no key was made (this start failed first)
        recovered = _Counted("recovering blocks from NVMe", progress)
        server, port = create_server(config, clock=clock, progress=recovered)
        server.start()
        # NOTE: saved as not shown until the echo below: a start that died in between (it
        # printed the token after the lines below) left an admin whose token nobody saw, and no
        # later start printed one; the next start now replaces that token and prints it
        admin = server.registry.ensure_admin()
        if admin is not None:  # NOTE: the first admin's creation was the one change not on record
            if admin.replaced:
                server.audit.append("kvstore serve", "tenant.rotate", admin.name, "OK",
                                    "role=admin (its token was never shown: a start died first)")
            else:
                server.audit.append("kvstore serve", "tenant.create", admin.name, "OK", "role=admin (first start)")
        if config.listen.startswith("unix:"):
            echo(f"kvstore serving on {config.listen}")
        else:
            echo(f"kvstore serving on {config.listen.rpartition(':')[0]}:{port}")
        echo(f"data directory: {config.data_dir}")
        if recovered.total:
            # NOTE: the records read, less those dropped as they were read (orphans of a crash,
            # deleted tenants', unreadable ones): it announced blocks the open had just dropped
            stats = server.store.stats()
            kept = stats["tiers"]["nvme"]["blocks"]
            dropped = {k: n for k in _DROPPED_AT_OPEN if (n := stats["counters"].get(k, 0))}
            why = f", dropped {', '.join(f'{n} {k}' for k, n in dropped.items())}" if dropped else ""
            echo(f"recovered {kept} blocks from NVMe ({recovered.seconds:.1f} s{why})")
        if getattr(server.store, "disk_warning", None):
            echo(f"warning: {server.store.disk_warning}")
        announce_key()
        if admin is not None:
            echo(f"admin token (shown once, store it now): {admin.token}")
            if echo is print:  # NOTE: print buffers a pipe: shown is written out
                print(end="", flush=True)
            server.registry.admin_token_shown(admin)
        keyring = getattr(server.store, "keyring", None)
        orphans = [t for t in keyring.tenants() if not t.startswith(SHARED_PREFIX)] if keyring is not None else []
        if not had_principals and orphans:
            echo(f"warning: no principals file ({config.auth_file}), but the store holds the data of "
                 f"{len(orphans)} tenants: their tokens are gone; restore the file from a backup, or "
                 f"delete those tenants (a tenant created under one of their names reads its blocks)")
        if config.metrics.enabled and config.metrics.listen:
            guard = (f" (bearer token in {config.metrics_token_file})" if config.metrics.auth == "token"
                     else " (no authentication: [metrics] auth = \"none\")")
            echo(f"metrics: http://{server.metrics_address}/metrics{guard}")
        echo("ready (Ctrl-C or SIGTERM to stop)")
        ready = True
        done.wait()
    finally:
        if key_file is not None:
            announce_key()
        if server is None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        else:
            persisted = _Counted("committing memory blocks to NVMe", progress)
            _second_signal_abandons(echo, persisted)
            try:
                server.halt()  # NOTE: first: the calls' wait is not the commit's time below
                committed = server.stop(progress=persisted)
            except _Abandoned:
                echo(f"abandoned: {persisted.done} of {persisted.total} memory blocks were committed to "
                     f"NVMe, the rest are lost")
                raise SystemExit(130) from None
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            lost = getattr(server.store, "uncommitted_at_close", 0)
            if lost:  # NOTE: the Store only logged them, and serve said nothing of them
                echo(f"warning: {lost} memory blocks could not be committed to NVMe (its capacity or a "
                     f"tenant's NVMe quota is full): they are gone")
            if persisted.total:
                echo(f"stopped: {committed} blocks of HBM and DRAM committed to NVMe "
                     f"({persisted.seconds:.1f} s)")
            elif ready:  # NOTE: a start that failed said "stopped" too, over its error
                echo("stopped")  # NOTE: with nothing to commit, a stop printed nothing at all
