"""Byte counts written for people: ``"512MiB"``, ``"2g"``, ``"1.5GiB"``, ``"1048576"``.

Units are binary throughout (k = KiB = 2**10, m = MiB, g = GiB, t = TiB; a trailing ``b`` or
``ib`` changes nothing), so ``2GB`` in a config file and on the command line is the same
2 GiB. :func:`parse_size` is the one parser: the CLI's ``--quota hbm=2GiB`` and every
``*_bytes`` field of the TOML config (:data:`ByteCount`) go through it; an int stays an int.
:data:`Int` and :data:`Float` are the other numeric config fields: like ByteCount, they refuse
a TOML boolean, which pydantic would take as 1 or 0.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Annotated, Any

from pydantic import AllowInfNan, BeforeValidator

from kvstore.errors import InvalidArgument

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    for _suffix in (_p, _p + "b", _p + "ib"):
        _UNITS[_suffix] = 1 << (10 * _i)
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
#: a number with more digits than this before its point is more than 2**64-1 bytes (what the
#: wire's uint64 fields carry) in any unit: too large, whatever it sizes
MAX_SIZE = (1 << 64) - 1
_MAX_DIGITS = len(str(MAX_SIZE))


def parse_size(text: str) -> int:
    """``"512MiB"`` / ``"2g"`` / ``"1048576"`` -> bytes (a fraction of a byte is dropped);
    anything else -> InvalidArgument, as is a number of more digits than :data:`MAX_SIZE`
    ("too large"). Other bounds are the caller's (a config field's ``le=``, which names the
    field and its bound; the admin client's range of a quota).

    The number is read exactly (a :class:`~fractions.Fraction`, not a float). NOTE: it went
    through ``float``, so a number of 400 digits raised a bare OverflowError ("cannot convert
    float infinity to integer") out of the config and the CLI, and byte counts above 2**53
    came back rounded."""
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"bad size {text[:80]!r}: use e.g. 512MiB, 2GiB or a byte count")
    whole, _, fraction = m.group(1).partition(".")
    if len(whole.lstrip("0")) > _MAX_DIGITS:  # before any arithmetic on it
        shown = text if len(text) <= 40 else f"{text[:20]}…{text[-12:]} ({len(text)} characters)"
        raise InvalidArgument(f"bad size {shown!r}: too large; a size is at most {MAX_SIZE} bytes "
                              f"(2**64-1, 16 EiB)")
    # a fraction of 2**-40 (the smallest that makes a whole byte of a TiB) has 40 digits: more
    # than 64 change no result, and Python refuses to read ints of over 4300
    return int(Fraction(f"{whole}.{fraction[:64] or 0}") * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """``n`` bytes for people, binary units: ``"64.0 GiB"``, ``"124.0 KiB"``, ``"512 B"``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _not_bool(value: Any) -> Any:
    """``value``, unless it is a bool: ValueError. pydantic's int and float take ``True`` as 1
    (and ``False`` as 0): ``hbm_bytes = true`` in a TOML config was a 1-byte tier,
    ``default_ttl_s = true`` a 1-second TTL, ``workers = true`` one worker, all without a word."""
    if isinstance(value, bool):
        # a pydantic validator reports a ValueError as the field's problem (a TypeError escapes)
        raise ValueError(f"{str(value).lower()} is a boolean, not a number: give a number")  # noqa: TRY004
    return value


def _size_or_value(value: Any) -> Any:
    """A string is parsed as a size; a bool is refused (:func:`_not_bool`); anything else is
    left for the int validation after it, and the field's bound (``le=``) to say what is too
    large."""
    return parse_size(value) if isinstance(value, str) else _not_bool(value)


#: an int field that also takes a size string (``hbm_bytes = "8GiB"``), never a bool
ByteCount = Annotated[int, BeforeValidator(_size_or_value)]
#: an int config field that refuses a bool (``workers = true``), as every numeric field does;
#: with ``Field`` bounds as ``Annotated[Int, Field(ge=1)]``
Int = Annotated[int, BeforeValidator(_not_bool)]
#: a finite float config field that refuses a bool (``default_ttl_s = true``). NOTE: finite
#: here, not only by the field's ``allow_inf_nan=False``: behind the BeforeValidator pydantic
#: checks a field's bounds first, and NaN failed "greater than 0" instead of "a finite number"
Float = Annotated[float, AllowInfNan(False), BeforeValidator(_not_bool)]
