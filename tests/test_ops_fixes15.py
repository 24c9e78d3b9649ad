"""Session 15's operations fixes: names ending in a newline, a config's problems on separate
lines, a tier given twice under two spellings, TOML booleans as numbers, a policy of a shared
namespace nobody uses, and ``local_data_plane = false``."""

from __future__ import annotations

import pytest
import torch

from kvstore import errors

torch.set_num_threads(1)


# -- names: ``$`` matched before a trailing newline -------------------------------------------
@pytest.mark.parametrize("name", ["acme\n", "x" * 63 + "\n", "acme\n\n"])
def test_a_principal_name_ending_in_a_newline_is_refused(name):
    from kvstore.auth import check_name, check_shared

    check_name("acme")
    check_name("x" * 63)
    with pytest.raises(errors.InvalidArgument):
        check_name(name)
    with pytest.raises(errors.InvalidArgument):
        check_shared("shared:" + name)


def test_a_region_name_ending_in_a_newline_is_refused():
    from kvstore.shm_checks import MEMFD_RE, NAME_RE

    assert NAME_RE.match("kvs_abc") and not NAME_RE.match("kvs_abc\n")
    assert MEMFD_RE.match("kvs_0123abcd@12:3") and not MEMFD_RE.match("kvs_0123abcd@12:3\n")


def test_the_admin_service_refuses_a_tenant_named_with_a_newline(sidecar):
    admin = sidecar.admin()
    admin.create_tenant("acme")
    for args in (("acme\n",), ("pub", "publisher", ["shared:pub\n"])):
        with pytest.raises(errors.InvalidArgument):
            admin.create_tenant(*args)
    assert sorted(t["name"] for t in admin.list_tenants()) == ["acme", "admin"]
