"""Options the engine integrations read from their engines' free-form configs."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.integrations.options import non_negative_int, positive_seconds


@pytest.mark.parametrize(("value", "seconds"), [(10, 10.0), ("2.5", 2.5), (0.001, 0.001)])
def test_positive_seconds_takes_numbers_and_numeric_strings(value, seconds):
    assert positive_seconds(value, "kvstore_timeout_s") == seconds


@pytest.mark.parametrize("value", [0, -1, "soon", None, float("nan"), float("inf"), [1]])
def test_positive_seconds_refuses_the_rest_naming_the_key(value):
    with pytest.raises(InvalidArgument, match="kvstore_timeout_s"):
        positive_seconds(value, "kvstore_timeout_s")


@pytest.mark.parametrize(("value", "n"), [(0, 0), ("4096", 4096), (4096.0, 4096)])
def test_non_negative_int_takes_whole_numbers(value, n):
    assert non_negative_int(value, "kvstore_page_bytes") == n


@pytest.mark.parametrize("value", [-1, 1.5, "big", None, float("inf")])
def test_non_negative_int_refuses_the_rest_naming_the_key(value):
    with pytest.raises(InvalidArgument, match="kvstore_page_bytes"):
        non_negative_int(value, "kvstore_page_bytes")
