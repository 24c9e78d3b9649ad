"""Config refusals list every problem at once, also those between fields of [limits].

Before: the checks of what must fit in one message (chunk_bytes, max_keys_per_call,
max_session_id_bytes against max_message_bytes) were one validator each, and pydantic stops a
model at the first that fails: a config with three such problems was refused one per start."""

from __future__ import annotations

import pytest

from kvstore import server_config
from kvstore.errors import InvalidArgument


def test_every_limits_problem_is_one_line_of_one_refusal(tmp_path):
    with pytest.raises(InvalidArgument) as err:
        server_config.build({"limits": {"max_message_bytes": "64KiB", "max_session_id_bytes": 65536},
                             "workers": 0}, data_dir=tmp_path)
    lines = str(err.value).splitlines()
    assert lines[0] == "bad server config: 4 problems:"
    assert sorted(line.strip().split(" ", 1)[0].split("=")[0].rstrip(":") for line in lines[1:]) == [
        "limits.chunk_bytes", "limits.max_keys_per_call", "limits.max_session_id_bytes", "workers"]
    # one problem alone is still one line
    with pytest.raises(InvalidArgument, match="^bad server config: limits.chunk_bytes must be at least 1 KiB below"):
        server_config.build({"limits": {"max_message_bytes": "64KiB", "max_keys_per_call": 1024}}, data_dir=tmp_path)
