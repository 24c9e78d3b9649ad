"""``kvstore demo``: a chat model reusing its prompt KV through an embedded kvstore sidecar.

What it does, in one process:

1. starts a sidecar (``kvstore.server.create_server`` on 127.0.0.1, port 0, a temporary data
   directory) and connects a :class:`kvstore.client.Client` to it as tenant ``demo``;
2. loads a small real model: SmolLM2-135M-Instruct (GGUF fixture of ``kvstore.integrations.smollm2``,
   run in float32) when it can be fetched, else — or with ``--quick`` — a random-init tiny Llama
   built from a config with a byte-level tokenizer. The table's caption says which, and why;
3. runs a scripted conversation. Two users share one system prompt (a document):
   ``alice`` asks three questions, the third needs a tool: her session is paused while the tool
   "runs" (her blocks are demoted HBM -> DRAM), ``bob`` arrives meanwhile and reuses the shared
   system prompt from DRAM, then the tool returns, ``alice`` is resumed (blocks promoted back)
   and asks on;
4. for each turn measures time to first token (one prefill forward, argmax of the last logits)
   without kvstore (full prefill) and with it (restore the longest stored prefix through
   :class:`kvstore.integrations.hf.PrefixCache`, prefill only the suffix), notes which tier each
   reused block came from, then generates greedily both ways and checks the texts are equal.

Contract: exits 0 when every turn generated the same text with and without kvstore, 1
otherwise. Needs ``transformers`` (``pip install 'kvstore[hf]'``); everything heavy is imported
inside :func:`demo`, so the rest of the CLI never loads torch models.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["ChatModel", "TurnResult", "demo", "run_demo"]

BLOCK_TOKENS = 16
TENANT = "demo"
DOCUMENT = (
    "The Harbor Point lighthouse stands on a granite spit at the mouth of the Vell estuary. It was "
    "built in 1871 by the engineer Miriam Osei after two grain ships ran aground in the same winter. "
    "The tower is 31 metres tall and its light, a rotating Fresnel lens, can be seen 22 nautical "
    "miles out to sea. The first keeper, Tobias Lund, kept a logbook for thirty-four years in which "
    "he recorded every storm, every passing ship and the price of lamp oil. In 1923 the light was "
    "converted from oil to electricity, and in 1987 it was automated; the keeper's cottage became a "
    "small museum. The museum opens from April to October, every day except Monday, from ten in the "
    "morning until five in the afternoon. Tickets cost six euros for adults and are free for "
    "children under twelve. Visitors can climb the 142 steps to the lantern room on clear days. "
    "The logbooks of Tobias Lund are shown in the main room, next to a model of the grain ship "
    "Albatross, whose wreck can still be seen at low tide."
)
SYSTEM = ("You are the guide of the Harbor Point lighthouse museum. Answer briefly, using only "
          "this document:\n\n" + DOCUMENT)
TOOL_RESULT = "weather(Harbor Point) -> 14 C, light fog, wind 20 km/h from the west"


# -- models -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ChatModel:
    """A causal LM with its chat encoding: ``encode(messages) -> [1, n]`` ids with the
    generation prompt appended; ``decode(ids) -> str``."""

    name: str
    model: Any
    encode: Callable[[list[dict[str, str]]], Any]
    decode: Callable[[Any], str]
    why: str


def _byte_chat_model(why: str) -> ChatModel:
    """A random-init tiny Llama over bytes (no download): its text is noise, its KV is real."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()

    def encode(messages: list[dict[str, str]]) -> Any:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return torch.tensor([list(text.encode())], dtype=torch.long)

    def decode(ids: Any) -> str:
        return bytes(int(t) for t in ids.tolist()).decode(errors="replace")

    return ChatModel("random-init tiny Llama (4 layers, byte tokenizer)", model, encode, decode, why)


def _smollm2_chat_model() -> ChatModel:
    """SmolLM2-135M-Instruct via ``kvstore.integrations.smollm2``; raises ImportError / ModelUnavailable."""
    from kvstore.integrations.smollm2 import (
        MODEL_ID,
        chat_ids,
        ensure_smollm2,
        load_smollm2,
    )

    model, tokenizer = load_smollm2(ensure_smollm2())
    return ChatModel(MODEL_ID, model, lambda msgs: chat_ids(tokenizer, msgs),
                     lambda ids: tokenizer.decode(ids, skip_special_tokens=True), "")


def load_chat_model(quick: bool) -> ChatModel:
    """SmolLM2 unless ``quick`` or it cannot be had (the reason lands in ``ChatModel.why``)."""
    if quick:
        return _byte_chat_model("--quick")
    try:
        return _smollm2_chat_model()
    except ImportError as exc:  # bench/ is not importable (installed without the repository)
        return _byte_chat_model(f"SmolLM2 loader unavailable: {exc}")
    except RuntimeError as exc:  # ModelUnavailable / FixtureError from kvstore.integrations.smollm2
        return _byte_chat_model(f"SmolLM2 unavailable: {exc}")


# -- the embedded sidecar -----------------------------------------------------------------------
@contextmanager
def embedded_sidecar(data_dir: Path, *, hbm_bytes: int = 256 << 20, dram_bytes: int = 256 << 20,
                     nvme_bytes: int = 1 << 30) -> Iterator[Any]:
    """A sidecar on 127.0.0.1 (port 0) with tenant ``demo``; yields a connected ``Client``."""
    from kvstore import server_config
    from kvstore.admin_client import AdminClient
    from kvstore.client import Client
    from kvstore.server import bootstrap, create_server

    cfg = server_config.build({"listen": "127.0.0.1:0", "metrics": {"enabled": False},
                               "expire_interval_s": 0, "audit_fsync": False,
                               "store": {"hbm_bytes": hbm_bytes, "dram_bytes": dram_bytes,
                                         "nvme_bytes": nvme_bytes, "durable": False}},
                              data_dir=data_dir)
    admin_token = bootstrap(cfg)
    server, port = create_server(cfg)
    server.start()
    try:
        with AdminClient(f"127.0.0.1:{port}", admin_token) as admin:
            token = admin.create_tenant(TENANT)
        with Client(f"127.0.0.1:{port}", token) as client:
            yield client
    finally:
        server.stop(0)


@dataclass(frozen=True, slots=True)
class SessionTarget:
    """A :class:`~kvstore.integrations.hf.KVTarget` whose puts belong to one session (pinned
    while it is active, demoted when paused)."""

    client: Any
    session: str

    def block_keys(self, spec: Any, token_ids: Any) -> list[bytes]:
        return self.client.block_keys(spec, token_ids)

    def lookup(self, spec: Any, keys: Sequence[bytes], *, parent: bytes | None = None) -> Any:
        return self.client.lookup(spec, keys, parent=parent)

    def put(self, spec: Any, keys: Sequence[bytes], kv: Any, *, parent: bytes | None = None) -> None:
        self.client.put(spec, keys, kv, session=self.session, parent=parent)

    def get(self, spec: Any, keys: Sequence[bytes], *, parent: bytes | None = None) -> Any:
        return self.client.get(spec, keys, parent=parent)


# -- the conversation -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TurnResult:
    """One turn: ``tiers`` counts the reused blocks per tier they were read from."""

    label: str
    session: str
    prompt_tokens: int
    reused_tokens: int
    tiers: dict[str, int]
    ttft_full_s: float
    ttft_store_s: float
    identical: bool
    answer: str


@dataclass(frozen=True, slots=True)
class DemoResult:
    model: ChatModel
    turns: list[TurnResult]
    events: list[str]

    @property
    def identical(self) -> bool:
        return all(t.identical for t in self.turns)


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Chat:
    """Runs turns of several sessions against one model and one kvstore client."""

    def __init__(self, chat: ChatModel, client: Any, spec: Any, max_new_tokens: int, repeats: int):
        self.chat, self.client, self.spec = chat, client, spec
        self.gen = {"max_new_tokens": max_new_tokens, "do_sample": False}
        self.repeats = repeats
        self.history: dict[str, list[dict[str, str]]] = {}

    def turn(self, label: str, session: str, user: str) -> TurnResult:
        import torch

        from kvstore.integrations.hf import PrefixCache, forward

        if session not in self.history:
            self.client.open_session(session)
            self.history[session] = [{"role": "system", "content": SYSTEM}]
        messages = self.history[session]
        messages.append({"role": "user", "content": user})
        ids = self.chat.encode(messages)
        model = self.chat.model
        pc = PrefixCache(SessionTarget(self.client, session), self.spec)

        def first_token_full() -> int:
            return int(forward(model, ids, None).logits[0, -1].argmax())

        first = pc.restore(ids)  # the hit this turn gets, before anything else touches the store

        def first_token_store() -> int:
            restored = pc.restore(ids)
            out = forward(model, ids[:, restored.num_tokens:], restored.cache)
            return int(out.logits[0, -1].argmax())

        ttft_full = _median_time(first_token_full, self.repeats)
        ttft_store = _median_time(first_token_store, self.repeats)
        with_store = pc.generate(model, ids, **self.gen)
        with torch.no_grad():
            reference = model.generate(ids, **self.gen)
        answer = self.chat.decode(with_store.sequences[0, ids.shape[1]:])
        messages.append({"role": "assistant", "content": answer})
        return TurnResult(label, session, int(ids.shape[1]), first.num_tokens,
                          dict(Counter(first.tiers)), ttft_full, ttft_store,
                          torch.equal(with_store.sequences, reference), answer)

    def session_tiers(self, session: str) -> dict[str, int]:
        """Where the blocks of ``session``'s conversation so far are (by tier)."""
        ids = self.chat.encode(self.history[session])
        keys = self.client.block_keys(self.spec, ids[0])
        return dict(Counter(self.client.lookup(self.spec, keys).tiers))


def _fmt_tiers(tiers: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(tiers.items())) or "miss"


def run_demo(chat: ChatModel, client: Any, *, max_new_tokens: int, repeats: int,
             tool_seconds: float) -> DemoResult:
    """The scripted conversation of the module docstring against ``client``."""
    from kvstore.integrations.hf import spec_from_config

    spec = spec_from_config(chat.model.config, chat.model.dtype, BLOCK_TOKENS, model=chat.name)
    c = _Chat(chat, client, spec, max_new_tokens, repeats)
    turns = [c.turn("1", "alice", "When was the lighthouse built?"),
             c.turn("2", "alice", "Who was its first keeper?"),
             c.turn("3", "alice", "Is it a good day to climb the tower? Check the weather.")]
    events = []
    client.pause_session("alice")
    events.append(f"tool call: alice paused, her blocks now in {_fmt_tiers(c.session_tiers('alice'))}")
    turns.append(c.turn("1", "bob", "How much is a ticket for an adult?"))
    time.sleep(tool_seconds)  # the tool "runs"
    client.resume_session("alice")
    events.append(f"tool returned: alice resumed, her blocks now in "
                  f"{_fmt_tiers(c.session_tiers('alice'))}")
    turns.append(c.turn("4 tool", "alice", f"Tool result: {TOOL_RESULT}. Answer now."))
    return DemoResult(chat, turns, events)


# -- output -----------------------------------------------------------------------------------------
def _table(result: DemoResult) -> Any:
    from rich.table import Table

    table = Table(title="kvstore demo: time to first token",
                  caption=f"model: {result.model.name}"
                          + (f" ({result.model.why})" if result.model.why else ""))
    for name, justify in (("session", "left"), ("turn", "left"), ("prompt", "right"),
                          ("reused", "right"), ("hit tiers", "left"), ("TTFT full", "right"),
                          ("TTFT kvstore", "right"), ("speedup", "right"), ("same text", "center")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for t in result.turns:
        speedup = t.ttft_full_s / t.ttft_store_s if t.ttft_store_s > 0 else float("inf")
        table.add_row(t.session, t.label, str(t.prompt_tokens), str(t.reused_tokens),
                      _fmt_tiers(t.tiers), f"{t.ttft_full_s * 1e3:.0f} ms",
                      f"{t.ttft_store_s * 1e3:.0f} ms", f"{speedup:.1f}x",
                      "yes" if t.identical else "[red]NO[/red]")
    return table


def demo(
    quick: Annotated[bool, typer.Option(
        "--quick", help="random-init tiny Llama, at most 8 new tokens (no download; for CI)")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="tokens generated per turn", min=1)] = 24,
    repeats: Annotated[int, typer.Option(help="TTFT measurements per turn (median)", min=1)] = 3,
    threads: Annotated[int, typer.Option(help="torch intra-op threads (0: torch's default)", min=0)] = 0,
    tool_seconds: Annotated[float, typer.Option(help="how long the paused tool call runs", min=0)] = 0.5,
    show_answers: Annotated[bool, typer.Option(help="print the generated answers")] = True,
) -> None:
    """Chat with a small model through an embedded kvstore sidecar and compare time to first
    token with and without it (shared system prompt, a paused tool call)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = Console()
    if not console.is_terminal:  # NOTE: piped or captured output: keep the table on one line per row
        console = Console(width=110)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # NOTE: the GGUF loader's bars would tear the progress bar
    try:
        import torch
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise typer.BadParameter(f"the demo needs transformers: pip install 'kvstore[hf]' ({exc})") from exc
    from kvstore.integrations.hf import forward

    hf_logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as tmp, ExitStack() as stack:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            task = progress.add_task("starting the kvstore sidecar", total=3)
            client = stack.enter_context(embedded_sidecar(Path(tmp) / "sidecar"))
            progress.update(task, advance=1, description="loading the model"
                            + (" (random-init)" if quick else " (SmolLM2-135M)"))
            chat = load_chat_model(quick)
            progress.update(task, advance=1, description="warming up")
            forward(chat.model, chat.encode([{"role": "system", "content": SYSTEM}]), None)
            progress.update(task, advance=1)
        console.print(f"model: [bold]{chat.name}[/bold]" + (f" ({chat.why})" if chat.why else ""))
        with console.status("running the conversation"):
            result = run_demo(chat, client, max_new_tokens=min(max_new_tokens, 8) if quick else max_new_tokens,
                              repeats=repeats, tool_seconds=tool_seconds)
    if show_answers:
        for t in result.turns:
            console.print(f"[dim]{t.session} #{t.label}:[/dim] {escape(repr(t.answer.strip()))}")
    for event in result.events:
        console.print(f"[cyan]{escape(event)}[/cyan]")
    console.print(_table(result))
    if not result.identical:
        console.print("[red]generated text differs with and without kvstore[/red]")
        raise typer.Exit(1)
