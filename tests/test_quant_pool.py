"""The engine's paged pool in 8 bits (`EngineConfig(kv_cache_dtype="fp8" | "int8")`): bytes exact, scales
included; about 2x the blocks of a bf16 pool at the same budget; writes round-trip within the quantizers' bounds;
and on the real model greedy outputs stay close to the unquantized engine's."""

import pytest
import torch

from kvlab import kv_format, measure, models
from kvlab.agreement import compare_tokens
from kvlab.book.report import keeps_tokens
from kvlab.engine import LLMEngine
from kvlab.engine.config import EngineConfig
from kvlab.engine.kv_pool import KVPool, KVShape
from kvlab.engine.request import SamplingParams

# Stated in book/11_kv_quantization: greedy outputs of the fp8 and int8 engine pools against the unquantized
# pool, over the prompts below: every first difference is a near-tie (each side's token in the other's top 5),
# and each answer keeps at least this fraction of its tokens before it, unless it swaps the two best tokens.
POOL_AGREEMENT_THRESHOLD = 0.5
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Who wrote Romeo and Juliet?",
]


def _tiny(family="llama"):
    return models.tiny_model(family, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quantized_pool_bytes_are_exact(family, kv_cache_dtype):
    model = _tiny(family)
    engine = LLMEngine(model, block_size=8, num_blocks=10, kv_cache_dtype=kv_cache_dtype)
    slots = engine.block_manager.num_blocks * engine.config.block_size
    expected = measure.expected_pool_bytes(model, slots, kv_cache_dtype=kv_cache_dtype)
    # Measured from the tensors the pool allocated (codes and scales), against the modules' K/V widths.
    assert measure.tensor_bytes(*engine.pool.tensors()) == engine.pool.nbytes == expected
    assert engine.runner.kv_bytes_per_token * slots == expected
    # 1 byte per element plus one fp16 scale per token and head: 2 layers x K,V x 2 heads x (16 + 2) bytes.
    assert engine.runner.kv_bytes_per_token == 2 * 2 * 2 * (16 + 2)
    assert engine.pool.kv.element_size() == 1 and engine.pool.scales is not None
    assert engine.pool.scales.dtype == torch.float16


def test_same_budget_gives_about_twice_the_blocks_of_bf16():
    model = _tiny().to(torch.bfloat16)
    budget = 64 * 2**20
    blocks = {
        d: LLMEngine(model, memory_budget_bytes=budget, kv_cache_dtype=d).block_manager.num_blocks
        for d in ("auto", "fp8")
    }
    shape = KVShape.from_config(model.config)
    ratio = KVPool.bytes_per_token(shape, torch.bfloat16) / KVPool.bytes_per_token(
        shape, torch.bfloat16, "fp8"
    )
    assert ratio == 2 * 16 / (16 + 2)  # head_dim 16: the scale costs 2 bytes per 16
    assert blocks["fp8"] / blocks["auto"] == pytest.approx(ratio, rel=0.01)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_pool_write_then_gather_round_trips(kv_cache_dtype):
    shape = KVShape(num_layers=2, kv_heads=2, head_dim=16)
    pool = KVPool(shape, num_blocks=4, block_size=4, kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 6, 2, 16, generator=g)
    slots = torch.tensor([5, 6, 7, 8, 9, 0])
    pool.write(1, slots, k, v)
    kb, vb = pool.gather(1, torch.tensor([1, 2, 0]))
    got_k = kb.flatten(0, 1)[[1, 2, 3, 4, 5, 8]]  # slots 5..9 sit in blocks 1, 2; slot 0 in block 0
    got_v = vb.flatten(0, 1)[[1, 2, 3, 4, 5, 8]]
    quantize = kv_format.quantize_int8 if kv_cache_dtype == "int8" else kv_format.quantize_fp8
    dequantize = kv_format.dequantize_int8 if kv_cache_dtype == "int8" else kv_format.dequantize_fp8
    for got, x in ((got_k, k), (got_v, v)):
        assert got.dtype == torch.float32
        assert torch.equal(got, dequantize(*quantize(x), torch.float32))  # exactly the quantizer's round trip
        assert (got - x).abs().max() <= x.abs().max() / 16
    assert kb.flatten(0, 1)[0].abs().sum() == 0  # layer 1 only: nothing else written
    assert pool.layer(0)[0].view(torch.uint8).sum() == 0


@pytest.mark.parametrize("bad", ["fp4", "float16", "", "FP8"])
def test_bad_kv_cache_dtype_raises_a_clear_error(bad):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype.*known: auto, fp8, fp8_e4m3, int8"):
        EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        LLMEngine(_tiny(), num_blocks=4, kv_cache_dtype=bad)


def test_fp8_e4m3_is_an_alias_of_fp8():
    assert kv_format.pool_format("fp8_e4m3") == kv_format.pool_format("fp8")


@pytest.fixture(scope="module")
def real_outputs():
    model, tokenizer = models.real_model(device="cpu")
    prompts = [
        list(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
                "input_ids"
            ]
        )
        for q in QUESTIONS
    ]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=5)
    return {
        d: LLMEngine(model, block_size=16, num_blocks=48, kv_cache_dtype=d).generate(prompts, params)
        for d in ("auto", "fp8", "int8")
    }


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_real_model_greedy_outputs_close_to_unquantized_pool(real_outputs, kv_cache_dtype):
    for ref, out in zip(real_outputs["auto"], real_outputs[kv_cache_dtype], strict=True):
        agreement = compare_tokens(ref.token_ids, out.token_ids, ref.top_token_ids, out.top_token_ids)
        assert agreement.close, agreement.describe()
        top2 = [[t[:2] for t in ref.top_token_ids], [t[:2] for t in out.top_token_ids]]
        swap = compare_tokens(ref.token_ids, out.token_ids, *top2)
        assert keeps_tokens(swap, POOL_AGREEMENT_THRESHOLD), swap.describe()
