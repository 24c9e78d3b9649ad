"""``kvstore demo --quick``: the scripted conversation with a random-init tiny Llama through an
embedded sidecar. Checks what the demo shows (tiers of each hit, the paused tool call) and that
generation with and without kvstore gives the same tokens. No timing assertions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: pip install 'kvstore[hf]'")

import typer
from typer.testing import CliRunner

from kvstore.cli_demo import (
    DemoResult,
    demo,
    embedded_sidecar,
    load_chat_model,
    run_demo,
)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoResult]:
    with embedded_sidecar(tmp_path_factory.mktemp("demo") / "sidecar") as client:
        yield run_demo(load_chat_model(quick=True), client, max_new_tokens=6, repeats=1,
                       tool_seconds=0.0)


def _turn(result: DemoResult, session: str, label: str) -> Any:
    return next(t for t in result.turns if t.session == session and t.label == label)


def test_demo_quick_uses_the_random_init_model(result: DemoResult) -> None:
    assert "random-init" in result.model.name
    assert result.model.why == "--quick"


def test_demo_text_is_identical_with_and_without_the_store(result: DemoResult) -> None:
    assert len(result.turns) == 5
    assert all(t.identical for t in result.turns), [(t.session, t.label) for t in result.turns]
    assert result.identical


def test_demo_first_turn_misses_then_reuses_from_hbm(result: DemoResult) -> None:
    first = _turn(result, "alice", "1")
    assert first.reused_tokens == 0 and first.tiers == {}
    second = _turn(result, "alice", "2")
    assert second.reused_tokens > 0 and set(second.tiers) == {"hbm"}
    assert second.reused_tokens < second.prompt_tokens  # at least one token is always prefilled


def test_demo_tool_call_pauses_to_dram_and_the_other_user_hits_dram(result: DemoResult) -> None:
    paused, resumed = result.events
    assert "paused" in paused and "dram" in paused and "hbm" not in paused
    assert "resumed" in resumed and "hbm" in resumed
    bob = _turn(result, "bob", "1")
    assert set(bob.tiers) == {"dram"}  # the shared system prompt, demoted while alice waits
    assert bob.reused_tokens >= 16 * 16  # the system prompt spans many 16-token blocks
    after_tool = _turn(result, "alice", "4 tool")
    assert set(after_tool.tiers) == {"hbm"}
    assert after_tool.reused_tokens > _turn(result, "alice", "3").reused_tokens


def test_demo_command_prints_the_tier_table() -> None:
    app = typer.Typer()
    app.command()(demo)
    out = CliRunner().invoke(app, ["--quick", "--repeats", "1", "--threads", "1",
                                   "--tool-seconds", "0", "--no-show-answers"])
    assert out.exit_code == 0, out.output
    text = out.output
    assert "random-init" in text
    assert "time to first token" in text
    for word in ("hbm", "dram", "miss", "TTFT full", "TTFT kvstore", "same text"):
        assert word in text, word
    assert "NO" not in text and "differs" not in text
    assert text.count(" yes ") == 5
