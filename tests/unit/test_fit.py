"""The memory fit (marketplace/fit.py) against published figures, and its monotonicity (hypothesis).

Sources: Llama 3.1 config.json (32 layers / 80 layers, 8 KV heads, head_dim 128:
https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json,
https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json); parameter counts from the model
cards (8.03B, 70.6B); slice memory from the catalog (NVIDIA MIG User Guide, Supported MIG Profiles:
H100 7g.80gb 81,152 MiB... via marketplace/data/catalog.json).
"""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from marketplace import fit as f

LIB = {m["key"]: m for m in json.loads(
    (Path(__file__).resolve().parents[2] / "marketplace/data/model_library.json").read_text())["models"]}
CATALOG = json.loads((Path(__file__).resolve().parents[2] / "marketplace/data/catalog.json").read_text())
SLICES = {(g, p["name"]): p["memory_mib"] for g, ps in CATALOG["mig_profiles"].items() for p in ps}
H100_7G, H200_7G = SLICES[("h100-sxm-80gb", "7g.80gb")], SLICES[("h200-sxm-141gb", "7g.141gb")]
H100_SLICES = [v for (g, _), v in SLICES.items() if g == "h100-sxm-80gb"]


def shape(key, **over):
    m = dict(LIB[key])
    m.update(over)
    return f.ModelShape(name=m["name"], backend=m["backend"], params=m["params"], layers=m["layers"],
                        kv_heads=m["kv_heads"], head_dim=m["head_dim"], weight_dtype=m["weight_dtype"],
                        kv_dtype=m["kv_dtype"], max_context=m["max_context"])


def test_llama_8b_bf16_published_figures():
    m = shape("llama-3.1-8b-instruct")
    assert 15.9e9 < m.weights_bytes < 16.2e9  # "about 16 GB" at BF16
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024  # 128 KiB per token


def test_llama_8b_on_h100_7g_full_context_and_cache():
    r = f.fit(shape("llama-3.1-8b-instruct"), H100_7G, context=8192, concurrency=16)
    assert r.fits and r.kv_mib == 8192 * 16 * 128 / 1024  # 16 GiB of cache
    assert r.max_context == r.max_cached_tokens // 16 < 131072
    assert f.fit(shape("llama-3.1-8b-instruct"), H100_7G, context=8192).max_context == 131072  # the model's cap
    assert r.headroom_mib == r.slice_mib - r.needed_mib


def test_llama_70b_bf16_fits_no_h100_slice():
    m = shape("llama-3.1-70b-instruct")
    assert 140e9 < m.weights_bytes < 142e9  # "about 141 GB" at BF16
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 320 KiB per token
    for mib in H100_SLICES:
        r = f.fit(m, mib, context=1024)
        assert not r.fits and r.max_cached_tokens == 0 and "weights and runtime alone" in r.reason


def test_llama_70b_bf16_leaves_almost_no_cache_on_h200_7g():
    r = f.fit(shape("llama-3.1-70b-instruct"), H200_7G, context=8192)
    assert r.fits
    assert 0 < r.max_cached_tokens < 32768  # under a quarter of one 131,072-token context
    assert not f.fit(shape("llama-3.1-70b-instruct"), H200_7G, context=65536).fits


def test_llama_70b_fp8_fits_h100_7g_with_tens_of_thousands_of_tokens():
    r = f.fit(shape("llama-3.1-70b-instruct-fp8"), H100_7G, context=8192)
    assert r.fits
    assert 10_000 <= r.max_cached_tokens < 100_000
    assert r.max_concurrency == r.max_cached_tokens // 8192


def test_several_models_on_one_slice_are_summed():
    m = shape("llama-3.1-8b-instruct")
    alone = f.fit(m, H100_7G, context=4096)
    second = f.fit(m, H100_7G, context=4096, other_mib=alone.needed_mib)
    third = f.fit(m, H100_7G, context=4096, other_mib=3 * alone.needed_mib + 10_000)
    assert alone.fits and second.fits and not third.fits
    assert second.headroom_mib == alone.headroom_mib - alone.needed_mib


def test_fixed_size_model_without_kv_cache():
    m = f.ModelShape(name="onnx-classifier", backend="onnxruntime", fixed_mib=900)
    r = f.fit(m, 9984, concurrency=64)
    assert r.fits and r.kv_per_token_bytes == 0 and r.needed_mib == 900 + f.RUNTIME_OVERHEAD_MIB["onnxruntime"]
    assert not f.fit(f.ModelShape(name="big", backend="python", fixed_mib=9984), 9984).fits


def test_adapters_count():
    base = shape("llama-3.1-8b-instruct")
    with_lora = f.ModelShape(**{**base.__dict__, "adapters_mib": (160, 160, 320)})
    a, b = f.fit(base, H100_7G, context=4096), f.fit(with_lora, H100_7G, context=4096)
    assert b.needed_mib - a.needed_mib == 640


def test_bad_inputs():
    m = shape("qwen2.5-7b-instruct")
    with pytest.raises(ValueError, match="max context"):
        f.fit(m, H100_7G, context=65536)
    with pytest.raises(ValueError, match="concurrency"):
        f.fit(m, H100_7G, concurrency=0)
    with pytest.raises(ValueError, match="dtype"):
        f.ModelShape(name="x", weight_dtype="FP7")


def test_vllm_memory_utilization():
    assert f.vllm_memory_utilization(40_000, 80_000) == 0.5
    assert f.vllm_memory_utilization(40_001, 80_000) == 0.51  # up: vLLM's budget holds what the fit sized
    assert f.vllm_memory_utilization(40_001, 80_000, free_mib=40_500) == 0.5  # unless others would be squeezed
    assert f.vllm_memory_utilization(90_000, 80_000) == 0.99
    assert f.vllm_memory_utilization(10, 80_000) == 0.05


ORDER = ["INT4", "FP8", "BF16", "FP32"]  # increasing bytes per element


@given(key=st.sampled_from(sorted(LIB)), mib=st.sampled_from(sorted(set(SLICES.values()))),
       ctx=st.integers(1, 16384), extra=st.integers(0, 16384), conc=st.integers(1, 64), more=st.integers(0, 64))
def test_monotone_in_context_and_concurrency(key, mib, ctx, extra, conc, more):
    m = shape(key)
    small, big_ctx, big_conc = (f.fit(m, mib, context=ctx, concurrency=conc),
                                f.fit(m, mib, context=ctx + extra, concurrency=conc),
                                f.fit(m, mib, context=ctx, concurrency=conc + more))
    for big in (big_ctx, big_conc):
        assert big.needed_mib >= small.needed_mib and big.headroom_mib <= small.headroom_mib
        assert not (big.fits and not small.fits)


@given(key=st.sampled_from(sorted(LIB)), mib=st.sampled_from(sorted(set(SLICES.values()))),
       ctx=st.integers(1, 32768), conc=st.integers(1, 16), i=st.integers(0, 3), j=st.integers(0, 3))
def test_monotone_in_dtype(key, mib, ctx, conc, i, j):
    lo, hi = sorted((i, j))
    a = f.fit(shape(key, weight_dtype=ORDER[lo]), mib, context=ctx, concurrency=conc)
    b = f.fit(shape(key, weight_dtype=ORDER[hi]), mib, context=ctx, concurrency=conc)
    assert b.needed_mib >= a.needed_mib and b.max_cached_tokens <= a.max_cached_tokens
    assert not (b.fits and not a.fits)
    ka = f.fit(shape(key, kv_dtype=ORDER[max(lo, 1)]), mib, context=ctx, concurrency=conc)
    kb = f.fit(shape(key, kv_dtype=ORDER[max(hi, 1)]), mib, context=ctx, concurrency=conc)
    assert kb.needed_mib >= ka.needed_mib and kb.max_cached_tokens <= ka.max_cached_tokens


H100_GPU = CATALOG["gpu_models"][[m["key"] for m in CATALOG["gpu_models"]].index("h100-sxm-80gb")]["memory_mib"]
H200_GPU = CATALOG["gpu_models"][[m["key"] for m in CATALOG["gpu_models"]].index("h200-sxm-141gb")]["memory_mib"]


def test_tensor_parallel_splits_weights_and_cache_and_pays_overhead_per_gpu():
    m = shape("llama-3.1-70b-instruct-fp8")
    one = f.fit(m, H100_GPU, context=8192, concurrency=16)
    two = f.fit(m, H100_GPU, context=8192, concurrency=16, tensor_parallel=2)
    assert two.tensor_parallel == 2 and two.weights_mib == pytest.approx(one.weights_mib / 2, abs=1)
    assert two.kv_per_token_bytes == one.kv_per_token_bytes // 2  # 8 KV heads: 4 per rank
    assert two.overhead_mib == one.overhead_mib  # each rank has its own process and CUDA context
    assert two.needed_mib == pytest.approx(one.weights_mib / 2 + one.overhead_mib + one.kv_mib / 2, abs=2)
    assert "per GPU (tensor parallel over 2 GPUs)" in two.reason
    # more ranks than KV heads: the heads are replicated, so the per-GPU cache stops shrinking at 1 head
    sixteen = f.kv_bytes_per_token_per_gpu(m, 16)
    assert sixteen == f.kv_bytes_per_token_per_gpu(m, 8) == one.kv_per_token_bytes // 8


def test_a_70b_fp8_model_at_8k_x_16_needs_two_h100s_or_one_h200():
    """The issue's comparison: ~66 GiB of FP8 weights and 40 GiB of BF16 cache (131,072 tokens x 320 KiB)."""
    m = shape("llama-3.1-70b-instruct-fp8")
    assert f.fit(m, H200_GPU, context=8192, concurrency=16).fits
    h100 = f.fit(m, H100_GPU, context=8192, concurrency=16)
    assert not h100.fits and h100.max_cached_tokens > 0  # the weights fit; the cache does not
    two = f.fit(m, H100_GPU, context=8192, concurrency=16, tensor_parallel=2)
    assert two.fits and two.headroom_mib > 10_000
    with pytest.raises(ValueError):
        f.fit(m, H100_GPU, tensor_parallel=0)
