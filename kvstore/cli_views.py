"""How the operators' CLI (``kvstore.cli_serve``) shows what takes long and what the server sends.

* :func:`waiting` — a call whose answer may take minutes (a tenant's deletion): a spinner with
  the time elapsed on a terminal, one plain line otherwise; an operator who saw nothing for
  30 s took the command for hung.
* :class:`PlainProgress` — ``progress(what, done, total)`` as plain lines, for ``serve`` off a
  terminal (systemd, docker, a log file), where rich's live bar draws nothing at all.
* :func:`stats_view`, :func:`policy_view`, :func:`sessions_view` — the Stats, a tenant's policy
  and the open sessions as tables, byte counts as ``64.0 GiB`` (``--json`` prints the raw
  document).
* :func:`audit_table`, :func:`audit_line` — audit entries as a table where it fits whole, else
  one complete tab-separated line per entry (and always off a terminal): the table cut every
  column to an ellipsis on 80 columns or in a pipe, so ``tenant.create`` and ``tenant.delete``
  both read ``tenant.…`` and ``kvstore audit | grep tenant.delete`` found nothing.

Whatever came from the server is shown through ``shown`` (markup escaped, control characters
as escapes): the caller's :func:`kvstore.cli_serve._shown`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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
        table = _table("counter", "value", title="counters")
        for key, value in sorted(counters.items()):
            table.add_row(shown(key), _value(key, value, shown))
        parts.append(table)
    return Group(*parts)


def policy_view(policy: dict[str, Any], shown: Shown) -> RenderableType:
    """A tenant's policy (``AdminClient.get_policy``) as a table; quotas as sizes."""
    table = Table("", "", show_header=False, title=f"policy of {shown(policy.get('tenant', ''))}",
                  title_justify="left")
    ttl = policy.get("ttl_s")
    table.add_row("ttl", "none" if ttl is None else f"{ttl:g} s")
    table.add_row("priority", shown(policy.get("priority", 0)))
    quotas = policy.get("quota_bytes") or {}
    if not quotas:
        table.add_row("quota", "none")
    for tier, size in sorted(quotas.items()):
        table.add_row(f"quota {shown(tier)}", _shown_size(size, shown))
    return table


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


def models_view(models: list[dict[str, Any]], shown: Shown) -> RenderableType:
    """The models stored (``AdminClient.list_models``) as a table; the fingerprint whole (it
    is what ``kvstore model purge`` takes: never cut)."""
    table = Table("fingerprint", "model", "revision", "dtype", "block tokens", "blocks", "size", "tenants",
                  title=f"{len(models)} model{'' if len(models) == 1 else 's'}", title_justify="left")
    table.columns[0].no_wrap = True
    table.columns[0].overflow = "ignore"
    for col in table.columns[4:]:
        col.justify = "right"
    for m in models:
        table.add_row(m["fingerprint"], shown(m["model"]), shown(m["revision"]), shown(m["dtype"]),
                      shown(m["block_tokens"]), shown(m["blocks"]), _shown_size(m["bytes"], shown),
                      shown(m["tenants"]))
    return table


def sessions_view(sessions: list[dict[str, Any]], shown: Shown) -> RenderableType:
    """The open sessions (``AdminClient.list_sessions``) as a table: each one's state, the
    blocks it holds and those it pins in HBM (sizes; "only it": pinned by no other session,
    what closing it frees), and how long it has been idle."""
    table = Table("tenant", "session", "state", "blocks", "size", "pinned", "pinned size", "only it", "idle",
                  title=f"{len(sessions)} open session{'' if len(sessions) == 1 else 's'}", title_justify="left")
    for col in table.columns[3:]:
        col.justify = "right"
    for s in sessions:
        table.add_row(shown(s["tenant"]), shown(s["session_id"]), shown(s["state"]), shown(s["blocks"]),
                      _shown_size(s["bytes"], shown), shown(s["pinned_blocks"]), _shown_size(s["pinned_bytes"], shown),
                      _shown_size(s["only_pinned_bytes"], shown), duration(s["idle_s"]))
    return table


# -- the audit log --------------------------------------------------------------------------------
AUDIT_COLUMNS = ("seq", "time", "principal", "action", "target", "result", "ref", "detail")
#: the columns of the audit table that may wrap (folded within their width); the others are
#: shown whole or the table is not used
_AUDIT_FOLDED = {"target": 1, "detail": 2}
#: the narrowest a folded column of the audit table may be
AUDIT_FOLD_MIN = 16


def audit_cells(entry: dict[str, Any], text: Shown, when: Callable[[float], str]) -> list[str]:
    """One audit entry (``AdminClient.audit``) as its :data:`AUDIT_COLUMNS`; every string the
    server sent through ``text`` (a target is what a caller sent: ``[red]x``, an ESC sequence)."""
    return [str(entry["seq"]), when(entry["time"]), *(text(entry[k]) for k in ("principal", "action", "target",
            "result")), str(entry["ref"] or ""), text(entry["detail"])]


def audit_line(cells: list[str]) -> str:
    """An entry's cells (through a ``text`` that escapes control characters, tabs included)
    as one tab-separated line: whole, whatever its length, for ``grep`` and ``cut -f``."""
    return "\t".join(cells)


def audit_table(rows: list[list[str]], width: int) -> Table | None:
    """Entries' cells (rich markup, from :func:`audit_cells`) as a table ``width`` columns
    wide, or None when it cannot show every cell whole there: the columns other than target
    and detail at their full width, and at least :data:`AUDIT_FOLD_MIN` left for each of
    those two, which wrap."""
    widths = [max([cell_len(name)] + [cell_len(Text.from_markup(r[i]).plain) for r in rows])
              for i, name in enumerate(AUDIT_COLUMNS)]
    overhead = 3 * len(AUDIT_COLUMNS) - 1  # padding of 1 each side, a separator between
    if sum(widths) + overhead <= width:
        folded: dict[str, int] = {}  # every cell fits on one line
    else:
        fixed = sum(w for w, name in zip(widths, AUDIT_COLUMNS, strict=True) if name not in _AUDIT_FOLDED)
        if fixed + len(_AUDIT_FOLDED) * AUDIT_FOLD_MIN + overhead > width:
            return None
        folded = _AUDIT_FOLDED
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, expand=bool(folded))
    for name, w in zip(AUDIT_COLUMNS, widths, strict=True):
        if name in folded:
            table.add_column(name, ratio=folded[name], min_width=AUDIT_FOLD_MIN, overflow="fold")
        else:
            table.add_column(name, width=w, no_wrap=True, justify="right" if name in ("seq", "ref") else "left")
    for r in rows:
        table.add_row(*r)
    return table
