"""CLI commands of the sidecar: ``serve`` and the operators' commands (over the Admin API).

::

    kvstore serve [--config kvstore.toml] [--listen HOST:PORT] [--data-dir DIR]
    kvstore tenant add NAME [--role tenant|publisher|admin] [--namespace shared:x ...]
    kvstore tenant rotate NAME | delete NAME [--yes] [--timeout S] | list [--json] | grant NAME shared:x [--revoke]
    kvstore policy get NAME [--json] | set NAME [--ttl 1h] [--quota hbm=1GiB ...] [--priority N] [--json]
    kvstore session list [--tenant NAME] [--json] | close TENANT SESSION_ID
    kvstore model list [--json] | purge FINGERPRINT [--yes] [--timeout S] | policy FINGERPRINT [--ttl 7d | --clear]
    kvstore stats [--json]
    kvstore audit [--limit N] [--since SEQ] [--json]

Admin commands reach a running server: ``--target`` (env ``KVSTORE_TARGET``, default
``127.0.0.1:50551``) with ``--token`` (env ``KVSTORE_ADMIN_TOKEN``). TLS: ``--ca-file`` (env
``KVSTORE_CA_FILE``) the CA bundle the server's certificate chains to, ``--cert-file`` and
``--key-file`` (env ``KVSTORE_CERT_FILE``, ``KVSTORE_KEY_FILE``) a client certificate for a
server that requires mutual TLS, ``--server-name`` (env ``KVSTORE_SERVER_NAME``) the name to
check the server's certificate against when it is not the target's host. Any of them turns TLS on.

A deletion (``tenant delete``) waits for the server's answer with no deadline unless
``--timeout`` gives one, showing the time elapsed meanwhile (``kvstore.cli_views.waiting``),
and prints how many blocks went: the server goes on deleting when a deadline passes, so a
deadline error only says the outcome is unknown (it read as a failure, and a retry failed
the same way while the first deletion went on). Sizes are shown as ``64.0 GiB``; ``--json``
prints the raw document. ``serve`` shows its recovery and commit as a bar on a terminal and as
plain lines otherwise.

``tenant list`` shows a principal marked as being deleted with the state ``deleting`` (a
deletion in progress, or one a failed step left for the next start or ``tenant delete`` to
finish). ``session list`` shows the open sessions (state, blocks held and pinned in HBM, idle
time) and ``session close`` ends one that an engine left behind, as the engine's own close would
(it pinned HBM until the idle expiry). ``model purge`` removes every block of a model fingerprint
(a rollout's old model), waiting as ``tenant delete`` does; ``model policy`` shows, sets
(``--ttl``) or removes (``--clear``) a model's TTL, which ages its blocks out instead.

``audit`` shows the newest ``--limit`` entries (1000), as ``tail`` does, and says on stderr how
many earlier ones it left out (it showed the oldest 1000, the newest actions not at all);
``--since SEQ`` reads forward from a point instead, saying when later entries were left out.

``audit``, ``tenant list``, ``session list`` and ``model list`` print a table on a terminal wide
enough for it with every cell whole (audit's target and detail, a principal's namespaces,
wrapped), else, and off a terminal, one complete tab-separated line per row after a header line,
for ``grep`` and ``cut -f`` (``kvstore.cli_views.whole_table``): rich cut what did not fit to
an ellipsis, the session ids, model revisions and tenant names an operator copies into the next
command among them.

What the server sends back (names, audit entries, error messages) is printed with its rich
markup escaped and its control characters, tabs, line and paragraph separators (U+2028, U+2029)
shown as ``\\xNN`` / ``\\uNNNN`` escapes, a backslash as ``\\\\`` (so that a tab and the
four characters ``\\x09`` differ): an audit entry records what a caller sent, which must not
recolour the table, drive the terminal or break a line.

Exposed as ``admin_app`` (a ``typer.Typer`` holding every command above) and :func:`register`,
which adds them to the main ``kvstore`` app; the command functions are plain and importable.
"""

from __future__ import annotations

import json
import time
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kvstore import sizes
from kvstore.cli_views import (
    Listing,
    PlainProgress,
    audit_listing,
    models_listing,
    one_line_listings,
    policy_view,
    sessions_listing,
    stats_view,
    tenants_listing,
    tsv_line,
    ttl_text,
    waiting,
    whole_table,
)
from kvstore.durations import parse_duration
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.server_config import DEFAULT_LISTEN

TargetOpt = Annotated[str, typer.Option("--target", envvar="KVSTORE_TARGET", help="Server address.")]
TokenOpt = Annotated[str, typer.Option("--token", envvar="KVSTORE_ADMIN_TOKEN", help="Admin bearer token.")]
CaOpt = Annotated[Path | None, typer.Option("--ca-file", envvar="KVSTORE_CA_FILE", help="CA bundle for TLS.")]
CertOpt = Annotated[Path | None, typer.Option(
    "--cert-file", envvar="KVSTORE_CERT_FILE", help="Client certificate (PEM) for mutual TLS; with --key-file.")]
KeyOpt = Annotated[Path | None, typer.Option(
    "--key-file", envvar="KVSTORE_KEY_FILE", help="Private key (PEM) of --cert-file.")]
ServerNameOpt = Annotated[str | None, typer.Option(
    "--server-name", envvar="KVSTORE_SERVER_NAME",
    help="Name to check the server's TLS certificate against (default: the target's host).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="The raw JSON document instead of a table.")]
#: what the admin commands other than deletions wait for an answer
ADMIN_TIMEOUT_S = 30.0
#: what an operator is told when a deletion's answer did not come in time
OUTCOME_UNKNOWN = ("outcome unknown: the server may still be deleting; "
                   "check `kvstore tenant list` / `kvstore audit`")


def parse_size(text: str) -> int:
    """``"512MiB"`` / ``"2g"`` / ``"1048576"`` -> bytes (:func:`kvstore.sizes.parse_size`)."""
    try:
        return sizes.parse_size(text)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from None


def _admin(target: str, token: str, ca_file: Path | None, cert_file: Path | None = None,
           key_file: Path | None = None, server_name: str | None = None, *,
           timeout: float | None = ADMIN_TIMEOUT_S):
    """An AdminClient for the connection options (``timeout``: its calls' deadline, None for
    none); InvalidArgument naming the option when a TLS file cannot be read, holds no PEM, or
    a client certificate comes without its key."""
    from kvstore.admin_client import AdminClient
    from kvstore.client import ClientTLS
    from kvstore.server_config import check_certificates, check_key_pair

    _need_token(token)
    if (cert_file is None) != (key_file is None):
        given, missing = ("--cert-file", "--key-file") if key_file is None else ("--key-file", "--cert-file")
        raise InvalidArgument(f"{given} needs {missing}: a client certificate (mutual TLS) takes both")
    if ca_file is not None:
        check_certificates(ca_file, "--ca-file")
    if cert_file is not None and key_file is not None:
        check_key_pair(cert_file, key_file, cert_option="--cert-file", key_option="--key-file")
    if server_name is not None and not server_name.strip():
        raise InvalidArgument("--server-name is empty: give the name in the server's certificate, or omit it")
    if ca_file is None and cert_file is None and not server_name:
        return AdminClient(target, token, timeout=timeout)
    tls = ClientTLS(root_cert_file=ca_file, cert_file=cert_file, key_file=key_file, server_name=server_name)
    return AdminClient(target, token, timeout=timeout, tls=tls)


def _need_token(token: str) -> None:
    if not token:
        raise typer.BadParameter("an admin token is required (--token or KVSTORE_ADMIN_TOKEN)")


def _shown(value: object) -> str:
    """``value`` safe to print with rich: markup escaped, control and format characters (ESC,
    CR, bidi overrides, ...) shown as ``\\xNN`` / ``\\uNNNN`` instead of sent to the terminal."""
    return escape(_printable(value))


def _printable(value: object) -> str:
    """``value`` safe to print as plain text: :func:`_shown` without the markup escapes."""
    return "".join(map(_printable_char, str(value)))


def _printable_char(c: str) -> str:
    # NOTE: a backslash was printed as it is, so a TAB (\x09) and the four characters "\x09"
    # read the same; and U+2028 / U+2029 (categories Zl, Zp: str.splitlines() breaks there)
    # went out raw
    if c == "\\":
        return "\\\\"
    if unicodedata.category(c) not in _ESCAPED:
        return c
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"


#: the Unicode categories shown as escapes: control, format, surrogate, private use, unassigned,
#: line and paragraph separators
_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _fail(exc: KVStoreError) -> None:
    """Print ``exc`` on stderr and exit 1. A message of several lines (a config's problems, one
    per line) keeps its line breaks; each line is :func:`_shown` on its own, so every other
    control character is still escaped (the whole message through ``_shown`` printed the
    problems on one line joined by a literal ``\\x0a``)."""
    text = "\n".join(_shown(line) for line in str(exc).split("\n"))
    # soft_wrap: an error is one line per problem, not broken at the terminal's width
    Console(stderr=True).print(f"[red]error[/red] ({_shown(exc.code)}): {text}", soft_wrap=True)
    raise typer.Exit(1)


# -- serve ----------------------------------------------------------------------------------------
def serve(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file.")] = None,
    listen: Annotated[str | None, typer.Option("--listen", help=f"host:port (default {DEFAULT_LISTEN}).")] = None,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Store directory.")] = None,
) -> None:
    """Run the kvstore gRPC sidecar (embedded defaults when there is no config file).

    Every config field is documented in kvstore/server_config.py (top level, \\[tls], \\[limits],
    \\[metrics]), kvstore/config.py (\\[store]) and tiers/remote_config.py (\\[store.remote])."""
    # NOTE: the backslashes keep rich (typer's help) from reading the section names as markup:
    # --help printed "(top level, , , )"
    from kvstore import memtune, server_config
    from kvstore.server import serve as run

    try:
        cfg = server_config.load(config, data_dir=data_dir, overrides={"listen": listen})
        if data_dir is not None and config is not None:
            cfg = server_config.build({**cfg.model_dump(exclude={"store"}),
                                       "store": {**cfg.store.model_dump(), "path": str(data_dir)}})
        memtune.reexec_with_streaming_copies(cfg.streaming_copy_bytes)  # returns once it is set
        with _progress_bars() as progress:
            run(cfg, echo=typer.echo, progress=progress)
    except KVStoreError as exc:
        _fail(exc)


@contextmanager
def _progress_bars(console: Console | None = None) -> Iterator[Callable[[str, int, int], None]]:
    """``progress(what, done, total)`` on stderr per ``what`` (the index rebuilt from NVMe at
    start, memory blocks committed to NVMe at stop): on a terminal a bar, shown from its first
    report and gone once it is full; otherwise plain lines (:class:`PlainProgress`), the bar
    being a live display that draws nothing there (under systemd or docker, serve said nothing
    for the tens of seconds either took)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield PlainProgress(lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True))
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    tasks: dict[str, Any] = {}

    def report(what: str, done: int, total: int) -> None:
        if what not in tasks:
            bar.start()
            tasks[what] = bar.add_task(what, total=total)
        bar.update(tasks[what], completed=done)
        if done >= total:
            bar.remove_task(tasks[what])
            bar.stop()

    try:
        yield report
    finally:
        if bar.live.is_started:  # NOTE: stopping a bar never started prints an empty line
            bar.stop()


# -- tenants --------------------------------------------------------------------------------------
tenant_app = typer.Typer(help="Create, rotate, delete and list tenants.", no_args_is_help=True)


@tenant_app.command("add")
def tenant_add(
    name: str,
    role: Annotated[str, typer.Option(help="tenant | publisher | admin")] = "tenant",
    namespace: Annotated[list[str] | None, typer.Option(
        "--namespace", "-n", help="Shared namespace (shared:NAME) to read (tenant) or publish (publisher).")] = None,
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Create a tenant and print its token (shown once)."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            typer.echo(admin.create_tenant(name, role, namespace or []))
    except KVStoreError as exc:
        _fail(exc)


@tenant_app.command("rotate")
def tenant_rotate(
    name: str, target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Replace a tenant's token (the old one stops working) and print the new one."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            typer.echo(admin.rotate_token(name))
    except KVStoreError as exc:
        _fail(exc)


@tenant_app.command("delete")
def tenant_delete(
    name: str,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="Stop waiting after this many seconds (default: wait for the server's answer); "
                          "the server goes on deleting either way.")] = None,
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Delete a tenant: its token, its data key and its blocks on every tier; print how many
    blocks went."""
    if timeout is not None and not timeout > 0:
        raise typer.BadParameter(f"--timeout must be more than 0 seconds, got {timeout}")
    _need_token(token)  # NOTE: it asked for confirmation first, then said the token was missing
    if not yes:
        typer.confirm(f"delete tenant {name!r} and destroy all its blocks?", abort=True)
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name, timeout=timeout) as admin:
            blocks, seconds = _deleting(f"deleting tenant {_shown(name)}", lambda: admin.delete_tenant(name),
                                        timeout)
        typer.echo(f"deleted {name}: {blocks} blocks removed ({seconds:.1f} s)")
    except KVStoreError as exc:
        _fail(exc)


def _deleting(what: str, call: Callable[[], int], timeout: float | None) -> tuple[int, float]:
    """``call()`` (a deletion, answering how many blocks went) and the seconds it took, with
    :func:`waiting` shown meanwhile. The server goes on deleting when the client stops waiting,
    so a deadline (``--timeout``) or a Ctrl-C is an unknown outcome, worded so; it read as a
    failure (DEADLINE_EXCEEDED, after 30 s of silence) of a deletion that then succeeded."""
    began = time.monotonic()
    try:
        with waiting(what, Console(stderr=True)):
            blocks = call()
    except KVStoreError as exc:
        if exc.code != "DEADLINE_EXCEEDED":
            raise
        after = f" (no answer within --timeout {timeout:g} s)" if timeout is not None else ""
        unknown = KVStoreError(OUTCOME_UNKNOWN + after)
        unknown.code = exc.code
        raise unknown from None
    except KeyboardInterrupt:
        Console(stderr=True).print(f"stopped waiting: {escape(OUTCOME_UNKNOWN)}", soft_wrap=True)
        raise typer.Exit(130) from None
    return blocks, time.monotonic() - began


@tenant_app.command("list")
def tenant_list(
    as_json: JsonOpt = False, target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """List principals with their roles, shared namespaces, creation time and state (deleting:
    a deletion in progress, or one left unfinished that the next start or tenant delete
    finishes). A table on a terminal wide enough, else one tab-separated line each (--json:
    the raw list)."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            rows = admin.list_tenants()
    except KVStoreError as exc:
        _fail(exc)
    _list(rows, as_json, tenants_listing(rows, _when))


@tenant_app.command("grant")
def tenant_grant(
    name: str, namespace: str,
    revoke: Annotated[bool, typer.Option("--revoke", help="Remove the grant instead.")] = False,
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Grant (or revoke) a shared namespace to a tenant or publisher."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            admin.grant(name, namespace, revoke=revoke)
        typer.echo(f"{'revoked' if revoke else 'granted'} {namespace} {'from' if revoke else 'to'} {name}")
    except KVStoreError as exc:
        _fail(exc)


# -- policies -------------------------------------------------------------------------------------
policy_app = typer.Typer(help="Per-tenant TTL, quotas and priority.", no_args_is_help=True)


@policy_app.command("get")
def policy_get(
    name: str, as_json: JsonOpt = False, target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "",
    ca_file: CaOpt = None, cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Print a tenant's policy (quotas as sizes; --json: as the raw document)."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            _print_policy(admin.get_policy(name), as_json)
    except KVStoreError as exc:
        _fail(exc)


def _print_policy(policy: dict[str, Any], as_json: bool) -> None:
    _show(policy, as_json, policy_view)


def _show(doc: Any, as_json: bool, view: Callable[[Any, Callable[[object], str]], Any]) -> None:
    """``doc`` as the raw JSON document (``--json``) or as ``view`` draws it for people."""
    if as_json:
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        _console().print(view(doc, _shown), soft_wrap=True)


def _list(doc: list[Any], as_json: bool, listing: Listing) -> None:
    """``doc`` (a list) as the raw JSON document (``--json``) or as :func:`_print_rows`."""
    if as_json:
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        _print_rows(listing)


def _print_rows(listing: Listing) -> None:
    """``listing`` as a table on a terminal where it fits with every cell whole, else (and
    always off a terminal) a header line and one complete tab-separated line per row. rich cut
    every cell that did not fit to an ellipsis: on 80 columns or in a pipe the session ids,
    model names and revisions, tenant names (and audit actions) an operator copies or greps."""
    console = Console()
    if console.is_terminal:
        table = whole_table(listing, listing.rows(_shown), console.width)
        if table is not None:
            console.print(table)
            return
    typer.echo(tsv_line([f.name for f in listing.fields]))
    for row in listing.rows(_printable):  # every field escaped, tabs too: a name is what a caller sent
        typer.echo(tsv_line(row))


def _console() -> Console:
    """A Console on stdout; 80 columns wide where ``COLUMNS`` says 0 (rich drew nothing at all)."""
    console = Console()
    return console if console.width > 0 else Console(width=80)


def _duration(text: str) -> float:
    """``--ttl``'s value in seconds (:func:`kvstore.durations.parse_duration`); a bad one is the
    option's error."""
    try:
        return parse_duration(text)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from None


@policy_app.command("set")
def policy_set(
    name: str,
    ttl: Annotated[float | None, typer.Option("--ttl", parser=_duration, metavar="DURATION", help=(
        "Block TTL (3600, 90s, 30m, 1.5h, 7d): the default of a put that gives none, and the most any "
        "put gets; setting or lowering it caps the blocks already stored at now + TTL (omit: none)."))] = None,
    quota: Annotated[list[str] | None, typer.Option("--quota", help=(
        "TIER=SIZE (hbm, dram, nvme, remote), e.g. hbm=2GiB; repeat. 0 keeps the tenant out of that "
        "tier: with hbm=0 a put in a session (pinned in HBM) is refused."))] = None,
    priority: Annotated[int, typer.Option(help="Eviction priority: when a tier makes room, every block of a lower priority goes first (default 0).")] = 0,
    as_json: JsonOpt = False,
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Replace a tenant's policy (TTL, per-tier quotas, priority) and print the new one."""
    sized: list[tuple[str, int]] = []
    for item in quota or []:
        tier, sep, size = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--quota {item!r}: use TIER=SIZE")
        sized.append((tier.strip(), parse_size(size)))
    try:
        quotas = _quotas(sized)
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            _print_policy(admin.set_policy(name, ttl_s=ttl, quota_bytes=quotas, priority=priority), as_json)
    except KVStoreError as exc:
        _fail(exc)


def _quotas(sized: list[tuple[str, int]]) -> dict[str, int]:
    """``--quota`` values keyed by tier label; InvalidArgument for an unknown tier or one given
    twice. (Keyed by spelling, ``hbm=1MiB`` and ``HBM=2MiB`` both went to the server, which
    kept one of them silently.)"""
    from kvstore.block import Tier

    return {t.label: size for t, size in Tier.each_once(sized, what="--quota: tier").items()}


# -- sessions -------------------------------------------------------------------------------------
session_app = typer.Typer(help="List and close the open sessions (their blocks pinned in HBM).",
                          no_args_is_help=True)


@session_app.command("list")
def session_list(
    tenant: Annotated[str, typer.Option("--tenant", help=(
        "Only this namespace's: a tenant, or shared:NAME (a publisher's sessions in a shared "
        "namespace are listed under it, not under the publisher)."))] = "",
    as_json: JsonOpt = False, target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "",
    ca_file: CaOpt = None, cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """List the open sessions: state, blocks held and pinned (sizes), idle time. A table on a
    terminal wide enough, else one tab-separated line each (--json: the raw list)."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            rows = admin.list_sessions(tenant)
    except KVStoreError as exc:
        _fail(exc)
    _list(rows, as_json, sessions_listing(rows))


@session_app.command("close")
def session_close(
    tenant: Annotated[str, typer.Argument(help=(
        "The session's namespace, as `session list` shows it: the tenant, or shared:NAME for a "
        "publisher's session in a shared namespace."))],
    session_id: Annotated[str, typer.Argument(help="The session's id.")],
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "",
    ca_file: CaOpt = None, cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Close a session (an engine that died left it pinning HBM): its blocks are unpinned and
    stay as prefix cache. Prints what it released."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            s = admin.close_session(tenant, session_id)
    except KVStoreError as exc:
        _fail(exc)
    # NOTE: it said every pinned block was unpinned, also those another session pins still
    shared = s["pinned_blocks"] - s["only_pinned_blocks"]
    _console().print(f"closed session {_shown(session_id)} of {_shown(tenant)} ({_shown(s['state'])}): "
                     f"{s['only_pinned_blocks']} blocks ({sizes.format_size(s['only_pinned_bytes'])}) of HBM "
                     f"unpinned, of {s['blocks']} held"
                     + (f"; {shared} stay pinned by other sessions" if shared else ""), soft_wrap=True)


# -- models ---------------------------------------------------------------------------------------
model_app = typer.Typer(help="List the models stored, remove one's blocks (after a rollout).", no_args_is_help=True)


@model_app.command("list")
def model_list(
    as_json: JsonOpt = False, target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """List the models with blocks on the server, most bytes first: fingerprint (what model
    purge takes), model, revision, dtype, block tokens, blocks, size, tenants. A table on a
    terminal wide enough, else one tab-separated line each (--json: the raw list)."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            rows = admin.list_models()
    except KVStoreError as exc:
        _fail(exc)
    _list(rows, as_json, models_listing(rows))


@model_app.command("purge")
def model_purge(
    fingerprint: Annotated[str, typer.Argument(help=(
        "The model's fingerprint: 32 hex digits, as `kvstore model list` shows it "
        "(ModelSpec.fingerprint.hex())."))],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", help="Stop waiting after this many seconds (default: wait for the server's answer); "
                          "the server goes on purging either way.")] = None,
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Remove every block of a model fingerprint, every tenant's, on every tier (a rollout's
    old model); print how many blocks went. Audited as model.purge."""
    if timeout is not None and not timeout > 0:
        raise typer.BadParameter(f"--timeout must be more than 0 seconds, got {timeout}")
    fp = _fingerprint_arg(fingerprint)
    _need_token(token)  # NOTE: it asked for confirmation first, then said the token was missing
    if not yes:
        typer.confirm(f"purge model {fp.hex()} and destroy all its blocks, every tenant's?", abort=True)
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name, timeout=timeout) as admin:
            blocks, seconds = _deleting(f"purging model {fp.hex()}", lambda: admin.purge_model(fp), timeout)
        typer.echo(f"purged model {fp.hex()}: {blocks} blocks removed ({seconds:.1f} s)")
    except KVStoreError as exc:
        _fail(exc)
    if not blocks:  # NOTE: a mistyped fingerprint read as a purge that worked
        Console(stderr=True, highlight=False).print(
            f"no block of model {fp.hex()} was stored here: `kvstore model list` shows the models stored",
            soft_wrap=True)


def _fingerprint_arg(fingerprint: str) -> bytes:
    """A FINGERPRINT argument (hex digits, as `kvstore model list` shows it) as bytes."""
    from kvstore.spec import FINGERPRINT_BYTES

    try:
        fp = bytes.fromhex(fingerprint)
    except ValueError:
        fp = b""
    if len(fp) != FINGERPRINT_BYTES:
        raise typer.BadParameter(f"FINGERPRINT must be {2 * FINGERPRINT_BYTES} hex digits, got {fingerprint!r}")
    return fp


@model_app.command("policy")
def model_policy(
    fingerprint: Annotated[str, typer.Argument(help=(
        "The model's fingerprint: 32 hex digits, as `kvstore model list` shows it."))],
    ttl: Annotated[float | None, typer.Option("--ttl", parser=_duration, metavar="DURATION", help=(
        "Block TTL (3600, 90s, 30m, 1.5h, 7d) for every block of the model, every tenant's (at most the "
        "tenant's own TTL still applies); setting or lowering it caps the blocks already stored at now + TTL."))] = None,
    clear: Annotated[bool, typer.Option("--clear", help="Remove the model's TTL (extends no block).")] = False,
    as_json: JsonOpt = False,
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Show a model's policy, or set (--ttl) or remove (--clear) its TTL (a rollout ageing out
    the old model's blocks), and print the policy in force. Audited as model.policy.set."""
    if ttl is not None and clear:
        raise typer.BadParameter("--ttl and --clear exclude each other")
    fp = _fingerprint_arg(fingerprint)
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            if ttl is None and not clear:
                policy = admin.get_model_policy(fp)
            else:
                policy = admin.set_model_policy(fp, ttl_s=ttl)
    except KVStoreError as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps(policy, indent=2, sort_keys=True))
    else:
        shown = "none" if policy["ttl_s"] is None else ttl_text(policy["ttl_s"])
        typer.echo(f"model {policy['fingerprint']}: ttl {shown}")


# -- stats and audit ------------------------------------------------------------------------------
def stats(
    as_json: JsonOpt = False, target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Print the server's Store statistics as tables, sizes readable (--json: the raw document)."""
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            doc = admin.stats()
    except KVStoreError as exc:
        _fail(exc)
    _show(doc, as_json, stats_view)


def audit(
    # NOTE: --limit 0 meant 1000 (the server's default page), and a negative --limit or --since
    # was refused as a server error (INVALID_ARGUMENT) naming neither option: both are checked here
    limit: Annotated[int, typer.Option("--limit", min=1, max=(1 << 32) - 1, help=(
        "How many entries (1 or more): the newest N, or with --since the first N after it."))] = 1000,
    since: Annotated[int | None, typer.Option("--since", min=0, max=(1 << 64) - 1, help=(
        "Read forward from here: the entries after this sequence number, oldest first "
        "(default: the newest --limit entries)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines instead of a table.")] = False,
    target: TargetOpt = DEFAULT_LISTEN, token: TokenOpt = "", ca_file: CaOpt = None,
    cert_file: CertOpt = None, key_file: KeyOpt = None, server_name: ServerNameOpt = None,
) -> None:
    """Read the audit log (who, what, when, result): the newest entries, oldest of them first.
    A table on a terminal wide enough for it, else one tab-separated line per entry; what was
    left out is said on stderr."""
    # NOTE: it showed the oldest 1000 entries, saying nothing of the rest: the newest actions
    # were the ones missing on any server with a longer log
    try:
        with _admin(target, token, ca_file, cert_file, key_file, server_name) as admin:
            if since is None:
                entries, later = admin.audit_latest(limit), False
                earlier = entries[0]["seq"] - 1 if entries else 0
            else:
                (entries, later), earlier = admin.audit_read(since, limit), 0
            newest = admin.last_audit_seq() if since is not None and not entries else None
    except KVStoreError as exc:
        _fail(exc)
    if as_json:
        for e in entries:
            typer.echo(json.dumps(e, sort_keys=True))
    else:
        _print_rows(audit_listing(entries, _when))
    note = Console(stderr=True, highlight=False, soft_wrap=True)
    if newest is not None:  # NOTE: --since past the end printed a header alone, saying nothing
        note.print(f"no entries after seq {since} " + (f"(the newest is {newest})" if newest else "(the log is empty)"))
    if earlier:
        note.print(f"{earlier} earlier entries not shown (seq 1..{earlier}): --limit N shows the newest N, "
                   f"--since SEQ the entries after SEQ")
    if later:
        note.print(f"later entries not shown: --since {entries[-1]['seq']} reads on")


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def register(app: typer.Typer) -> None:
    """Add ``serve``, ``tenant``, ``policy``, ``session``, ``model``, ``stats`` and ``audit`` to ``app``."""
    app.command("serve")(serve)
    app.add_typer(tenant_app, name="tenant")
    app.add_typer(policy_app, name="policy")
    app.add_typer(session_app, name="session")
    app.add_typer(model_app, name="model")
    app.command("stats")(stats)
    app.command("audit")(audit)


admin_app = typer.Typer(help="kvstore sidecar: serve and administer.", no_args_is_help=True)
register(admin_app)
one_line_listings(admin_app)
