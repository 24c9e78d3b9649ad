"""Regenerate the checked-in gRPC/protobuf stubs of ``kvstore.v1``.

Run from the repository root after editing a ``.proto``::

    python -m proto.kvstore.v1.generate

The stubs are generated with ``-I <repo root>`` so that their imports read
``from proto.kvstore.v1 import kvstore_pb2`` (and never collide with the top-level ``kvstore``
package). ``tests/test_service_proto.py`` regenerates into a temporary directory and fails when
the checked-in files are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parents[2]
PROTOS = ("proto/kvstore/v1/kvstore.proto", "proto/kvstore/v1/admin.proto")
#: the generated files, relative to the repository root
GENERATED = tuple(
    p.replace(".proto", suffix) for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
)


def generate(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc into ``out_dir`` (mirroring the repo layout); return the files."""
    from grpc_tools import protoc  # test/dev dependency only

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{REPO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(REPO_ROOT / p) for p in PROTOS),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return [out_dir / g for g in GENERATED]


def main() -> int:
    generate(REPO_ROOT)
    print("regenerated:", *GENERATED, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
