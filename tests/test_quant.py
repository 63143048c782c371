"""kvlab.experiments.quant: quantizers round-trip within their error bounds, layers hold exactly the bytes they report,
generate runs with every variant, and fp8 / int8 keep the real model's greedy tokens."""

import pytest
import torch
from transformers import QuantizedCache

from kvlab import kv_format, measure, models
from kvlab.agreement import check_tokens_close, compare_tokens, generate_with_top_k
from kvlab.book.report import keeps_tokens
from kvlab.experiments import quant

# Stated in book/11_kv_quantization: fp8 and int8 caches keep at least this fraction of greedy tokens before
# the first difference, unless that difference swaps the two best tokens (a near-tie another CPU can flip).
GREEDY_AGREEMENT_THRESHOLD = 0.9


def _states(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.logspace(-1, 1, shape[-1])  # channels of unequal size


def test_int8_round_trip_within_half_a_step():
    x = _states(2, 3, 17, 64)
    codes, scale = kv_format.quantize_int8(x)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scale.dtype == torch.float16 and scale.shape == (2, 3, 17, 1)
    err = (kv_format.dequantize_int8(codes, scale, torch.float32) - x).abs()
    assert (err <= scale.float() / 2 * (1 + 1e-3) + 1e-6).all()
    assert codes.abs().max() <= 127


def test_fp8_round_trip_relative_error():
    x = _states(2, 3, 17, 64, seed=1)
    codes, scale = kv_format.quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape and scale.shape == (2, 3, 17, 1)
    err = (kv_format.dequantize_fp8(codes, scale, torch.float32) - x).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value; subnormals step by 2^-9 of the scale.
    assert (err <= x.abs() / 16 * (1 + 1e-3) + scale.float() * 2**-10 + 1e-6).all()


@pytest.mark.parametrize("bits, dim", [(4, -1), (2, -1), (2, -2)])
def test_group_quantization_within_half_a_step(bits, dim):
    x = _states(1, 2, 64, 64, seed=bits)
    codes, scale, minimum = quant.quantize_groups(x, bits, 32, dim=dim)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and int(codes.max()) <= 2**bits - 1
    expected = list(x.shape)
    expected[dim] //= 32
    assert list(scale.shape) == expected == list(minimum.shape) and scale.dtype == torch.float16
    back = quant.dequantize_groups(codes, scale, minimum, 32, torch.float32, dim=dim)
    step = scale.float().repeat_interleave(32, dim=dim)
    # Half a step, plus what storing the minimum in fp16 moves it by (relative 2^-11).
    slack = minimum.float().abs().repeat_interleave(32, dim=dim) * 2**-10
    assert ((back - x).abs() <= step / 2 * (1 + 1e-3) + slack + 1e-6).all()
    with pytest.raises(ValueError, match="must divide"):
        quant.quantize_groups(x, bits, 48, dim=dim)


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack(packed, bits), codes)


def _expected_bytes(method, layers, b, h, t, d, elem=4, g=32, r=128):
    if method in ("int8", "fp8"):
        per_tensor = b * h * t * (d + 2)
        return 2 * layers * per_tensor
    if method == "int4":
        return 2 * layers * b * h * t * (d // 2 + 2 * 2 * d // g)
    flushed = (t // r) * r
    keys = b * h * (flushed * d // 4 + 2 * 2 * (flushed // g) * d)
    values = b * h * (flushed * d // 4 + 2 * 2 * flushed * (d // g))
    residual = 2 * b * h * (t - flushed) * d * elem
    return layers * (keys + values + residual)


@pytest.mark.parametrize("method", quant.METHODS)
@pytest.mark.parametrize("steps", [[5], [130, 1, 1], [100, 60, 200]])
def test_layers_hold_exactly_the_bytes_they_report(method, steps):
    config = models.tiny_config("llama", layers=2, hidden=256, heads=4, kv_heads=2)  # head_dim 64
    cache = quant.make_cache(method, config)
    total = 0
    for i, n in enumerate(steps):
        k, v = _states(2, 2, n, 64, seed=i), _states(2, 2, n, 64, seed=100 + i)
        for layer in range(2):
            keys, values = cache.update(k, v, layer)
        total += n
        assert keys.shape == values.shape == (2, 2, total, 64) and keys.dtype == torch.float32
    assert cache.get_seq_length() == total
    assert quant.stored_bytes(cache) == _expected_bytes(method, 2, 2, 2, total, 64)
    # No tensor is a view into a larger storage: the accounted bytes are what is allocated.
    for layer in cache.layers:
        for t in layer.tensors():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_kivi_recent_tokens_stay_exact():
    config = models.tiny_config("llama", layers=1, hidden=256, heads=4, kv_heads=2)
    cache = quant.make_cache("kivi2", config, residual_length=64, group_size=32)
    k, v = _states(1, 2, 100, 64), _states(1, 2, 100, 64, seed=5)
    keys, values = cache.update(k, v, 0)
    assert torch.equal(keys[..., 64:, :], k[..., 64:, :]) and torch.equal(values[..., 64:, :], v[..., 64:, :])
    assert not torch.equal(keys[..., :64, :], k[..., :64, :])
    with pytest.raises(ValueError, match="multiple of group_size"):
        quant.make_cache("kivi2", config, residual_length=50)


def test_bad_input_is_clear():
    config = models.tiny_config("llama")
    with pytest.raises(ValueError, match="known methods: fp8, int8, int4, kivi2"):
        quant.make_cache("int3", config)
    with pytest.raises(ValueError, match="takes no option"):
        quant.make_cache("int8", config, group_size=32)
    sliding = models.tiny_config("mistral", window=8)
    with pytest.raises(ValueError, match="sliding"):
        quant.make_cache("int8", sliding, sliding="error")


@pytest.mark.parametrize("method", [*quant.METHODS, "hf-fp8"])
def test_greedy_gives_generates_tokens_with_every_variant(method):
    model = models.tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, device="cpu")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    options = {"residual_length": 32} if method == "kivi2" else {}
    first = quant.greedy(model, ids, method, 6, **options).tokens
    # The token it chose first ends a sequence from now on: greedy, as generate(min_new_tokens=...), avoids it.
    model.generation_config.eos_token_id = first[0]
    run = quant.greedy(model, ids, method, 6, **options)
    cache = quant.cache_factory(method, model, **options)()
    out = model.generate(ids, cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert run.tokens == out[0, 12:].tolist() and first[0] not in run.tokens
    assert run.seconds_per_token > 0 and run.agreement == 1
    # each step's two best ids, the chosen token first: generate's tokens agree under the near-tie rule
    assert [top[0] for top in run.top_token_ids] == run.tokens and {len(t) for t in run.top_token_ids} == {2}
    cache = quant.cache_factory(method, model, **options)()
    kw = dict(stop_at_eos=False, cache=cache, min_new_tokens=6)
    tokens, tops = generate_with_top_k(model, ids, 6, 2, **kw)
    assert check_tokens_close([run.tokens], tokens, [run.top_token_ids], tops)[0].exact


def test_sliding_layers_stay_full_precision_and_generate_works():
    model = models.tiny_model("mistral", layers=2, hidden=64, heads=4, kv_heads=2, window=8, device="cpu")
    cache = quant.make_cache("int4", model.config, group_size=16)
    out = model.generate(torch.randint(0, 256, (1, 20)), cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 24)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    with pytest.raises(ValueError, match="only full attention"):
        QuantizedCache("fp8", model.config)  # transformers' own refuses the model


def test_stored_bytes_of_transformers_caches():
    model = models.tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, device="cpu")
    ids = torch.randint(0, 256, (1, 10))
    with torch.inference_mode():
        full = model(ids, use_cache=True).cache
        hf = QuantizedCache("fp8", model.config)
        model(ids, cache=hf, use_cache=True)
    assert quant.stored_bytes(full) == 2 * 2 * 10 * 2 * 16 * 4
    # fp8 codes (1 byte each) and one fp32 scale per tensor per layer.
    assert quant.stored_bytes(hf) == 2 * 2 * (10 * 2 * 16 + 4)


def test_decode_step_memory_stored_below_full_precision():
    model = models.tiny_model("llama", layers=2, hidden=256, heads=4, kv_heads=2, device="cpu")
    ids = torch.randint(0, 256, (1, 64))
    full = quant.decode_step_memory(model, ids, None)
    int4 = quant.decode_step_memory(model, ids, "int4")
    assert full.stored_bytes == 2 * 2 * 65 * 2 * 64 * 4
    assert int4.stored_bytes == _expected_bytes("int4", 2, 1, 2, 65, 64)
    assert int4.step_peak_bytes > 0


def test_real_model_keeps_greedy_tokens_with_fp8_and_int8():
    model, tokenizer = models.real_model(device="cpu")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    runs = {
        method: generate_with_top_k(
            model, ids, 8, 2, stop_at_eos=False, min_new_tokens=8, cache=quant.cache_factory(method, model)()
        )
        for method in (None, "fp8", "int8")
    }
    (ref_tokens,), (ref_top,) = runs[None]
    for method in ("fp8", "int8"):
        (tokens,), (top,) = runs[method]
        agreement = compare_tokens(ref_tokens, tokens, ref_top, top)
        assert keeps_tokens(agreement, GREEDY_AGREEMENT_THRESHOLD), (method, agreement.describe())


def test_quantized_weights_leave_the_cache_unchanged_to_the_byte():
    model = models.tiny_model("llama", layers=2, hidden=128, heads=4, kv_heads=2, device="cpu")
    ids = torch.randint(0, 256, (2, 9))
    before = quant.weight_bytes_held(model)
    assert before == sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.inference_mode():
        full = model(ids, use_cache=True).cache
    quant.quantize_weights_int8(model)
    after = quant.weight_bytes_held(model)
    assert after < before / 2  # int8 linears (+ scales), fp32 embeddings and head
    with torch.inference_mode():
        cache = model(ids, use_cache=True).cache
    assert measure.cache_tensor_bytes(cache) == measure.cache_tensor_bytes(full) == 2 * 2 * 2 * 9 * 2 * 32 * 4


@pytest.mark.parametrize("method", ["none", "hf-fp8", *quant.METHODS])
@pytest.mark.parametrize("tokens", [150])  # kivi2: 128 quantized, 22 in the residual
def test_predicted_stored_bytes_equal_measured(method, tokens):
    model = models.tiny_model("llama", layers=2, hidden=256, heads=4, kv_heads=2, device="cpu")
    ids = torch.randint(0, 256, (1, tokens))
    cache = quant.cache_factory(None if method == "none" else method, model)()
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    assert quant.stored_bytes(cache) == quant.predicted_stored_bytes(method, model.config, tokens)
