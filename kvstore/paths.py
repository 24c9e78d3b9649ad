"""Path settings of the configs: never empty, a leading ``~`` expanded.

One module of its own, below :mod:`kvstore.config`, so that ``tiers.remote_config`` (which
``kvstore.config`` imports) takes its path fields the same way: its TLS file fields kept a
literal ``~`` (``tls_ca_file = "~/ca.pem"`` looked for a directory named ``~``).
"""

from __future__ import annotations

import os
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
