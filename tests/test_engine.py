import logging

import pytest
import torch

from kvlab.agreement import check_tokens_close, generate_with_top_k
from kvlab.costs.workloads import synthetic_trace
from kvlab.engine import LLMEngine
from kvlab.engine.block_manager import NULL_BLOCK
from kvlab.engine.config import EngineConfig
from kvlab.engine.metrics import PrefixCacheStats, mean_kv_utilisation
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.request import SamplingParams
from kvlab.models import tiny_model

MAX_TOKENS = 12
KNOBS = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def family_model(request):
    return tiny_model(request.param, **KNOBS)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", **KNOBS)


def random_prompts(lengths, seed=0, prefix=()):
    gen = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(2, 256, (n,), generator=gen).tolist() for n in lengths]


def reference(model, prompts, max_tokens=MAX_TOKENS):
    """Greedy `model.generate`, one prompt at a time (no padding), stopping at eos like the engine."""
    outs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
        outs.append(ids[0, len(prompt) :].tolist())
    return outs


MIXED = [3, 17, 30, 9, 25]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(num_blocks=64, block_size=16),  # plenty of memory
        dict(num_blocks=12, block_size=4),  # forces preemption by recompute
        dict(num_blocks=64, block_size=4, max_num_batched_tokens=8),  # chunked prefill
        dict(num_blocks=64, block_size=8, scheduling="static", max_num_seqs=2),
    ],
    ids=["roomy", "preempt", "chunked", "static"],
)
def test_engine_equals_generate(family_model, engine_kwargs):
    prompts = random_prompts(MIXED)
    engine = LLMEngine(family_model, **engine_kwargs)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outputs] == reference(family_model, prompts)
    if engine_kwargs.get("num_blocks") == 12:
        assert engine.scheduler.num_preemptions > 0
    assert (
        engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        and engine.block_manager.num_used_blocks == 0
    )


@pytest.mark.parametrize(
    "engine_kwargs", [dict(num_blocks=64), dict(num_blocks=12, block_size=4)], ids=["roomy", "preempt"]
)
def test_engine_top_token_ids_equal_generate(llama, engine_kwargs):
    """`SamplingParams(logprobs=k)`: per generated token, the k best ids, the chosen one first; the same lists as
    transformers' logits give (kept across preemption by recompute)."""
    prompts = random_prompts(MIXED)
    engine = LLMEngine(llama, **engine_kwargs)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, logprobs=3))
    if engine_kwargs["num_blocks"] == 12:
        assert engine.scheduler.num_preemptions > 0
    hf = [generate_with_top_k(llama, torch.tensor([p]), MAX_TOKENS, 3) for p in prompts]
    hf_tokens, hf_top = [t[0] for t, _ in hf], [top[0] for _, top in hf]
    for out, tokens, top in zip(outputs, hf_tokens, hf_top, strict=True):
        assert out.token_ids == tokens and out.top_token_ids == top
        assert all(
            len(ids) == 3 and ids[0] == t for ids, t in zip(out.top_token_ids, out.token_ids, strict=True)
        )
    results = check_tokens_close(
        [o.token_ids for o in outputs], hf_tokens, [o.top_token_ids for o in outputs], hf_top
    )
    assert all(r.exact for r in results)
    # Without logprobs nothing is kept; a bad count gets a clear error.
    (plain,) = engine.generate(prompts[:1], SamplingParams(max_tokens=2))
    assert plain.top_token_ids is None
    with pytest.raises(ValueError, match="logprobs must be None or an int >= 1"):
        SamplingParams(logprobs=0)


@pytest.mark.parametrize("num_blocks", [64, 16], ids=["roomy", "preempt"])
def test_prefix_caching_keeps_outputs_and_hits(llama, num_blocks):
    system = random_prompts([20], seed=1)[0]
    prompts = random_prompts([5, 9, 3, 12, 5], seed=2, prefix=system)
    expected = reference(llama, prompts)
    runs = {}
    for caching in (False, True):
        engine = LLMEngine(llama, block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching)
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
        runs[caching] = engine
        assert [o.token_ids for o in outputs] == expected
    stats = runs[True].block_manager.prefix_cache_stats
    assert stats.hits >= 4 * 20 // 4 * 4  # every request after the first reuses the system prompt
    assert stats.hit_requests >= 4 and 0 < stats.hit_rate < 1 and stats.request_hit_rate >= 0.8
    assert runs[False].block_manager.prefix_cache_stats == PrefixCacheStats()
    assert (
        runs[True].block_manager.num_free_blocks == runs[True].block_manager.num_blocks
        and runs[True].block_manager.num_cached_blocks > 0
    )
    assert stats.requests == len(prompts), "each request is looked up once, re-admissions are not counted"
    if num_blocks == 16:
        assert runs[True].scheduler.num_preemptions > 0


def test_sliding_window_mistral_equals_generate():
    model = tiny_model("mistral", window=6, **KNOBS)
    prompts = random_prompts([4, 15, 9])
    engine = LLMEngine(model, block_size=4, num_blocks=32)
    assert [
        o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    ] == reference(model, prompts)


def test_contiguous_baseline_same_tokens_lower_utilisation(llama):
    trace = synthetic_trace(
        12, "alpaca", request_rate=50.0, scale=0.5, seed=3, max_input_len=40, max_output_len=24
    )
    utilisation = {}
    for layout in ("paged", "contiguous"):
        engine = LLMEngine(
            llama, block_size=4, num_blocks=96, max_model_len=96, kv_layout=layout, clock="virtual"
        )
        outputs = engine.replay(trace)
        assert [len(o.token_ids) for o in outputs] == [r.max_tokens for r in trace]
        utilisation[layout] = mean_kv_utilisation(engine.step_stats)
        if (
            layout == "contiguous"
        ):  # every running request holds a whole max_model_len reservation: 96 / 4 blocks
            assert all(s.blocks_used == 24 * s.num_running for s in engine.step_stats)
    assert utilisation["paged"] > 0.7 > utilisation["contiguous"]


def test_request_that_never_fits_errors_without_blocking_others(llama):
    engine = LLMEngine(llama, block_size=4, num_blocks=8)  # 32 tokens in all
    prompts = random_prompts([5, 40, 6])
    outputs = engine.generate(prompts, SamplingParams(max_tokens=4))
    assert outputs[1].finish_reason == "error" and "does not fit" in outputs[1].error
    assert outputs[1].token_ids == []
    assert [len(outputs[i].token_ids) for i in (0, 2)] == [4, 4]


def test_generation_stops_at_max_model_len(llama):
    engine = LLMEngine(llama, block_size=4, num_blocks=8, max_model_len=12)
    (out,) = engine.generate(random_prompts([10]), SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


def test_virtual_clock_replay_is_deterministic_and_records_steps(llama):
    trace = synthetic_trace(
        10, "alpaca", request_rate=20.0, scale=0.5, seed=4, max_input_len=30, max_output_len=20
    )

    def run():
        engine = LLMEngine(llama, block_size=4, num_blocks=40, max_num_seqs=4, clock="virtual")
        return engine, engine.replay(trace)

    (engine, first), (_, second) = run(), run()
    timeline = [(o.metrics.first_token_time, o.metrics.finish_time, o.metrics.token_times) for o in first]
    assert timeline == [
        (o.metrics.first_token_time, o.metrics.finish_time, o.metrics.token_times) for o in second
    ]
    for out, req in zip(first, trace, strict=True):
        m = out.metrics
        assert m.arrival_time == pytest.approx(req.arrival_time)
        assert m.arrival_time <= m.first_scheduled_time < m.first_token_time <= m.finish_time
        assert len(m.itls) == len(out.token_ids) - 1 and m.ttft > 0
    stats = engine.step_stats
    assert max(s.num_running for s in stats) <= 4
    assert all(s.used_token_slots <= s.reserved_token_slots for s in stats)
    assert [s.time for s in stats] == sorted(s.time for s in stats)


def test_add_request_and_step_with_wall_clock(llama):
    engine = LLMEngine(llama, block_size=4, num_blocks=32)
    first = engine.add_request(random_prompts([6])[0], SamplingParams(max_tokens=3), request_id="a")
    engine.step()
    engine.add_request(random_prompts([4], seed=5)[0], SamplingParams(max_tokens=2), request_id="b")
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert sorted(o.request_id for o in finished) == ["a", "b"]
    assert first.is_finished and first.metrics.ttft > 0


def test_sampling_with_temperature_is_seeded(llama):
    engine = LLMEngine(llama, block_size=4, num_blocks=32)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    a, b = (engine.generate(random_prompts([5]), params)[0].token_ids for _ in range(2))
    assert a == b and len(a) == 8


def test_num_blocks_from_memory_budget_logs_capacity(llama, caplog):
    with (
        caplog.at_level(logging.INFO, logger="kvlab.engine"),
        caplog.at_level(logging.INFO, "kvlab.engine.model_runner"),
    ):
        engine = LLMEngine(llama, block_size=16, memory_budget_bytes=8 * 2**20, max_num_batched_tokens=64)
    weights = sum(p.numel() * p.element_size() for p in llama.parameters())
    kv = engine.pool.nbytes
    assert 0 < kv < 8 * 2**20 - weights
    assert "Maximum concurrency" in caplog.text and f"{engine.block_manager.num_blocks} blocks" in caplog.text
    with pytest.raises(ValueError, match="no room"):
        LLMEngine(llama, memory_budget_bytes=weights)


def test_measured_fragmentation_equals_prediction_and_occupancy(llama):
    from kvlab.costs.workloads import resident_lengths
    from kvlab.engine.metrics import mean_batch_occupancy, measured_fragmentation, predicted_fragmentation

    trace = synthetic_trace(
        10, "alpaca", request_rate=50.0, scale=0.5, seed=5, max_input_len=30, max_output_len=20
    )
    for num_blocks in (64, 12):  # roomy, and short enough to preempt
        engine = LLMEngine(llama, block_size=4, num_blocks=num_blocks, max_num_seqs=4, clock="virtual")
        engine.replay(trace)
        # The prediction from the lengths alone, not through the allocator's own cdiv.
        lengths = resident_lengths(trace)
        expected = predicted_fragmentation(lengths, 4)
        assert expected.last_block_waste == sum((-n) % 4 for n in lengths) / len(lengths)
        assert expected.table_entries == sum((n + 3) // 4 for n in lengths) / len(lengths)
        assert measured_fragmentation(engine.step_stats) == expected
        occupancy = mean_batch_occupancy(engine.step_stats)
        assert 0 < occupancy <= 4
    assert engine.scheduler.num_preemptions > 0
    assert mean_batch_occupancy([]) == 0.0
    with pytest.raises(ValueError):
        measured_fragmentation([])


def test_prefix_hits_equal_prediction_on_a_shared_prefix_trace(llama):
    from kvlab.costs.workloads import predicted_prefix_hit_tokens

    trace = synthetic_trace(
        8, "alpaca", request_rate=50.0, seed=6, shared_prefix_len=10, shared_prefix_fraction=0.6,
        max_input_len=20, max_output_len=6,
    )  # fmt: skip
    engine = LLMEngine(llama, block_size=4, num_blocks=128, enable_prefix_caching=True, clock="virtual")
    engine.replay(trace)
    assert engine.block_manager.prefix_cache_stats.hits == predicted_prefix_hit_tokens(trace, 10, 4) > 0


def test_engine_config_equals_keywords(llama):
    knobs = dict(
        block_size=4, num_blocks=12, max_num_seqs=3, max_num_batched_tokens=8, scheduling="continuous"
    )
    prompts = random_prompts(MIXED)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    by_keywords = LLMEngine(llama, **knobs, clock="virtual")
    by_config = LLMEngine(llama, EngineConfig(**knobs), clock="virtual")
    assert by_keywords.config == by_config.config == EngineConfig(**knobs)
    outputs = [engine.generate(prompts, params) for engine in (by_keywords, by_config)]
    assert [o.token_ids for o in outputs[0]] == [o.token_ids for o in outputs[1]]
    assert by_keywords.step_stats == by_config.step_stats and by_keywords.scheduler.num_preemptions > 0
    overridden = LLMEngine(llama, EngineConfig(**knobs), num_blocks=20)
    assert overridden.block_manager.num_blocks == 20 and overridden.config.block_size == 4
    with pytest.raises(TypeError):
        LLMEngine(llama, num_block=20)  # a misspelt knob is an error, not ignored
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(kv_layout="contiguous", enable_prefix_caching=True)


def test_model_runner_owns_pool_and_profiles_blocks(llama):
    runner = ModelRunner(llama, EngineConfig(block_size=8, num_blocks=10))
    assert runner.pool.num_blocks == 10 and runner.pool.nbytes == 10 * 8 * runner.kv_bytes_per_token
    weights = sum(p.numel() * p.element_size() for p in llama.parameters())
    per_block = 8 * runner.kv_bytes_per_token
    blocks = runner.profile_num_blocks(weights + 100 * per_block, 64)
    assert 0 < blocks < 100, "the profiled activation takes its share of the budget"
    engine = LLMEngine(
        llama, block_size=8, memory_budget_bytes=weights + 100 * per_block, max_num_batched_tokens=64
    )
    assert engine.block_manager.num_blocks == blocks


def fake_cuda(monkeypatch, free, total, reserved, context):
    """torch.cuda's memory readings as a GPU shared with other processes would give them."""
    from kvlab.engine import model_runner

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(model_runner, "cuda_context_bytes", lambda device=None: context)


def test_cuda_sizing_refuses_when_other_processes_hold_the_gpu(llama, monkeypatch):
    """Two engines sized from memory on one GPU: the second finds the first's 92 % taken and says what to give
    instead, rather than sizing a pool the device cannot hold."""
    from kvlab.engine.model_runner import GPU_MEMORY_UTILIZATION, cuda_capacity

    gib, cuda = 2**30, torch.device("cuda:0")
    # alone on an 80 GiB GPU: 2 GiB of weights in PyTorch's cache, a 0.5 GiB context
    fake_cuda(monkeypatch, free=int(77.5 * gib), total=80 * gib, reserved=2 * gib, context=gib // 2)
    assert cuda_capacity(cuda) == (80 * gib, GPU_MEMORY_UTILIZATION, gib // 2)
    # another process holds 74 GiB: what is left cannot hold 92 % of the device
    fake_cuda(monkeypatch, free=int(3.5 * gib), total=80 * gib, reserved=2 * gib, context=int(74.5 * gib))
    with pytest.raises(ValueError, match="give the engine num_blocks or memory_budget_bytes"):
        cuda_capacity(cuda)
    # the runner refuses before it profiles anything on the device
    runner = ModelRunner(llama, EngineConfig(block_size=8, num_blocks=10))
    runner.device = cuda
    with pytest.raises(ValueError, match=r"^cuda:0: 3\.5 GiB free of 80 GiB, .*num_blocks"):
        runner.profile_num_blocks(None, 64)


def test_the_parts_report_blocks_and_preemptions(llama):
    engine = LLMEngine(llama, block_size=4, num_blocks=12, enable_prefix_caching=True)
    bm = engine.block_manager
    assert (bm.num_blocks, bm.num_free_blocks, bm.num_used_blocks, engine.scheduler.num_preemptions) == (
        12,
        12,
        0,
        0,
    )
    assert engine.pool.nbytes == 12 * 4 * engine.runner.kv_bytes_per_token
    engine.add_request(random_prompts([9])[0], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.block_manager.num_used_blocks == 3 and engine.block_manager.num_cached_blocks == 2
    assert engine.block_manager.prefix_cache_stats == PrefixCacheStats(
        requests=1, queries=9, hits=0, hit_requests=0
    )


# --- issue 15: the engine behaves like vLLM v1 -------------------------------------------------------------------


def _peak_by_step(engine, prompts, params):
    """Blocks in use after each step, stepping by hand."""
    seqs = [engine.add_request(p, params) for p in prompts]
    peak = []
    while not all(s.is_finished for s in seqs):
        engine.step()
        peak.append(engine.block_manager.num_used_blocks)
    return seqs, peak


@pytest.mark.parametrize("caching", [False, True])
def test_sliding_window_frees_blocks_behind_the_window(caching):
    window, bs, chunk = 8, 4, 4
    model = tiny_model("mistral", window=window, **KNOBS)
    prompt = random_prompts([6])[0]
    params = SamplingParams(max_tokens=40)
    engine = LLMEngine(
        model, block_size=bs, num_blocks=64, max_num_batched_tokens=chunk, enable_prefix_caching=caching
    )
    seqs, used = _peak_by_step(engine, [prompt], params)
    assert seqs[0].num_tokens > 8 * bs, "without freeing the sequence would hold 9 blocks or more"
    # The window's blocks (the window - 1 earlier tokens) plus the block being written, computed by hand:
    window_blocks = -(-(window - 1) // bs)
    assert max(used) == window_blocks + 1 == 3
    assert seqs[0].output_token_ids == reference(model, [prompt], 40)[0]
    # A pool of exactly the window's bound (cdiv(window - 1 + chunk, bs) + 1 blocks) serves it without preemption.
    small = LLMEngine(model, block_size=bs, num_blocks=4, max_num_batched_tokens=chunk)
    out = small.generate([prompt], params)
    assert out[0].token_ids == seqs[0].output_token_ids and small.scheduler.num_preemptions == 0
    assert small.max_model_len == model.config.max_position_embeddings


def test_hybrid_model_keeps_one_block_table_per_group():
    window, bs = 8, 4
    model = tiny_model("gemma3_text", window=window, **{**KNOBS, "layers": 6})
    prompts = random_prompts([30, 5, 22])
    expected = reference(model, prompts)
    for knobs in (dict(num_blocks=128), dict(num_blocks=60, max_num_seqs=3)):  # roomy, preempting
        engine = LLMEngine(model, block_size=bs, max_num_batched_tokens=16, **knobs)
        groups = engine.runner.groups
        # Gemma 3: five sliding layers to one full; groups of one layer each, full first (vLLM's grouping).
        assert [g.window for g in groups] == [None] + [window] * 5
        assert sorted(layer for g in groups for layer in g.layers) == list(range(6))
        assert engine.pool.kv.shape[0] == 1, "a block spans one group's layers"
        seqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
        bound = -(-(window - 1 + 16) // bs) + 1  # vLLM's SlidingWindowSpec bound, chunk of 16 tokens
        freed = 0
        while not all(s.is_finished for s in seqs):
            engine.step()
            for s in engine.scheduler.running:
                tables = engine.block_manager.get_block_ids(s.request_id)
                full, *sliding = tables
                assert len(tables) == 6 and NULL_BLOCK not in full
                assert all(len(t) == len(full) for t in sliding), "tables stay aligned by position"
                held = [sum(b != NULL_BLOCK for b in t) for t in sliding]
                assert max(held) <= bound
                freed = max(freed, len(full) - min(held))
        assert [s.output_token_ids for s in seqs] == expected
        assert freed >= 3, "sliding groups dropped blocks the full group still holds"
        assert not any(m.req_to_blocks for m in engine.block_manager.managers)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.num_preemptions > 0


def test_different_cache_salts_share_nothing(llama):
    system = random_prompts([24], seed=3)[0]
    engine = LLMEngine(llama, block_size=4, num_blocks=64)  # prefix caching is on by default
    assert engine.config.enable_prefix_caching
    params = SamplingParams(max_tokens=4)
    first = engine.generate([{"prompt_token_ids": system + [5], "cache_salt": "tenant-a"}], params)
    other = engine.generate([{"prompt_token_ids": system + [6], "cache_salt": "tenant-b"}], params)
    assert engine.block_manager.prefix_cache_stats.hits == 0, (
        "a different salt finds none of tenant-a's blocks"
    )
    same = engine.generate([{"prompt_token_ids": system + [7], "cache_salt": "tenant-a"}], params)
    assert engine.block_manager.prefix_cache_stats.hits == 24 and same[0].metrics.num_cached_tokens == 24
    assert [o[0].token_ids for o in (first, other, same)] == reference(
        llama, [system + [5], system + [6], system + [7]], 4
    )
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request({"tokens": [1, 2]})
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request({"prompt_token_ids": [1, 2], "cache_salt": 3})


def test_preemption_recomputes_less_with_prefix_caching(llama):
    prompts = random_prompts([20, 24, 18, 22], seed=4)
    expected = reference(llama, prompts, 16)
    recomputed = {}
    for caching in (False, True):
        engine = LLMEngine(llama, block_size=4, num_blocks=20, enable_prefix_caching=caching)
        out = engine.generate(prompts, SamplingParams(max_tokens=16))
        assert [o.token_ids for o in out] == expected
        assert engine.scheduler.num_preemptions > 0
        recomputed[caching] = engine.block_manager.num_recomputed_tokens
    assert 0 < recomputed[True] < recomputed[False]


def test_defaults_follow_vllm_and_config_is_logged(llama, caplog):
    with caplog.at_level(logging.INFO, logger="kvlab.engine"):
        engine = LLMEngine(llama, block_size=4, num_blocks=16)
    assert engine.config.enable_prefix_caching and engine.config.enable_chunked_prefill
    assert not EngineConfig(kv_layout="contiguous").enable_prefix_caching
    assert "effective configuration" in caplog.text and "scheduler_reserve_full_isl" in caplog.text
    assert "True (vllm/config/cache.py)" in engine.config_table()
    # Full-prompt admission: a 40-token prompt whose first 8-token chunk fits, but not the whole prompt.
    for reserve, admitted in ((False, True), (True, False)):
        engine = LLMEngine(
            llama, block_size=4, num_blocks=16, max_num_batched_tokens=8, scheduler_reserve_full_isl=reserve
        )
        engine.add_request(random_prompts([30])[0], SamplingParams(max_tokens=40, ignore_eos=True))
        for _ in range(5):
            engine.step()
        late = engine.add_request(random_prompts([40], seed=9)[0], SamplingParams(max_tokens=2))
        engine.step()
        assert (late.num_computed_tokens > 0) is admitted


def test_pool_sized_by_memory_budget(llama, caplog):
    from kvlab.costs.budget import MemoryBudget

    weights = sum(p.numel() * p.element_size() for p in llama.parameters())
    with caplog.at_level(logging.INFO, logger="kvlab.engine.model_runner"):
        engine = LLMEngine(
            llama, block_size=8, memory_budget_bytes=weights + 2**20, max_num_batched_tokens=64
        )
    budget = engine.runner.memory_budget
    assert isinstance(budget, MemoryBudget) and budget.num_blocks == engine.block_manager.num_blocks
    assert (budget.capacity_bytes, budget.gpu_memory_utilization, budget.runtime_bytes) == (
        weights + 2**20,
        1.0,
        0,
    )
    buffers = sum(b.numel() * b.element_size() for b in llama.buffers())  # rotary tables count as weights
    assert budget.weight_bytes == weights + buffers and budget.activation_bytes > 0
    assert engine.pool.nbytes == budget.kv_pool_bytes
    assert "= KV pool" in caplog.text and "measured (profiled 64-token forward)" in caplog.text
