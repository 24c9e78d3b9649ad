"""Engine-side options the integrations read from their engine's free-form config (vLLM's
``kv_connector_extra_config``, SGLang's ``extra_config``): parsed here into typed values, a bad
one an InvalidArgument that names the key."""

from __future__ import annotations

import math
from typing import Any

from kvstore.errors import InvalidArgument

#: seconds one call to the sidecar may take (``kvstore_timeout_s``). An engine asks in its
#: scheduling loop: a sidecar that stops answering must cost it seconds, then a miss, not the
#: client's one-minute default per request.
DEFAULT_TIMEOUT_S = 10.0


def positive_seconds(value: Any, key: str) -> float:
    """``value`` as a finite number of seconds > 0."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{key} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidArgument(f"{key} must be a finite number of seconds > 0, got {value!r}")
    return seconds


def non_negative_int(value: Any, key: str) -> int:
    """``value`` as an int >= 0 (a whole float or numeric string is taken; 1.5 is not)."""
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"{key} must be a whole number, got {value!r}") from None
    if not (math.isfinite(as_float) and as_float == int(as_float) and as_float >= 0):
        raise InvalidArgument(f"{key} must be a whole number >= 0, got {value!r}")
    return int(as_float)


def positive_int(value: Any, key: str) -> int:
    """``value`` as an int > 0 (a whole float or numeric string is taken; 1.5 is not)."""
    number = non_negative_int(value, key)
    if number == 0:
        raise InvalidArgument(f"{key} must be a whole number > 0, got {value!r}")
    return number
