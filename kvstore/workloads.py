"""Mooncake-format request traces: records, JSONL I/O and synthetic workload generators.

One JSON object per line::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}

``hash_ids`` are prefix-block ids, one per ``block_tokens`` tokens of the input (the last one
may be partial); equal ids mean a reusable prefix (an id covers its block and everything before
it). An optional ``"tenant"`` string is kept; other extra fields are ignored.

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


def parse_request(obj: dict, line_no: int = 0) -> TraceRequest:
    """Build a request from one decoded JSON object; InvalidArgument when malformed."""
    try:
        ids = tuple(int(h) for h in obj["hash_ids"])
        req = TraceRequest(
            timestamp_ms=float(obj["timestamp"]),
            input_length=int(obj["input_length"]),
            output_length=int(obj.get("output_length", 0)),
            hash_ids=ids,
            tenant=str(obj.get("tenant", "default")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"trace line {line_no}: bad request record ({exc})") from None
    if req.input_length < 0 or len(set(ids)) != len(ids):
        raise InvalidArgument(f"trace line {line_no}: negative length or repeated hash id")
    return req


def load_trace(path: Path | str) -> list[TraceRequest]:
    """Read a JSONL trace; raises InvalidArgument on a malformed line, on a request that
    arrives before the one above it (the replay's clock follows the trace, so an unsorted
    trace would run time backwards), on a file that is not UTF-8 text and on one that holds
    no request."""
    out: list[TraceRequest] = []
    last = 0
    with open(path, encoding="utf-8") as fh:
        for i, line in _numbered_lines(fh, path):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"trace line {i}: not JSON ({exc})") from None
            req = parse_request(obj, i)
            if out and req.timestamp_ms < out[-1].timestamp_ms:
                raise InvalidArgument(f"trace line {i}: timestamp {req.timestamp_ms} comes before line "
                                      f"{last}'s {out[-1].timestamp_ms}: sort the trace by timestamp")
            out.append(req)
            last = i
    if not out:
        raise InvalidArgument(f"trace {str(path)!r} holds no request (an empty file, or blank lines only)")
    return out


def _numbered_lines(fh: Iterable[str], path: Path | str) -> Iterator[tuple[int, str]]:
    """``enumerate(fh, 1)``, with text that is not UTF-8 an InvalidArgument naming the line."""
    i = 0
    try:
        for i, line in enumerate(fh, 1):
            yield i, line
    except UnicodeDecodeError:
        raise InvalidArgument(f"trace {str(path)!r}: not UTF-8 text after line {i} (a JSONL trace is)") from None


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
    while len(out) < cfg.requests * 1.2:
        t += rng.expovariate(cfg.session_rate)
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
