"""How the operators' CLI (``kvstore.cli_serve``) shows what takes long and what the server sends.

* :func:`waiting` — a call whose answer may take minutes (a tenant's deletion): a spinner with
  the time elapsed on a terminal, one plain line otherwise; an operator who saw nothing for
  30 s took the command for hung.
* :class:`PlainProgress` — ``progress(what, done, total)`` as plain lines, for ``serve`` off a
  terminal (systemd, docker, a log file), where rich's live bar draws nothing at all.
* :func:`stats_view`, :func:`policy_view` — the Stats and a tenant's policy as tables, byte
  counts as ``64.0 GiB`` (``--json`` prints the raw document).
* :func:`one_line_listings` — each command's line in ``--help``'s command list as one
  paragraph: typer kept the docstring's line breaks there, so ``kvstore tenant --help`` listed
  ``delete`` over three ragged lines ("... print how many" / "blocks went.").
* :class:`Listing` (:func:`models_listing`, :func:`sessions_listing`, :func:`tenants_listing`,
  :func:`audit_listing`) — rows an operator copies from, shown as :func:`whole_table` where the
  table fits with every cell whole, else one complete tab-separated line per row
  (:func:`tsv_line`; and always off a terminal): rich cut every column wider than the console
  to an ellipsis, on 80 columns or in a pipe, so ``tenant.create`` and ``tenant.delete`` both
  read ``tenant.…``, ``kvstore audit | grep tenant.delete`` found nothing, and the session id,
  model revision or tenant name to give ``session close``, ``model purge`` or ``tenant delete``
  was cut.

Whatever came from the server is shown through ``shown`` (markup escaped, control characters
as escapes): the caller's :func:`kvstore.cli_serve._shown`.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvstore.sizes import format_size

Shown = Callable[[object], str]
#: tiers top to bottom (the Stats' JSON comes with its keys sorted)
_TIER_ORDER = ("hbm", "dram", "nvme", "remote")


@contextmanager
def waiting(text: str, console: Console) -> Iterator[None]:
    """While the block runs: on a terminal a transient spinner reading ``text`` and the time
    elapsed; otherwise ``text`` once, as a plain line (a live display draws nothing there).
    ``text`` is rich markup: escape what came from outside."""
    if not console.is_terminal:
        console.print(f"{text} ...", soft_wrap=True)
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        bar.add_task(text, total=None)
        yield


class PlainProgress:
    """``progress(what, done, total)`` written as plain lines through ``write``: one at the
    first report of a ``what`` (its phase began), one each time another ``step`` of the total
    is done or ``every_s`` seconds passed since the last line, and one at the end, each with
    its counts. For ``kvstore serve`` off a terminal: the index rebuilt from NVMe at start and
    the commit to NVMe at stop take tens of seconds for millions of blocks, and the transient
    bar showed nothing under a service manager."""

    def __init__(self, write: Callable[[str], None], *, step: float = 0.1, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._write, self._step, self._every_s, self._clock = write, step, every_s, clock
        self._phases: dict[str, tuple[float, float]] = {}  # what -> (next fraction to report, last line's time)

    def __call__(self, what: str, done: int, total: int) -> None:
        now = self._clock()
        fraction = done / total if total > 0 else 1.0
        phase = self._phases.get(what)
        if done >= total:
            self._phases.pop(what, None)
        elif phase is not None and fraction < phase[0] and now - phase[1] < self._every_s:
            return
        else:
            self._phases[what] = ((int(fraction / self._step) + 1) * self._step, now)
        self._write(f"{what}: {done}/{total} blocks ({fraction:.0%})")


# -- what the server sends ------------------------------------------------------------------------
def _size(value: object) -> str:
    return format_size(value) if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _value(key: str, value: object, shown: Shown) -> str:
    """A scalar of the Stats: a byte count (``*_bytes``) as a size, the rest as it is."""
    if key.endswith("_bytes"):
        return _shown_size(value, shown)
    if isinstance(value, dict | list):
        return shown(json.dumps(value, sort_keys=True))
    return shown(value)


def _shown_size(value: object, shown: Shown) -> str:
    return shown(_size(value))


def _tier_order(label: str) -> tuple[int, str]:
    return (_TIER_ORDER.index(label) if label in _TIER_ORDER else len(_TIER_ORDER), label)


def _table(*columns: str, title: str, header: bool = True) -> Table:
    """A table whose first column is a name and the others numbers (right-justified)."""
    table = Table(show_header=header, title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


def stats_view(stats: dict[str, Any], shown: Shown) -> RenderableType:
    """The Store's statistics (``Store.stats()``) as tables: the tiers (blocks, used, capacity),
    each tenant's bytes per tier, the totals, then the counters; byte counts as sizes."""
    parts: list[RenderableType] = []
    tiers = stats.get("tiers") or {}
    if isinstance(tiers, dict) and tiers:
        extra = sorted({k for t in tiers.values() if isinstance(t, dict) for k in t}
                       - {"blocks", "used_bytes", "capacity_bytes"})
        table = _table("tier", "blocks", "used", "capacity", "use", *extra, title="tiers")
        for name, t in sorted(tiers.items(), key=lambda kv: _tier_order(kv[0])):
            t = t if isinstance(t, dict) else {}
            used, cap = t.get("used_bytes"), t.get("capacity_bytes")
            use = f"{used / cap:.0%}" if isinstance(used, int) and isinstance(cap, int) and cap > 0 else ""
            table.add_row(shown(name), shown(t.get("blocks", "")), _shown_size(used if used is not None else "", shown),
                          _shown_size(cap if cap is not None else "", shown), use,
                          *(_value(k, t.get(k, ""), shown) for k in extra))
        parts.append(table)
    tenants = stats.get("tenants") or {}
    if isinstance(tenants, dict) and tenants:
        labels = sorted({*(tiers if isinstance(tiers, dict) else {}),
                         *(k for v in tenants.values() if isinstance(v, dict) for k in v)}, key=_tier_order)
        table = _table("tenant", *labels, title="tenants (bytes per tier)")
        for name, per in sorted(tenants.items()):
            per = per if isinstance(per, dict) else {}
            table.add_row(shown(name), *(_shown_size(per[k], shown) if k in per else "" for k in labels))
        parts.append(table)
    totals = _table("", "", title="totals", header=False)
    for key, value in stats.items():
        if key not in ("tiers", "tenants", "counters"):
            totals.add_row(shown(key), _value(key, value, shown))
    parts.append(totals)
    counters = stats.get("counters") or {}
    if isinstance(counters, dict) and counters:
        # NOTE: the Store reports every counter from the start, at 0 (so a scrape sees the first
        # event); about 60 rows of zeros buried the few that moved
        moved = {k: v for k, v in counters.items() if v != 0}
        idle = len(counters) - len(moved)
        table = _table("counter", "value", title="counters")
        for key, value in sorted(moved.items()):
            table.add_row(shown(key), _value(key, value, shown))
        parts.append(table)
        if idle:
            parts.append(Text(f"{idle} more at 0 (--json lists them)"))
    return Group(*parts)


def policy_view(policy: dict[str, Any], shown: Shown) -> RenderableType:
    """A tenant's policy (``AdminClient.get_policy``) as a table; quotas as sizes."""
    table = Table("", "", show_header=False, title=f"policy of {shown(policy.get('tenant', ''))}",
                  title_justify="left")
    ttl = policy.get("ttl_s")
    table.add_row("ttl", "none" if ttl is None else ttl_text(ttl))
    table.add_row("priority", shown(policy.get("priority", 0)))
    quotas = policy.get("quota_bytes") or {}
    if not quotas:
        table.add_row("quota", "none")
    for tier, size in sorted(quotas.items()):
        table.add_row(f"quota {shown(tier)}", _shown_size(size, shown))
    return table


def ttl_text(seconds: float) -> str:
    """A TTL exactly as it is in force (``1234567 s (14 d 06 h)``, ``0.25 s``), the seconds
    first. NOTE: it was ``f"{ttl:g}"``, 6 significant digits: 1234567 s showed as
    ``1.23457e+06 s``, 14 days as ``1.2096e+06 s``."""
    exact = str(int(seconds)) if float(seconds).is_integer() and abs(seconds) < 1e16 else repr(float(seconds))
    return f"{exact} s" + (f" ({duration(seconds)})" if seconds >= 60 else "")


def duration(seconds: float) -> str:
    """``12.3 s``, ``4 min 05 s``, ``3 h 02 min``, ``2 d 04 h``: an idle time read at a glance."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    if s < 86_400:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    return f"{s // 86_400} d {s % 86_400 // 3600:02d} h"


# -- lists: a table where every cell fits whole, else one line per row ----------------------------
class Field(NamedTuple):
    """A column of a :class:`Listing`."""

    name: str
    #: right-justified (a number)
    right: bool = False
    #: 0: shown whole on one line, or the table is not used; else the column may wrap (folded,
    #: nothing cut) and takes this share of the width the others leave
    wrap: int = 0


class Listing(NamedTuple):
    """Rows to show as a :func:`whole_table` or as :func:`tsv_line` lines: their columns, their
    cells through a ``text`` (rich markup escaped for the table, plain for the lines) and the
    table's title."""

    fields: tuple[Field, ...]
    rows: Callable[[Shown], list[list[str]]]
    title: str = ""


#: the narrowest a wrapping column of a :func:`whole_table` may be
FOLD_MIN = 16


def tsv_line(cells: list[str]) -> str:
    """A row's cells (through a ``text`` that escapes control characters, tabs included) as
    one tab-separated line: whole, whatever its length, for ``grep`` and ``cut -f``."""
    return "\t".join(cells)


def whole_table(listing: Listing, rows: list[list[str]], width: int) -> Table | None:
    """``rows`` (rich markup, ``listing.rows`` through an escaping ``text``) as a table
    ``width`` columns wide, or None when it cannot show every cell whole there: each column at
    its full width, or, where the listing has wrapping columns, the others at theirs and at
    least :data:`FOLD_MIN` left for each of those, which wrap. (rich shrinks a table wider than
    the console by cutting cells to an ellipsis: the session id, model revision or tenant name
    an operator copies into the next command.)"""
    fields = listing.fields
    widths = [max([cell_len(f.name)] + [cell_len(Text.from_markup(r[i]).plain) for r in rows])
              for i, f in enumerate(fields)]
    overhead = 3 * len(fields) - 1  # padding of 1 each side, a separator between
    if sum(widths) + overhead <= width:
        wrapping: set[int] = set()  # every cell fits on one line
    else:
        wrapping = {i for i, f in enumerate(fields) if f.wrap and widths[i] > FOLD_MIN}
        fixed = sum(w for i, w in enumerate(widths) if i not in wrapping)
        if not wrapping or fixed + len(wrapping) * FOLD_MIN + overhead > width:
            return None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, expand=bool(wrapping), title=listing.title or None,
                  title_justify="left")
    for i, (f, w) in enumerate(zip(fields, widths, strict=True)):
        if i in wrapping:
            table.add_column(f.name, ratio=f.wrap, min_width=FOLD_MIN, overflow="fold")
        else:
            table.add_column(f.name, width=w, no_wrap=True, justify="right" if f.right else "left")
    for r in rows:
        table.add_row(*r)
    return table


def models_listing(models: list[dict[str, Any]]) -> Listing:
    """The models stored (``AdminClient.list_models``): fingerprint (what ``kvstore model
    purge`` takes), model, revision, dtype, block tokens, blocks, size, tenants."""
    def rows(text: Shown) -> list[list[str]]:
        return [[text(m["fingerprint"]), text(m["model"]), text(m["revision"]), text(m["dtype"]),
                 text(m["block_tokens"]), text(m["blocks"]), _shown_size(m["bytes"], text), text(m["tenants"])]
                for m in models]
    return Listing((Field("fingerprint"), Field("model"), Field("revision"), Field("dtype"),
                    Field("block tokens", right=True), Field("blocks", right=True), Field("size", right=True),
                    Field("tenants", right=True)),
                   rows, f"{len(models)} model{'' if len(models) == 1 else 's'}")


def sessions_listing(sessions: list[dict[str, Any]]) -> Listing:
    """The open sessions (``AdminClient.list_sessions``): each one's state, the blocks it holds
    and those it pins in HBM (sizes; "only it": pinned by no other session, what closing it
    frees), and how long it has been idle."""
    def rows(text: Shown) -> list[list[str]]:
        return [[text(s["tenant"]), text(s["session_id"]), text(s["state"]), text(s["blocks"]),
                 _shown_size(s["bytes"], text), text(s["pinned_blocks"]), _shown_size(s["pinned_bytes"], text),
                 _shown_size(s["only_pinned_bytes"], text), duration(s["idle_s"])] for s in sessions]
    numbers = (Field(name, right=True) for name in ("blocks", "size", "pinned", "pinned size", "only it", "idle"))
    return Listing((Field("tenant"), Field("session"), Field("state"), *numbers), rows,
                   f"{len(sessions)} open session{'' if len(sessions) == 1 else 's'}")


def tenants_listing(tenants: list[dict[str, Any]], when: Callable[[float], str]) -> Listing:
    """The principals (``AdminClient.list_tenants``): name, role, shared namespaces (the one
    column that wraps), when created, and the state (``deleting``: a deletion in progress or
    left unfinished)."""
    def rows(text: Shown) -> list[list[str]]:
        return [[text(t["name"]), text(t["role"]), text(", ".join(t["namespaces"])), when(t["created"]),
                 "deleting" if t["deleting"] else "live"] for t in tenants]
    return Listing((Field("name"), Field("role"), Field("namespaces", wrap=1), Field("created"), Field("state")),
                   rows, f"{len(tenants)} principal{'' if len(tenants) == 1 else 's'}")


# -- the audit log --------------------------------------------------------------------------------
def audit_listing(entries: list[dict[str, Any]], when: Callable[[float], str]) -> Listing:
    """Audit entries (``AdminClient.audit``): seq, time, principal, action, target, result,
    ref, detail; target and detail wrap in a table. Every string the server sent goes through
    ``text`` (a target is what a caller sent: ``[red]x``, an ESC sequence)."""
    def rows(text: Shown) -> list[list[str]]:
        return [[str(e["seq"]), when(e["time"]), *(text(e[k]) for k in ("principal", "action", "target", "result")),
                 str(e["ref"] or ""), text(e["detail"])] for e in entries]
    return Listing((Field("seq", right=True), Field("time"), Field("principal"), Field("action"),
                    Field("target", wrap=1), Field("result"), Field("ref", right=True), Field("detail", wrap=2)),
                   rows)


def one_line_listings(app: typer.Typer) -> None:
    """Give every command of ``app`` and of its sub-apps without a ``short_help`` one: the first
    paragraph of its docstring with its line breaks folded (``--help`` of the command itself
    still shows the whole docstring)."""
    for info in app.registered_commands:
        doc = inspect.getdoc(info.callback) if info.callback else None
        if info.short_help is None and doc:
            info.short_help = " ".join(doc.split("\n\n", 1)[0].split())
    for group in app.registered_groups:
        if group.typer_instance is not None:
            one_line_listings(group.typer_instance)
