"""Mooncake-format request traces: records, JSONL I/O and synthetic workload generators.

One JSON object per line::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}

``hash_ids`` are prefix-block ids, one per ``block_tokens`` tokens of the input (the last one
may be partial); equal ids mean a reusable prefix (an id covers its block and everything before
it). So an id names the same tokens wherever it appears: it has one parent and always covers
the same number of tokens (a partial last block has its own id, which never also names a
longer block). :func:`load_trace` refuses a file that breaks this, naming the file and line.
An optional ``"tenant"`` string is kept; other extra fields are ignored.

Generators (all driven by one seeded ``random.Random``; same seed, same trace):

* ``chat`` — multi-turn chats: each tenant has a system prompt; a turn extends the previous
  context by the model's answer and the next user message; users think between turns.
* ``agent`` — agent loops: many short steps that append tool output; the agent pauses for tools
  (seconds) and sometimes for a human (minutes) before resuming the same context.
* ``shared_prompt`` — single-shot requests over a few long shared prompts (Zipf popularity)
  followed by unique user content.
* ``tenants`` — many tenants (Zipf activity), each with its own prompt, mixing chats and agents.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvstore.errors import InvalidArgument

WorkloadKind = Literal["chat", "agent", "shared_prompt", "tenants"]
WORKLOADS: tuple[WorkloadKind, ...] = ("chat", "agent", "shared_prompt", "tenants")


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace. ``timestamp_ms`` is the arrival time in milliseconds."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str = "default"

    def to_json(self) -> str:
        obj: dict[str, object] = {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }
        if self.tenant != "default":
            obj["tenant"] = self.tenant
        return json.dumps(obj)


HASH_ID_MIN, HASH_ID_MAX = -(1 << 63), (1 << 63) - 1
"""Hash ids are signed 64-bit integers (the replay keys a block by its id's 8 bytes)."""
DEFAULT_BLOCK_TOKENS = 512
"""The block size of the Mooncake traces and of :class:`WorkloadConfig`."""


def parse_request(obj: object, line_no: int = 0, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                  path: Path | str | None = None) -> TraceRequest:
    """Build a request from one decoded JSON object; InvalidArgument naming the line (and the
    file ``path`` when given) and the field when malformed. ``timestamp`` is a finite number; ``input_length`` and
    ``output_length`` (optional, 0) are integers >= 0 (an integral float such as 5.0 is taken);
    ``hash_ids`` is a list of distinct integers in the signed 64-bit range, one per
    ``block_tokens`` tokens of the input, the last one possibly partial:
    ``len(hash_ids) == ceil(input_length / block_tokens)``; ``tenant`` (optional) is a string."""
    where = _where(path, line_no)
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{where}: not a JSON object but {_show(obj)}")
    for name in ("timestamp", "input_length", "hash_ids"):
        if name not in obj:
            raise InvalidArgument(f"{where}: no {name!r} field")
    ts = obj["timestamp"]
    try:
        timestamp_ms = float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else math.nan
    except OverflowError:
        timestamp_ms = math.nan
    if not math.isfinite(timestamp_ms):
        raise InvalidArgument(f"{where}: 'timestamp' must be a finite number (milliseconds), got {_show(ts)}")
    input_length = _length(obj, "input_length", where)
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise InvalidArgument(f"{where}: 'hash_ids' must be a list of integers, got {_show(ids)}")
    for h in ids:
        if isinstance(h, bool) or not isinstance(h, int) or not HASH_ID_MIN <= h <= HASH_ID_MAX:
            raise InvalidArgument(f"{where}: 'hash_ids' holds {_show(h)}, not an integer in the "
                                  f"signed 64-bit range")
    if len(set(ids)) != len(ids):
        dup = next(h for i, h in enumerate(ids) if h in ids[:i])
        raise InvalidArgument(f"{where}: 'hash_ids' holds {dup} twice")
    blocks = -(-input_length // block_tokens)
    if len(ids) != blocks:
        raise InvalidArgument(f"{where}: 'input_length' {input_length} needs {blocks} hash ids (one per "
                              f"{block_tokens} tokens, the last one partial), 'hash_ids' holds {len(ids)}")
    tenant = obj.get("tenant", "default")
    if not isinstance(tenant, str):
        raise InvalidArgument(f"{where}: 'tenant' must be a string, got {_show(tenant)}")
    return TraceRequest(timestamp_ms=timestamp_ms, input_length=input_length,
                        output_length=_length(obj, "output_length", where), hash_ids=tuple(ids),
                        tenant=tenant)


def _where(path: Path | str | None, line_no: int) -> str:
    """How an error names a trace line: ``FILE: trace line N`` (``trace line N`` for a line
    that comes from no file). NOTE: it said ``trace line N`` only, and a run over several traces
    (a bench suite) did not say which file held the line."""
    return f"trace line {line_no}" if path is None else f"{path}: trace line {line_no}"


def _length(obj: dict, name: str, where: str) -> int:
    """``obj[name]`` (0 when absent) as an integer >= 0; an integral float is taken."""
    v = obj.get(name, 0)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidArgument(f"{where}: {name!r} must be an integer >= 0 (tokens), got {_show(v)}")
    return v


def _show(value: object) -> str:
    """``repr(value)``, cut to a readable length (a trace line may hold a huge value)."""
    return _cut(repr(value))


def _cut(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_trace(path: Path | str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[TraceRequest]:
    """Read a JSONL trace cut at ``block_tokens`` tokens a block; raises InvalidArgument on a
    malformed line (see :func:`parse_request`), on a request that arrives before the one above
    it (the replay's clock follows the trace, so an unsorted trace would run time backwards),
    on a hash id found under two different parents (equal ids mean an equal prefix, so the ids
    form a tree) or covering a different number of tokens than on an earlier line (a partial
    last block has an id of its own), on a file that is not UTF-8 text and on one that holds no
    request. Each error names the file and the line.

    NOTE: an id that was a request's 1-token last block on one line and a full block on another
    was taken, and the replay credited the second request with a hit on all of the block's
    tokens, which the cache never held (a hit rate of 0.67 where at most 0.33 was possible).
    Such a trace is refused rather than credited with the tokens first stored: it contradicts
    the format (equal ids, equal prefix), as an id under two parents does."""
    if block_tokens <= 0:
        raise InvalidArgument(f"block_tokens must be positive, got {block_tokens}")
    out: list[TraceRequest] = []
    parents: dict[int, int | None] = {}
    covers: dict[int, tuple[int, int]] = {}  # id -> (its block's tokens, the line that first held it)
    last = 0
    with open(path, encoding="utf-8", errors="surrogateescape") as fh:
        for i, line in _numbered_lines(fh, path):
            where = _where(path, i)
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as exc:  # NOTE: ValueError also for a >4300-digit int
                raise InvalidArgument(f"{where}: not JSON ({_cut(str(exc), 200)})") from None
            req = parse_request(obj, i, block_tokens, path)
            if out and req.timestamp_ms < out[-1].timestamp_ms:
                raise InvalidArgument(f"{where}: timestamp {req.timestamp_ms} comes before line "
                                      f"{last}'s {out[-1].timestamp_ms}: sort the trace by timestamp")
            prev = None
            for h in req.hash_ids:
                first = parents.setdefault(h, prev)
                if first != prev:
                    raise InvalidArgument(f"{where}: hash id {h} comes {_after(prev)} here but "
                                          f"{_after(first)} on an earlier line (equal ids mean an equal "
                                          f"prefix: an id has one parent)")
                prev = h
            _check_tokens(req, block_tokens, i, where, covers)
            out.append(req)
            last = i
    if not out:
        raise InvalidArgument(f"trace {str(path)!r} holds no request (an empty file, or blank lines only)")
    return out


def _after(parent: int | None) -> str:
    return "first" if parent is None else f"after {parent}"


def _check_tokens(req: TraceRequest, block_tokens: int, line_no: int, where: str,
                  covers: dict[int, tuple[int, int]]) -> None:
    """InvalidArgument unless every id of ``req`` covers as many tokens as on the line that
    first held it; ``covers`` maps each id seen to (its block's tokens, that line)."""
    ids = req.hash_ids
    last = len(ids) - 1
    for k, h in enumerate(ids):
        tokens = block_tokens if k < last else req.input_length - block_tokens * last
        first = covers.setdefault(h, (tokens, line_no))
        if first[0] != tokens:
            raise InvalidArgument(f"{where}: hash id {h} covers {tokens} tokens here but {first[0]} on "
                                  f"line {first[1]} (an id names one prefix: only a request's last "
                                  f"block may be partial, and it needs an id of its own)")


def _numbered_lines(fh: Iterable[str], path: Path | str) -> Iterator[tuple[int, str]]:
    """``enumerate(fh, 1)`` over a file opened with ``errors="surrogateescape"``; a line that
    holds a byte that is not UTF-8 is an InvalidArgument naming the file and that line.

    NOTE: the file was opened strict and the decode error caught around the loop: the text
    layer decodes 8 KiB at a time, ahead of the lines handed out, so a bad byte on line 2 was
    reported "after line 0" and one on line 3001 "after line 2990"."""
    for i, line in enumerate(fh, 1):
        if not line.isascii():
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as exc:  # an escaped byte, or an encoded surrogate
                raise InvalidArgument(f"{_where(path, i)}: not UTF-8 text (a JSONL trace is), at "
                                      f"character {exc.start + 1} of the line") from None
        yield i, line


def write_trace(path: Path | str, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(req.to_json() + "\n" for req in requests)


# -- generators -------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class WorkloadConfig:
    """Knobs shared by the generators (sizes in tokens, times in seconds)."""

    requests: int = 4000
    """Approximate number of requests to emit (the trace is cut at this many)."""
    block_tokens: int = 512
    session_rate: float = 1.0
    """Session (or single-shot request) arrivals per second, Poisson."""
    tenants: int = 8
    think_time_s: float = 120.0
    """Mean pause between the turns of a chat (exponential)."""
    attach_prob: float = 0.5
    """Probability that a chat starts with a long private attachment (document, code file)."""

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.block_tokens <= 0 or self.tenants <= 0:
            raise InvalidArgument("requests, block_tokens and tenants must be positive")
        if not (self.session_rate > 0 and self.think_time_s > 0):
            raise InvalidArgument("session_rate and think_time_s must be positive")
        if not 0.0 <= self.attach_prob <= 1.0:
            raise InvalidArgument("attach_prob must be in [0, 1]")


@dataclass(slots=True)
class _Context:
    """A growing token context whose full blocks have stable ids; the tail id is fresh."""

    ids: list[int]
    tokens: int
    alloc: Iterator[int]
    _tail: dict[int, int] = field(default_factory=dict)

    def extend(self, n: int) -> None:
        self.tokens += n

    def request_ids(self, block_tokens: int) -> tuple[int, ...]:
        full = self.tokens // block_tokens
        while len(self.ids) < full:
            self.ids.append(next(self.alloc))
        out = self.ids[:full]
        if self.tokens % block_tokens:
            tail = self._tail.setdefault(self.tokens, next(self.alloc))
            out = out + [tail]
        return tuple(out)


def _shared_prompt(rng: random.Random, alloc: Iterator[int], lo: int, hi: int, bt: int) -> _Context:
    tokens = rng.randint(lo, hi)
    return _Context(ids=[next(alloc) for _ in range(tokens // bt)], tokens=tokens, alloc=alloc)


def _fork(prompt: _Context) -> _Context:
    """A new context starting with ``prompt``'s full blocks (shared ids)."""
    return _Context(ids=list(prompt.ids), tokens=prompt.tokens, alloc=prompt.alloc)


def _zipf_pick(rng: random.Random, n: int, s: float) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def _session(
    rng: random.Random, cfg: WorkloadConfig, ctx: _Context, start: float, tenant: str, agent: bool
) -> list[TraceRequest]:
    bt = cfg.block_tokens
    out: list[TraceRequest] = []
    t = start
    if agent:
        steps = rng.randint(4, 30)
        ctx.extend(rng.randint(200, 2000))  # task description
    else:
        steps = min(1 + int(rng.expovariate(1 / 3.0)), 20)
        if rng.random() < cfg.attach_prob:
            ctx.extend(rng.randint(2000, 24000))  # a private attachment
        ctx.extend(rng.randint(30, 1500))  # first user message
    for _ in range(steps):
        output = rng.randint(20, 300) if agent else rng.randint(80, 700)
        out.append(TraceRequest(t * 1000.0, ctx.tokens, output, ctx.request_ids(bt), tenant))
        ctx.extend(output)
        if agent:
            human = rng.random() < 0.1
            t += rng.expovariate(1 / 180.0) if human else rng.lognormvariate(1.5, 1.0)
            ctx.extend(rng.randint(100, 3000))  # tool result
        else:
            t += rng.expovariate(1 / cfg.think_time_s)
            ctx.extend(rng.randint(20, 800))  # next user message
    return out


def generate(kind: WorkloadKind, cfg: WorkloadConfig | None = None, seed: int = 0) -> list[TraceRequest]:
    """A synthetic trace of ``kind`` (see module docstring), sorted by arrival time."""
    if kind not in WORKLOADS:
        raise InvalidArgument(f"unknown workload {kind!r}; choose one of {list(WORKLOADS)}")
    cfg = cfg or WorkloadConfig()
    rng = random.Random(seed)
    alloc = itertools.count()
    bt = cfg.block_tokens
    n_tenants = cfg.tenants * (25 if kind == "tenants" else 1)
    prompts = [_shared_prompt(rng, alloc, 1000, 8000, bt) for _ in range(n_tenants)]
    docs = [_shared_prompt(rng, alloc, 2000, 24000, bt) for _ in range(400)]
    out: list[TraceRequest] = []
    t = 0.0
    # Sessions keep starting until one starts after the arrival of the ``requests``-th request
    # (``horizon``, which only comes earlier as sessions are added), so arrivals are steady up
    # to the trace's end. NOTE: stopping at a request count (1.2 × requests) cut session
    # starts off long before: the last 26-63 % of agent/tenants/chat traces started none.
    horizon, recheck = math.inf, cfg.requests
    while True:
        t += rng.expovariate(cfg.session_rate)
        if t * 1000.0 > horizon:
            break
        if len(out) >= recheck:
            out.sort(key=lambda r: r.timestamp_ms)
            horizon = out[cfg.requests - 1].timestamp_ms
            recheck = int(len(out) * 1.1) + 1
            if t * 1000.0 > horizon:
                break
        tid = _zipf_pick(rng, n_tenants, 1.0)
        tenant = f"t{tid}"
        if kind == "shared_prompt":
            ctx = _fork(docs[_zipf_pick(rng, len(docs), 0.9)])
            ctx.extend(rng.randint(50, 2500))
            out.append(TraceRequest(t * 1000.0, ctx.tokens, rng.randint(50, 500), ctx.request_ids(bt), tenant))
            continue
        agent = kind == "agent" or (kind == "tenants" and rng.random() < 0.4)
        out.extend(_session(rng, cfg, _fork(prompts[tid]), t, tenant, agent))
    out.sort(key=lambda r: r.timestamp_ms)
    return out[: cfg.requests]
