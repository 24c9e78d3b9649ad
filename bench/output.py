"""Where a benchmark's JSON goes: stdout always, and ``out`` too when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_json(result: Any, out: Path | None) -> str:
    """Print ``result`` as indented JSON and write it to ``out`` (parents created) if given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text
