"""Every Store counter exists from the start, at 0: the ``kvstore_store_counters_*`` gauges
(expired, quota_rejections, nvme_commit_failures, deleted, ...) appeared only at their first
event, already at 1, so Prometheus' increase()/rate() missed that event and an alert on the
first NVMe commit failure or quota rejection never fired. The names are one list
(kvstore.stats); the last test greps the code for every name counted, so a new counter that
is not in the list fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import make_kv, tokens
from prometheus_client import CollectorRegistry, generate_latest
from service_harness import start

from kvstore.metrics import StoreCollector
from kvstore.stats import STORE_COUNTERS, STORE_PAIR_COUNTERS, STORE_TIER_COUNTERS, store_counter_names

ROOT = Path(__file__).resolve().parents[1]
ALERTED = ("expired", "quota_rejections", "nvme_commit_failures", "deleted", "integrity_failures",
           "nvme_write_failures", "evictions")


def _exported(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        m = re.match(r"(kvstore_store_counters_[a-z_]+) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_a_fresh_store_exports_every_counter_at_zero(open_store, spec, clock):
    s = open_store(spec, hbm_blocks=4, dram_blocks=4, nvme_blocks=64)
    assert s.stats()["counters"] == dict.fromkeys(store_counter_names(), 0)
    reg = CollectorRegistry()
    reg.register(StoreCollector(s.stats))
    fresh = _exported(reg)
    for name in ALERTED:
        assert fresh[f"kvstore_store_counters_{name}"] == 0.0, name  # was absent
    assert fresh["kvstore_store_counters_moved_hbm_to_dram"] == 0.0

    s.put("a", spec, s.block_keys("a", spec, tokens(2, spec)), make_kv(spec, 2), ttl_s=1)
    clock.advance(5)
    s.expire()
    after = _exported(reg)
    assert after["kvstore_store_counters_expired"] == 2.0  # a rise from 0: increase() sees it
    assert after["kvstore_store_counters_nvme_commit_failures"] == 0.0


def test_the_sidecar_exports_the_store_counters_before_their_first_event(tmp_path: Path):
    sc = start(tmp_path)
    try:
        exported = _exported(sc.server.metrics_registry)
        assert {f"kvstore_store_counters_{n}" for n in ALERTED} <= exported.keys()
        assert all(exported[f"kvstore_store_counters_{n}"] == 0.0 for n in ALERTED)
    finally:
        sc.stop()


# -- drift: every name counted in the code is in the list ----------------------------------------
def _sources() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for d in ("kvstore", "tiers", "policy")
            for p in sorted((ROOT / d).rglob("*.py"))}


def _is_counters_add(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "add" and isinstance(f.value, ast.Attribute)
            and f.value.attr == "counters")


def _called(f: ast.expr) -> str | None:
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _names(node: ast.expr, where: str, resolve) -> list[str]:
    """The counter names ``node`` may evaluate to: string literals, both arms of a conditional,
    an f-string as a template with ``{}`` for each field, a parameter through its callers."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _names(node.body, where, resolve) + _names(node.orelse, where, resolve)
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)]
    if isinstance(node, ast.Name):
        return resolve(node.id)
    raise AssertionError(f"{where}: cannot tell which counter {ast.unparse(node)} names")


def test_every_counter_the_code_counts_is_seeded():
    trees = _sources()
    calls = [(p, n) for p, t in trees.items() for n in ast.walk(t) if isinstance(n, ast.Call)]
    counted: dict[str, str] = {}  # name or template -> where

    for path, tree in trees.items():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
                continue
            body_calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _is_counters_add(n)]
            for call in body_calls:
                where = f"{path.relative_to(ROOT)}:{call.lineno}"

                def resolve(param: str, fn=fn, where=where) -> list[str]:
                    # a parameter of the enclosing function: its default and what every caller passes
                    assert isinstance(fn, ast.FunctionDef), f"{where}: {param} is not a parameter"
                    args = fn.args.args
                    names = [a.arg for a in args]
                    assert param in names, f"{where}: {param} is not a parameter of {fn.name}"
                    i = names.index(param)
                    out = []
                    defaults = dict(zip(names[len(names) - len(fn.args.defaults):], fn.args.defaults))
                    if param in defaults:
                        out += _names(defaults[param], where, lambda n: [])
                    pos = i - (1 if names and names[0] == "self" else 0)
                    for p, c in calls:
                        if _called(c.func) != fn.name:
                            continue
                        given = [k.value for k in c.keywords if k.arg == param]
                        if not given and len(c.args) > pos:
                            given = [c.args[pos]]
                        for g in given:
                            out += _names(g, f"{p.relative_to(ROOT)}:{c.lineno}", lambda n: [])
                    assert out, f"{where}: found no value of {param}"
                    return out

                for name in _names(call.args[0], where, resolve):
                    counted.setdefault(name, where)

    assert counted, "found no counters.add call"
    # a per-tier template of the list covers the f-strings that fill its fields, or some of them
    # (f"bytes_{tier}_to_nvme" is an instance of "bytes_{src}_to_{dest}")
    templates = {t: re.compile(re.sub(r"\\\{\w+\\\}", r"([a-z]+|\\{\\})", re.escape(t)))
                 for t in (*STORE_TIER_COUNTERS, *STORE_PAIR_COUNTERS)}
    seeded = set(store_counter_names())
    covers = {n: [t for t, rx in templates.items() if rx.fullmatch(n)] for n in counted if "{}" in n}
    missing = {n: w for n, w in counted.items() if n not in seeded and not covers.get(n)}
    assert not missing, f"counted but not in kvstore.stats.STORE_COUNTERS or its templates: {missing}"
    stale = set(STORE_COUNTERS) - set(counted)
    stale |= set(templates) - {t for ts in covers.values() for t in ts}
    assert not stale, f"in kvstore.stats but counted nowhere: {stale}"
