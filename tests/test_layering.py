"""The import direction of DESIGN.md §1, checked on the source (never the other way):

``kernels`` ← the ``kvstore`` data model ← ``tiers``, ``policy`` ← ``kvstore.store`` ←
service / client / CLI ← ``bench``; ``policy`` never touches bytes or tensors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: modules above the Store (and the Store itself): only the service, client and CLI use them
_UPPER = ("kvstore.store", "kvstore.service", "kvstore.servicer", "kvstore.server", "kvstore.client",
          "kvstore.cli", "kvstore.admin_client", "kvstore.integrations")
#: the data model: what tiers and policy build on
_DATA_MODEL = ("block", "keys", "spec", "errors", "sizes", "codec", "codec_buffers", "codec_chunks",
               "codec_config", "codec_format", "quantization", "validation", "paths")


def _imports(path: Path) -> list[tuple[str, int]]:
    """Absolute imports of a file, anywhere in it (lazy imports inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def _forbidden(package: str, stem: str, module: str) -> bool:
    top = module.split(".")[0]
    if top == "bench":
        return package != "bench"
    if package == "kernels":
        return top in ("kvstore", "tiers", "policy")
    if package == "policy":
        return top in ("tiers", "torch", "numpy") or module.startswith(_UPPER)
    if package == "tiers":
        return top == "policy" or module.startswith(_UPPER)
    if package == "kvstore" and stem in _DATA_MODEL:
        return top in ("tiers", "policy") or module.startswith(_UPPER)
    return False


@pytest.mark.parametrize("package", ["kernels", "policy", "tiers", "kvstore"])
def test_imports_follow_the_design_direction(package: str) -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for module, line in _imports(path)
             if _forbidden(package, path.stem, module)]
    assert not wrong, "imports against DESIGN.md §1:\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_import() -> None:
    assert _forbidden("kernels", "copy", "kvstore.errors")
    assert _forbidden("policy", "cost", "tiers.nvme")
    assert _forbidden("tiers", "nvme", "kvstore.store")
    assert _forbidden("kvstore", "block", "policy.base")
    assert not _forbidden("kvstore", "store", "policy.base")


def test_errors_are_one_hierarchy() -> None:
    import kernels.errors
    import kvstore.errors

    assert kvstore.errors.InvalidArgument is kernels.errors.InvalidArgument
    assert issubclass(kvstore.errors.UnknownTier, kernels.errors.KVStoreError)
    exported = {n for n in dir(kvstore.errors) if isinstance(getattr(kvstore.errors, n), type)
                and issubclass(getattr(kvstore.errors, n), kernels.errors.KVStoreError)}
    assert exported == set(kvstore.errors.__all__)
