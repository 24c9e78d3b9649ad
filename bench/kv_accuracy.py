"""What FP8 and INT8 KV quantization do to a real model (SmolLM2-135M-Instruct, GGUF Q4_1).

Method (one variant = one way of storing the KV blocks; the model itself runs in float32):

1. Prefill ``prompt[:-1]``; the DynamicCache now holds the prompt's K and V.
2. Per variant, rebuild the cache after a store round trip *in block units*
   (``[n, 2, L, H, T, D]``, T = 16; the partial last block is its own group): cast to the spec
   dtype fp16, then ``kernels.quant.quantize`` + ``dequantize`` back to fp16, then to float32.
   The ``fp16`` variant is the cast alone (the lossless store's floor).
3. From the exact cache, greedy-decode ``N`` tokens (the reference continuation).
4. Teacher-forced: feed ``[prompt[-1], ref[:-1]]`` on the exact and on each altered cache in
   one forward; compare the logits step by step: top-1 agreement, max/mean |Δlogit|, mean
   KL(exact || altered).
5. Free-running: greedy-decode ``N`` tokens from each altered cache; report the first step at
   which it leaves the reference (``N`` = never) and, for the long document, whether the answer
   still names the fact planted at its start.
6. Perplexity on a fixed text, processed in 64-token chunks; after each chunk the chunk's K/V
   (4 whole blocks) go through the variant's round trip, so later tokens attend to stored KV.

Writes ``bench/results/kv_accuracy.json`` and ``bench/results/kv_accuracy.md`` and prints the
JSON. ``--quick`` runs a tiny version (for the slow test). Needs transformers, gguf, accelerate.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.quant import QuantScheme, dequantize, quantize
from kvstore.integrations.smollm2 import ModelFiles, ensure_smollm2

BLOCK_TOKENS = 16
SPEC_DTYPE = torch.float16
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Variant:
    """How the KV blocks are stored: ``scheme=None`` means the fp16 cast only."""

    name: str
    scheme: QuantScheme | None
    key_granularity: str = "channel"


VARIANTS = (
    Variant("fp16", None),
    Variant("int8/channel-k", QuantScheme.INT8, "channel"),
    Variant("int8/head-k", QuantScheme.INT8, "head"),
    Variant("fp8/channel-k", QuantScheme.FP8_E4M3, "channel"),
    Variant("fp8/head-k", QuantScheme.FP8_E4M3, "head"),
)

FACT = "The passphrase for the river archive is BLUE HERON 47."
FACT_MARKERS = ("heron", "47")

PPL_TEXT = (
    "The lighthouse at the end of the northern breakwater was built in the spring of 1871, after "
    "two winters in which the fishing fleet lost eleven boats on the rocks below the cliffs. The "
    "harbour board first asked for a lightship, but the sea there is too rough for an anchored "
    "vessel, and the engineer they hired argued for a stone tower instead. His plan was simple: a "
    "granite base sunk into the bedrock, a tapering brick shaft of sixty feet, and a lantern room "
    "of iron and glass that could be reached by a single spiral stair. The stone came by cart from "
    "a quarry eight miles inland, and the bricks by barge from the river towns to the south. Work "
    "stopped twice, once for a storm that washed away the wooden scaffolding and once because the "
    "money ran out, and the town raised the rest by a subscription that every household joined. "
    "When the lamp was lit for the first time, people walked out along the breakwater to watch it "
    "turn. The first keeper was a retired sailor named Thomas Hale, who lived in the small cottage "
    "at the foot of the tower with his wife and three children. Each evening he trimmed the wicks, "
    "polished the lenses and wound the clockwork that turned the light, and each morning he wrote "
    "the weather, the ships he had seen and the oil he had burned in a ledger that the town still "
    "keeps. In 1902 the oil lamp was replaced by an incandescent mantle, which was brighter and "
    "needed less care, and in 1938 the tower was connected to the electrical grid. The keepers "
    "stayed until 1976, when the light was automated and the cottage was sold. Today the tower is "
    "painted white with a single red band, the lantern still turns every night, and in summer the "
    "cottage serves tea to walkers who come to read the old ledgers and look out over the water. "
    "The ledgers themselves are an unusual record of a small place. Between the weather notes, the "
    "keepers wrote down births and weddings in the town, the price of coal, the arrival of the "
    "first motor car on the harbour road and the night in 1916 when a convoy passed without lights. "
    "One keeper pressed flowers between the pages; another copied out recipes for fish soup and "
    "plum cake. Historians who study the coast have used the entries to date storms that are "
    "missing from official records, and a school in the town now asks its pupils to transcribe a "
    "page each year, so that the whole collection will one day be searchable. Reading them, one "
    "is struck less by the danger of the work than by its patience: the same tasks, done well, "
    "every evening for a hundred years, so that strangers at sea could find their way home."
)


def build_prompts(tokenizer: Any, *, long_doc_sentences: int) -> dict[str, torch.Tensor]:
    """The prompt set: short QA, long document with a fact at its start, code, multi-turn chat."""

    def chat(messages: list[dict[str, str]]) -> torch.Tensor:
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = enc["input_ids"] if not isinstance(enc, torch.Tensor) else enc
        return ids[:1]

    rng = random.Random(1871)
    towns = ["Marlow", "Ashby", "Kelton", "Brisbury", "Dunmore", "Fairholt", "Greywick", "Holloway"]
    things = ["a stone bridge", "a grain mill", "a school", "a market hall", "a canal lock",
              "a chapel", "a railway station", "a public library"]  # fmt: skip
    verbs = ["built", "repaired", "closed", "rebuilt", "extended", "sold"]
    filler = " ".join(
        f"In {rng.randint(1700, 1950)} the town of {rng.choice(towns)} {rng.choice(verbs)} "
        f"{rng.choice(things)} near the {rng.choice(['river', 'square', 'harbour', 'hill'])}."
        for _ in range(long_doc_sentences)
    )
    document = f"{FACT}\n\n{filler}"
    code = (
        "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
        '    """Merge two sorted lists into one sorted list."""\n'
        "    result = []\n"
        "    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n"
    )
    return {
        "short_qa": chat([{"role": "user", "content": "What is the capital of Japan, and which "
                           "river flows through Paris?"}]),
        "long_doc": chat([{"role": "user", "content": f"Read this document.\n\n{document}\n\n"
                           "What is the passphrase for the river archive, given at the start "
                           "of the document?"}]),
        "code": tokenizer(code, return_tensors="pt")["input_ids"],
        "chat": chat([
            {"role": "user", "content": "I want to plant a small vegetable garden. Where do I start?"},
            {"role": "assistant", "content": "Pick a sunny spot with at least six hours of light, "
             "start with easy crops like lettuce, radishes and beans, and improve the soil with "
             "compost before planting."},
            {"role": "user", "content": "My balcony only gets morning sun. Which of those still works?"},
        ]),
    }


# -- KV round trip in block units ---------------------------------------------------------------


def roundtrip_kv(keys: list[torch.Tensor], values: list[torch.Tensor], variant: Variant,
                 start: int, stop: int) -> None:
    """Replace tokens ``[start, stop)`` of every layer's K/V (``[1, H, S, D]``) in place by
    their store round trip under ``variant``, grouping tokens into blocks of BLOCK_TOKENS."""
    span = stop - start
    if span <= 0:
        return
    n = -(-span // BLOCK_TOKENS)
    kv = torch.stack([torch.stack([k[0, :, start:stop] for k in keys]),
                      torch.stack([v[0, :, start:stop] for v in values])])  # [2, L, H, S, D]
    two, layers, heads, _, dim = kv.shape
    padded = kv.new_zeros((two, layers, heads, n * BLOCK_TOKENS, dim))  # zeros never raise amax
    padded[:, :, :, :span] = kv
    blocks = padded.view(two, layers, heads, n, BLOCK_TOKENS, dim).permute(3, 0, 1, 2, 4, 5)
    blocks = blocks.to(SPEC_DTYPE).contiguous()  # [n, 2, L, H, T, D] in the spec dtype
    if variant.scheme is not None:
        blocks = dequantize(quantize(blocks, variant.scheme, variant.key_granularity), SPEC_DTYPE)
    back = blocks.to(kv.dtype).permute(1, 2, 3, 0, 4, 5).reshape(two, layers, heads, -1, dim)
    for layer in range(layers):
        keys[layer][0, :, start:stop] = back[0, layer, :, :span]
        values[layer][0, :, start:stop] = back[1, layer, :, :span]


def _cache_tensors(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def _clone_cache(cache: Any, config: Any) -> Any:
    from transformers import DynamicCache

    keys, values = _cache_tensors(cache)
    return DynamicCache([(k.clone(), v.clone()) for k, v in zip(keys, values)], config=config)


# -- measurements -------------------------------------------------------------------------------


def _forward(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    # NOTE: transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns).
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=ids, use_cache=True, **{kw: cache}).logits[0].float()


def _greedy(model: Any, first: torch.Tensor, cache: Any, steps: int, stop: frozenset[int]) -> list[int]:
    """Greedy-decode up to ``steps`` tokens; the first token in ``stop`` (EOS) ends it."""
    tokens, nxt = [], first
    for _ in range(steps):
        tok = int(_forward(model, nxt, cache)[-1].argmax())
        tokens.append(tok)
        if tok in stop:
            break
        nxt = torch.tensor([[tok]])
    return tokens


def _stop_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids = {tokenizer.eos_token_id, model.config.eos_token_id}
    gen = model.generation_config.eos_token_id
    ids.update(gen if isinstance(gen, list) else [gen])
    return frozenset(i for i in ids if i is not None)


def prompt_metrics(model: Any, tokenizer: Any, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    """Per-variant metrics for one prompt (see the module docstring, steps 1-5)."""
    base = _prefill(model, ids[:, :-1])
    last = ids[:, -1:]
    stop = _stop_ids(model, tokenizer)
    ref = _greedy(model, last, _clone_cache(base, model.config), steps, stop)
    steps = len(ref)  # the reference may end early at EOS; compare that many steps
    tf_ids = torch.cat([last, torch.tensor([ref[:-1]], dtype=last.dtype)], dim=1)
    exact_logits = _forward(model, tf_ids, _clone_cache(base, model.config))
    exact_logp = torch.log_softmax(exact_logits, dim=-1)
    ref_text = tokenizer.decode(ref, skip_special_tokens=True)
    out: dict[str, Any] = {"prompt_tokens": int(ids.shape[1]), "reference": ref_text,
                           "reference_tokens": steps,
                           "reference_fact_retrieved": _has_fact(ref_text)}
    for variant in VARIANTS:
        cache = _clone_cache(base, model.config)
        keys, values = _cache_tensors(cache)
        roundtrip_kv(keys, values, variant, 0, keys[0].shape[2])
        altered = _clone_cache(cache, model.config)
        logits = _forward(model, tf_ids, cache)
        diff = (logits - exact_logits).abs()
        logp = torch.log_softmax(logits, dim=-1)
        kl = (exact_logp.exp() * (exact_logp - logp)).sum(-1)
        free = _greedy(model, last, altered, steps, frozenset())
        diverge = next((i for i, (a, b) in enumerate(zip(free, ref)) if a != b), steps)
        text = tokenizer.decode(free, skip_special_tokens=True)
        out[variant.name] = {
            "top1_agreement": float((logits.argmax(-1) == exact_logits.argmax(-1)).float().mean()),
            "max_abs_logit_err": float(diff.max()),
            "mean_abs_logit_err": float(diff.mean()),
            "mean_kl": float(kl.mean()),
            "first_divergence": diverge,
            "free_run_agreement": sum(a == b for a, b in zip(free, ref)) / steps,
            "fact_retrieved": _has_fact(text),
            "text": text,
        }
    return out


def _has_fact(text: str) -> bool:
    return all(marker in text.lower() for marker in FACT_MARKERS)


def _prefill(model: Any, ids: torch.Tensor) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    _forward(model, ids, cache)
    return cache


def perplexity(model: Any, ids: torch.Tensor, variant: Variant | None, chunk: int) -> float:
    """Perplexity of ``ids`` processed in ``chunk``-token pieces; after each piece its K/V go
    through ``variant``'s round trip (``None`` = exact KV)."""
    from transformers import DynamicCache

    assert chunk % BLOCK_TOKENS == 0
    cache = DynamicCache(config=model.config)
    nll, count = 0.0, 0
    for start in range(0, ids.shape[1] - 1, chunk):
        piece = ids[:, start : start + chunk + 1]
        logits = _forward(model, piece[:, :-1], cache)
        logp = torch.log_softmax(logits, dim=-1)
        nll -= float(logp.gather(1, piece[0, 1:, None]).sum())
        count += piece.shape[1] - 1
        if variant is not None:
            keys, values = _cache_tensors(cache)
            roundtrip_kv(keys, values, variant, start, keys[0].shape[2])
    return math.exp(nll / count)


# -- driver -------------------------------------------------------------------------------------


def load_model(files: ModelFiles) -> tuple[Any, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(files.directory, gguf_file=files.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        files.directory, gguf_file=files.gguf_file, dtype=torch.float32
    )
    model.eval()
    return model, tokenizer


def run(*, quick: bool = False, threads: int = 1) -> dict[str, Any]:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    files = ensure_smollm2()
    model, tokenizer = load_model(files)
    load_s = time.perf_counter() - t0
    steps = 8 if quick else 32
    prompts = build_prompts(tokenizer, long_doc_sentences=8 if quick else 90)
    if quick:
        prompts = {"short_qa": prompts["short_qa"], "long_doc": prompts["long_doc"]}
    ppl_ids = tokenizer(PPL_TEXT, return_tensors="pt")["input_ids"]
    if quick:
        ppl_ids = ppl_ids[:, :129]
    with torch.inference_mode():
        per_prompt = {name: prompt_metrics(model, tokenizer, ids, steps) for name, ids in prompts.items()}
        ppl = {"exact": perplexity(model, ppl_ids, None, 64)}
        for variant in VARIANTS:
            ppl[variant.name] = perplexity(model, ppl_ids, variant, 64)
    cfg = model.config
    result = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, run in float32)",
        "kv": {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
               "head_dim": cfg.hidden_size // cfg.num_attention_heads,
               "block_tokens": BLOCK_TOKENS, "spec_dtype": str(SPEC_DTYPE).removeprefix("torch.")},
        "decode_steps": steps,
        "quick": quick,
        "prompts": per_prompt,
        "perplexity": {"tokens": int(ppl_ids.shape[1]), "chunk": 64, **ppl},
        "summary": summarize(per_prompt, ppl),
        "seconds": {"load": round(load_s, 1), "total": round(time.perf_counter() - t0, 1)},
    }
    return result


def summarize(per_prompt: dict[str, Any], ppl: dict[str, float]) -> dict[str, Any]:
    summary = {}
    for variant in VARIANTS:
        rows = [p[variant.name] for p in per_prompt.values()]
        summary[variant.name] = {
            "top1_agreement": sum(r["top1_agreement"] * p["reference_tokens"]
                                  for r, p in zip(rows, per_prompt.values()))
            / sum(p["reference_tokens"] for p in per_prompt.values()),
            "max_abs_logit_err": max(r["max_abs_logit_err"] for r in rows),
            "mean_abs_logit_err": sum(r["mean_abs_logit_err"] for r in rows) / len(rows),
            "mean_kl": sum(r["mean_kl"] for r in rows) / len(rows),
            "first_divergence": {name: p[variant.name]["first_divergence"]
                                 for name, p in per_prompt.items()},
            "reference_tokens": {name: p["reference_tokens"] for name, p in per_prompt.items()},
            "perplexity": ppl[variant.name],
            "perplexity_delta_pct": 100.0 * (ppl[variant.name] / ppl["exact"] - 1.0),
        }
    return summary


def markdown(result: dict[str, Any]) -> str:
    kv = result["kv"]
    names = list(result["prompts"])
    lines = [
        f"# KV quantization accuracy — {result['model']}",
        "",
        (f"KV: {kv['layers']} layers × {kv['kv_heads']} KV heads × head_dim {kv['head_dim']}, "
        f"blocks of {kv['block_tokens']} tokens, spec dtype {kv['spec_dtype']}. "
        f"Up to {result['decode_steps']} greedy steps per prompt; reference = exact float32 KV. "
        f"Perplexity: {result['perplexity']['tokens']} tokens in chunks of "
        f"{result['perplexity']['chunk']}, exact = {result['perplexity']['exact']:.3f}."),
        "",
        "| variant | top-1 agreement | max abs Δlogit | mean abs Δlogit | mean KL | first divergence ("
        + ", ".join(names) + ") | perplexity (Δ%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        div = ", ".join(f"{s['first_divergence'][p]}/{s['reference_tokens'][p]}" for p in names)
        lines.append(
            f"| {name} | {100 * s['top1_agreement']:.1f} % | {s['max_abs_logit_err']:.3f} | "
            f"{s['mean_abs_logit_err']:.4f} | {s['mean_kl']:.2e} | {div} | "
            f"{s['perplexity']:.3f} ({s['perplexity_delta_pct']:+.2f} %) |"
        )
    if "long_doc" in result["prompts"]:
        doc = result["prompts"]["long_doc"]
        got = ", ".join(f"{v.name}: {'yes' if doc[v.name]['fact_retrieved'] else 'no'}" for v in VARIANTS)
        ref = "yes" if doc["reference_fact_retrieved"] else "no"
        lines += ["", (f"Long document ({doc['prompt_tokens']} tokens), fact planted at its start "
                  f"retrieved — exact KV: {ref}, {got}. Reference answer: {doc['reference']!r}")]
    lines += ["", ("top-1 agreement: teacher-forced on the reference tokens, over all steps of all "
              "prompts. first divergence a/b: free-running greedy decoding from the altered cache "
              "first differs from the reference at step a of b (a = b: never; the reference stops "
              f"at EOS or after {result['decode_steps']} tokens)."),
              f"Generated by `python -m bench.kv_accuracy` in {result['seconds']['total']} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny run (2 prompts, 8 steps)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    result = run(quick=args.quick, threads=args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_accuracy.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "kv_accuracy.md").write_text(markdown(result))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
