"""Path settings of the configs: never empty, a leading ``~`` expanded.

One module of its own, below :mod:`kvstore.config`, so that ``tiers.remote_config`` (which
``kvstore.config`` imports) takes its path fields the same way: its TLS file fields kept a
literal ``~`` (``tls_ca_file = "~/ca.pem"`` looked for a directory named ``~``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator


def _user_path(value: Any) -> Any:
    """A path setting as given (text or a path): refused when empty, a leading ``~`` or
    ``~user`` expanded; None and anything else are left to the field's own validation.

    NOTE: ``path = ""`` became ``Path("")``, the current directory, and the server kept its
    blocks, keys and tokens wherever it was started; ``path = "~/x"`` made a directory named
    ``~`` there (while ``$KVSTORE_HOME`` was expanded)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("must not be empty (an empty path is whatever directory the server is started in)")
    if not isinstance(value, (str, os.PathLike)):
        return value
    try:
        return Path(value).expanduser()
    except RuntimeError as exc:  # ~nosuchuser, or no home directory to expand ~ to
        raise ValueError(f"cannot expand the ~ of {os.fspath(value)[:200]!r}: {exc}") from None


#: a path setting: never empty, its leading ``~`` expanded (every path field of the configs)
UserPath = Annotated[Path, BeforeValidator(_user_path)]
#: the same, or None
OptionalUserPath = Annotated[Path | None, BeforeValidator(_user_path)]


def private_file_problem(path: Path, *, group_ok: bool = False) -> str | None:
    """Why ``path`` cannot hold a secret (it is not a regular file; users other than its owner
    may read or write it, or, with ``group_ok``, users outside its group), as a phrase to put
    after the file's name; None when it can. OSError when it cannot be stat'ed."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_mode & (0o007 if group_ok else 0o077):
        who = "other users" if group_ok else "group/other users"
        return (f"has permissions {stat.S_IMODE(st.st_mode):04o}: {who} may read or change it "
                f"(chmod {'o-rwx' if group_ok else '600'} it)")
    return None
