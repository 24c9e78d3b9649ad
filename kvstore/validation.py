"""Checks of what callers give, as InvalidArgument.

* :func:`validation_error`: a pydantic ValidationError as one InvalidArgument of one line per
  problem, each naming its field: what every typed config (``StoreConfig``, the server config,
  ``RemoteConfig``) raises. Why: pydantic's own text is a multi-line dump with a documentation
  URL under every problem.
* :func:`check_text`: a name (tenant, session, namespace, extra key) that UTF-8 can encode.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvstore.errors import InvalidArgument
from kvstore.sizes import format_size


def validation_error(what: str, exc: ValidationError) -> InvalidArgument:
    """``exc`` as an InvalidArgument of one line per problem, each naming its field
    (``bad server config: store.policy: ...``), instead of pydantic's multi-line dump with a
    documentation URL under every problem."""
    # NOTE: a validator that checks fields against each other reports each problem on its own
    # line (one ValueError): they are split here, so that every problem is one line
    problems = [line for err in exc.errors(include_url=False) for line in _problem(err).split("\n")]
    if len(problems) == 1:
        return InvalidArgument(f"{what}: {problems[0]}")
    return InvalidArgument(f"{what}: {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


def _problem(err: Any) -> str:
    field = ".".join(str(part) for part in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    for bound in (err.get("ctx") or {}).values():  # a byte bound for people too
        if field.endswith("_bytes") and isinstance(bound, int) and bound >= 1 << 10:
            msg = msg.replace(str(bound), f"{bound} ({format_size(bound)})")
    value = err.get("input")
    if (err["type"] != "value_error" and " got " not in msg and isinstance(value, (str, int, float))
            and len(repr(value)) <= 80):  # a ValueError of ours names the value already
        msg = f"{msg} (got {value!r})"
    return msg if not field or msg.startswith(field) else f"{field}: {msg}"


def check_text(what: str, value: Any) -> str:
    """``value`` if it is a str that UTF-8 can encode (what a protobuf string field takes, and
    what the Store encodes a tenant name or an extra key into); else InvalidArgument naming
    ``what``. Why: a lone surrogate (e.g. ``'\\ud800'``, what ``surrogateescape`` decoding
    leaves) failed inside protobuf with a raw UnicodeEncodeError, and a Store took it as a
    tenant name until that tenant's first block went to NVMe: then every put that made room,
    every ``close`` and the tenant's own ``drop_tenant`` raised UnicodeEncodeError."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} {value[:80]!r} holds {value[exc.start]!r} at position {exc.start}, which "
                              "is not text UTF-8 can encode (a lone surrogate)") from None
    return value
