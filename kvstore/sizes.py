"""Byte counts written for people: ``"512MiB"``, ``"2g"``, ``"1.5GiB"``, ``"1048576"``.

Units are binary throughout (k = KiB = 2**10, m = MiB, g = GiB, t = TiB; a trailing ``b`` or
``ib`` changes nothing), so ``2GB`` in a config file and on the command line is the same
2 GiB. :func:`parse_size` is the one parser: the CLI's ``--quota hbm=2GiB`` and every
``*_bytes`` field of the TOML config (:data:`ByteCount`) go through it; an int stays an int.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

from kvstore.errors import InvalidArgument

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    for _suffix in (_p, _p + "b", _p + "ib"):
        _UNITS[_suffix] = 1 << (10 * _i)
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """``"512MiB"`` / ``"2g"`` / ``"1048576"`` -> bytes; anything else -> InvalidArgument."""
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"bad size {text!r}: use e.g. 512MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """``n`` bytes for people, binary units: ``"64.0 GiB"``, ``"124.0 KiB"``, ``"512 B"``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _size_or_value(value: Any) -> Any:
    """A string is parsed as a size; anything else is left for the int validation after it."""
    return parse_size(value) if isinstance(value, str) else value


#: an int field that also takes a size string (``hbm_bytes = "8GiB"``)
ByteCount = Annotated[int, BeforeValidator(_size_or_value)]
