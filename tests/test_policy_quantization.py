"""QuantizationPolicy: lossless by default; the most specific rule wins; unquantizable specs
are always lossless."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.quant import QuantScheme
from kvstore.errors import InvalidArgument
from kvstore.quantization import Quantization
from kvstore.spec import ModelSpec
from policy.quantization import QuantizationPolicy, QuantRule

INT8 = Quantization(QuantScheme.INT8)
FP8 = Quantization(QuantScheme.FP8_E4M3)
FP8_HEAD = Quantization(QuantScheme.FP8_E4M3, "head")


def _spec(model: str = "m", dtype: str = "bfloat16", tokens: int = 16) -> ModelSpec:
    return ModelSpec(model=model, revision="r", num_layers=2, num_kv_heads=2, head_dim=64,
                     dtype=dtype, block_tokens=tokens)


A, B = _spec("a"), _spec("b")


def test_policy_quant_default_is_lossless_for_everyone() -> None:
    p = QuantizationPolicy()
    assert p.for_block("t", A) is None and p.for_block("u", B) is None
    assert p.rules() == []


def test_policy_quant_most_specific_rule_wins() -> None:
    p = QuantizationPolicy(default=FP8_HEAD)
    p.set(INT8, model=A.fingerprint)
    p.set(FP8, tenant="t")
    p.set(None, tenant="t", model=B.fingerprint)  # explicit lossless for this pair
    p.set(None, tenant="lossless")
    assert p.for_block("t", A) == FP8  # tenant beats model
    assert p.for_block("t", B) is None  # pair beats tenant
    assert p.for_block("u", A) == INT8  # model rule
    assert p.for_block("u", B) == FP8_HEAD  # default
    assert p.for_block("lossless", A) is None  # an explicit tenant "lossless" beats the model rule
    assert [(r.tenant, r.model) for r in p.rules()] == [
        ("t", B.fingerprint), ("lossless", None), ("t", None), (None, A.fingerprint)]
    assert QuantRule("t", None, FP8) in p.rules()


def test_policy_quant_clear_and_forget() -> None:
    p = QuantizationPolicy()
    p.set(INT8, tenant="t")
    p.set(FP8, tenant="t", model=A.fingerprint)
    p.set(FP8, model=A.fingerprint)
    p.set(FP8_HEAD)  # the default
    assert p.clear(tenant="t") is True and p.clear(tenant="t") is False
    assert p.for_block("t", A) == FP8 and p.for_block("t", B) == FP8_HEAD
    assert p.forget_tenant("t") == 1
    assert p.for_block("t", A) == FP8  # the model rule remains
    assert p.forget_model(A.fingerprint) == 1
    assert p.for_block("t", A) == FP8_HEAD
    assert p.clear() is True and p.for_block("t", A) is None


def test_policy_quant_unquantizable_specs_are_always_lossless() -> None:
    p = QuantizationPolicy(default=INT8)
    assert p.for_block("t", _spec(dtype="float8")) is None  # already one byte per element
    assert p.for_block("t", _spec(dtype="float16", tokens=1)) is None  # scales outweigh saving
    assert p.for_block("t", _spec(dtype="float32")) == INT8


def test_policy_quant_from_names_and_bad_input() -> None:
    p = QuantizationPolicy.from_names("int8", tenants={"t": "none", "u": "fp8_e4m3/head"},
                                      models={A.fingerprint: "fp8_e4m3"})
    assert p.default == INT8
    assert p.for_block("t", A) is None and p.for_block("u", A) == FP8_HEAD
    assert p.for_block("v", A) == FP8 and p.for_block("v", B) == INT8
    assert QuantizationPolicy(default=QuantScheme.INT8).default == INT8  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        QuantizationPolicy.from_names("int4")
    with pytest.raises(InvalidArgument):
        p.set(INT8, model=b"short")
    with pytest.raises(InvalidArgument):
        p.set(INT8, tenant="")
    with pytest.raises(InvalidArgument):
        p.set("int8", tenant="t")  # type: ignore[arg-type]


_FORMATS = st.sampled_from([None, INT8, FP8, FP8_HEAD])


@settings(max_examples=60, deadline=None)
@given(default=_FORMATS, pair=st.none() | _FORMATS.map(lambda q: ("set", q)),
       tenant=st.none() | _FORMATS.map(lambda q: ("set", q)),
       model=st.none() | _FORMATS.map(lambda q: ("set", q)))
def test_policy_quant_matches_the_precedence_table(default, pair, tenant, model) -> None:  # type: ignore[no-untyped-def]
    p = QuantizationPolicy(default=default)
    if pair:
        p.set(pair[1], tenant="t", model=A.fingerprint)
    if tenant:
        p.set(tenant[1], tenant="t")
    if model:
        p.set(model[1], model=A.fingerprint)
    want = next((r[1] for r in (pair, tenant, model) if r), default)
    assert p.for_block("t", A) == want
    # another tenant and another model only ever see the rules that name them
    assert p.for_block("other", B) == default
    assert p.for_block("other", A) == (model[1] if model else default)
