import pytest
import torch
from transformers import DynamicCache

from kvlab import measure, models
from kvlab.experiments import decode
from kvlab.specs import sizing


def test_tiny_model_is_seeded_and_real():
    a = models.tiny_model("qwen2", hidden=32, heads=4, kv_heads=2, seed=3)
    b = models.tiny_model("qwen2", hidden=32, heads=4, kv_heads=2, seed=3)
    assert type(a).__name__ == "Qwen2ForCausalLM"
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not a.training


def test_tiny_model_dtype_and_device():
    model = models.tiny_model("llama", dtype=torch.bfloat16, device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(family="nope"), "unknown family"),
        (dict(family="llama", kv_heads=3), "kv_heads"),
        (dict(family="llama", layers=0), "layers"),
        (dict(family="llama", window=8), "no sliding-window"),
        (dict(family="gpt2", kv_heads=2), "multi-head attention only"),
        (dict(family="qwen3_next", layers=3, layer_types=["linear_attention"]), "1 entries for layers=3"),
        (dict(family="nemotron_h", layers=1, layer_types=["mamba"]), "nemotron_h layer types"),
        (dict(family="gpt_oss", layers=1, layer_types=["sliding_attention"]), "need a window"),
        (dict(family="qwen3_moe", window=8), "no sliding-window"),
        (
            dict(family="qwen3_next", layers=1, layer_types=["linear_attention"]),
            "at least one full_attention",
        ),
    ],
)
def test_tiny_config_rejects_bad_knobs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.tiny_config(**kwargs)


def test_load_model_from_save_pretrained_directory(tmp_path):
    model = models.tiny_model("llama", seed=1)
    model.save_pretrained(tmp_path)
    loaded = models.load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 8))
    with torch.inference_mode():
        assert torch.allclose(model(ids).logits, loaded(ids).logits)


def test_load_model_missing_path_is_clear(tmp_path):
    with pytest.raises(OSError, match="could not load model"):
        models.load_model(str(tmp_path / "missing"))


def test_equal_param_configs():
    configs = models.equal_param_configs("llama", [8, 2, 1], layers=2, hidden=128, heads=8)
    counts = [sizing.param_count(c) for c in configs]
    assert (max(counts) - min(counts)) / max(counts) < 1e-3
    assert [c.num_key_value_heads for c in configs] == [8, 2, 1]


def test_cache_inventory_lists_only_k_and_v():
    model = models.tiny_model("llama", layers=3, hidden=32, heads=4, kv_heads=2)
    with torch.inference_mode():
        cache = model(torch.randint(0, 256, (2, 5)), use_cache=True).cache
    rows = measure.cache_inventory(cache)
    assert {r.name for r in rows} == {"keys", "values"} and len(rows) == 6
    assert all(r.shape == (2, 2, 5, 8) for r in rows)


@pytest.mark.parametrize(
    "family, knobs, types",
    [
        ("gpt_oss", dict(window=4), ["sliding_attention", "full_attention", "sliding_attention"]),
        ("gpt_oss", {}, ["full_attention"] * 3),
        ("qwen3_next", {}, ["linear_attention", "linear_attention", "full_attention"]),
        ("nemotron_h", {}, ["linear_attention", "moe", "full_attention"]),
    ],
)
def test_tiny_config_default_layer_patterns(family, knobs, types):
    config = models.tiny_config(family, layers=3, **knobs)
    assert list(config.layer_types) == types and config.num_hidden_layers == 3
    # Too few layers for the whole pattern: still one full-attention layer (transformers needs one).
    assert list(models.tiny_config(family, layers=1, **knobs).layer_types) == [types[-1]]


def test_cache_inventory_and_bytes_count_state_tensors():
    # Qwen3-Next: gated-DeltaNet layers keep a conv and a recurrent state (in dicts of transformers'
    # LinearAttentionLayer) beside the full-attention layer's K and V; all of it is the cache.
    config = models.tiny_config("qwen3_next", layers=2, hidden=32, heads=4, kv_heads=2)
    model = models.tiny_model(config=config, device="cpu")
    with torch.inference_mode():
        cache = model(torch.randint(0, 256, (2, 5)), use_cache=True).cache
    rows = measure.cache_inventory(cache)
    assert [(r.layer, r.name) for r in rows] == [
        (0, "conv_states[0]"),
        (0, "recurrent_states[0]"),
        (1, "keys"),
        (1, "values"),
    ]
    assert all(r.is_state for r in rows)
    kv = 2 * 2 * 2 * 5 * 8 * 4  # K and V: batch 2, 2 KV heads, 5 tokens, head_dim 8, fp32
    assert measure.cache_tensor_bytes(cache) == sizing.kv_cache_bytes(config, 5, 2, torch.float32)
    assert measure.cache_tensor_bytes(cache) == sum(r.nbytes for r in rows) > kv


def test_sliding_window_bookkeeping_is_not_counted():
    model = models.tiny_model("gpt_oss", layers=2, hidden=32, heads=4, kv_heads=2, window=4)
    with torch.inference_mode():
        cache = model(torch.randint(0, 256, (1, 10)), use_cache=True).cache
    rows = measure.cache_inventory(cache)
    assert [r.name for r in rows if not r.is_state] == ["_sliding_window_tensor"]
    assert measure.cache_tensor_bytes(cache) == sizing.kv_cache_bytes(model.config, 10, 1, torch.float32)


def test_sliding_window_view_holds_more_storage_than_it_shows():
    model = models.tiny_model("mistral", layers=1, hidden=32, heads=4, kv_heads=2, window=4)
    with torch.inference_mode():
        cache = model(torch.randint(0, 256, (1, 10)), use_cache=True).cache
    assert measure.cache_tensor_bytes(cache) == sizing.kv_cache_bytes(model.config, 10, 1, torch.float32)
    assert measure.cache_tensor_bytes(cache, storage=True) > measure.cache_tensor_bytes(cache)


def test_memory_tracker_cpu_counts_tensors():
    with measure.MemoryTracker("cpu") as mem:
        a = torch.ones(1024, 256)  # 1 MiB
        b = torch.ones(1024, 256)
        del b
        c = a * 2  # noqa: F841
    assert mem.peak_bytes >= 2 * 1024 * 1024
    assert mem.retained_bytes == 2 * 1024 * 1024


def test_timer_and_percentiles():
    times = measure.time_call(lambda: sum(range(1000)), "cpu", repeat=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert measure.percentiles([1, 2, 3, 4, 5]) == {"p50": 3.0, "p95": 4.8, "p99": pytest.approx(4.96)}
    with pytest.raises(ValueError):
        measure.percentiles([])


def test_cached_and_uncached_decode_agree():
    model = models.tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, attn_implementation="eager")
    ids = torch.randint(0, 256, (2, 6))
    cached = decode.greedy_decode(model, ids, 5, use_cache=True)
    uncached = decode.greedy_decode(model, ids, 5, use_cache=False)
    assert cached.tokens == uncached.tokens
    reference = model.generate(ids, max_new_tokens=5, do_sample=False)[:, 6:].tolist()
    assert cached.tokens == reference
    cost = decode.step_flops(model, 16)
    assert cost.uncached_flops == 17 * cost.cached_flops


def test_greedy_decode_into_a_given_cache_never_choosing_eos_early():
    model = models.tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    model.generation_config.eos_token_id = decode.greedy_decode(model, ids, 1).tokens[0][0]
    cache = DynamicCache(config=model.config)
    result = decode.greedy_decode(model, ids, 5, cache=cache, min_new_tokens=3)
    reference = model.generate(ids, max_new_tokens=5, min_new_tokens=3, do_sample=False)[0, 7:].tolist()
    assert result.tokens == [reference] and result.cache is cache and cache.get_seq_length() == 11
    # The logits are the model's own: the masked token is still their argmax at the first step.
    assert result.logits[0, 0].argmax() == model.generation_config.eos_token_id != result.tokens[0][0]
    with pytest.raises(ValueError, match="use_cache=False"):
        decode.greedy_decode(model, ids, 2, use_cache=False, cache=DynamicCache(config=model.config))


def test_decode_top_ids_and_memory_plan(monkeypatch):
    model = models.tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, attn_implementation="eager")
    result = decode.greedy_decode(model, torch.randint(0, 256, (2, 6)), 4)
    top = result.top_token_ids(3)
    assert [[ids[0] for ids in row] for row in top] == result.tokens and all(
        len(i) == 3 for r in top for i in r
    )
    # 2 copies × 4 heads × 16385² × 4 B: about 8 GiB of eager scores, refused before anything runs
    assert decode.eager_scores_bytes(model, 16385) == 2 * 4 * 16385**2 * 4
    monkeypatch.setattr(decode, "free_memory_bytes", lambda device: 8 * 2**30)
    with pytest.raises(MemoryError, match=r"history 16384 needs about 8 GiB .* 4 heads × 16385²"):
        decode.step_flops(model, 16384)
    decode.check_uncached_step_fits(model, 4096)  # 0.5 GiB: fits
    with pytest.raises(MemoryError, match="history 16384 needs"):
        decode.greedy_decode(model, torch.zeros(1, 16380, dtype=torch.long), 6, use_cache=False)
    sdpa = models.tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, attn_implementation="sdpa")
    decode.check_uncached_step_fits(sdpa, 16384)  # fused attention holds no score matrix
    with pytest.raises(MemoryError, match="history 16384 needs"):
        decode.sweep_recompute(model, [16384])


def test_cache_growth_adds_one_token_per_step():
    model = models.tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2)
    held = measure.cache_growth(model, torch.randint(0, 256, (3, 5)), 4)
    per_token = 3 * 2 * 2 * 2 * 16 * 4  # batch × layers × (K, V) × kv_heads × head_dim × fp32
    assert held == [(n, n * per_token) for n in range(5, 10)]
    with pytest.raises(ValueError, match="steps"):
        measure.cache_growth(model, torch.zeros(1, 2, dtype=torch.long), -1)


def test_step_clock_is_the_threads_cpu_time_on_one_cpu_thread(monkeypatch):
    import time

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert measure.step_clock("cpu") is time.thread_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert measure.step_clock("cpu") is time.perf_counter
    ticks = iter([1.0, 3.5])
    with measure.Timer("cpu", clock=lambda: next(ticks)) as timer:
        pass
    assert timer.seconds == 2.5
    assert measure.time_call(lambda: None, "cpu", repeat=2, warmup=0, clock=iter([0, 1, 5, 7]).__next__) == [
        1,
        2,
    ]
