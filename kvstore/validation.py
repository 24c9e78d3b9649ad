"""A pydantic ValidationError as one InvalidArgument of one line per problem, each naming its
field: what every typed config (``StoreConfig``, the server config, ``RemoteConfig``) raises.
Why: pydantic's own text is a multi-line dump with a documentation URL under every problem."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from kvstore.errors import InvalidArgument
from kvstore.sizes import format_size


def validation_error(what: str, exc: ValidationError) -> InvalidArgument:
    """``exc`` as an InvalidArgument of one line per problem, each naming its field
    (``bad server config: store.policy: ...``), instead of pydantic's multi-line dump with a
    documentation URL under every problem."""
    problems = [_problem(err) for err in exc.errors(include_url=False)]
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
