"""Durations written for people: ``"3600"``, ``"90s"``, ``"30m"``, ``"1.5h"``, ``"7d"``, ``"1h30m"``.

:func:`parse_duration` is the CLI's reading of ``--ttl`` (``kvstore policy set``, ``kvstore model
policy``): an operator typed ``--ttl 1h`` and was told "Input should be a valid number". A plain
number is seconds, as before (not NaN or infinite: no TTL is spelled by leaving it out). Units:
``s``/``sec``, ``m``/``min``, ``h``/``hr``, ``d``, ``w``, in any case; parts add up (``1h30m``).
The config file keeps its ``*_s`` fields in seconds.
"""

from __future__ import annotations

import math
import re

from kvstore.errors import InvalidArgument

_SECONDS = {"s": 1, "sec": 1, "secs": 1, "m": 60, "min": 60, "mins": 60, "h": 3600, "hr": 3600,
            "hrs": 3600, "d": 86_400, "w": 604_800}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)")
_WHOLE = re.compile(r"(?:\s*(?:\d+(?:\.\d*)?|\.\d+)\s*[a-z]+)+\s*")


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (see the module's docstring); raises InvalidArgument naming the units
    when it is neither a number nor parts like ``1h30m``."""
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise InvalidArgument(f"duration {text!r} is not a finite number of seconds")
        return value
    lowered = text.lower()
    if _WHOLE.fullmatch(lowered):
        parts = _PART.findall(lowered)
        if all(unit in _SECONDS for _, unit in parts):
            return float(sum(float(n) * _SECONDS[unit] for n, unit in parts))
    raise InvalidArgument(f"duration {text!r}: use seconds (3600) or a number with a unit "
                          f"(90s, 30m, 1.5h, 7d, 2w; parts add up: 1h30m)")
