import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kvlab.costs.workloads import resident_lengths, synthetic_trace
from kvlab.engine import LLMEngine, context
from kvlab.engine.attention import ATTN_IMPLEMENTATION, enable_paged_attention, paged_attention_forward
from kvlab.engine.context import PagedContext, split_by_width
from kvlab.engine.kv_pool import KVPool, KVShape, slots_for
from kvlab.engine.metrics import measured_fragmentation, predicted_fragmentation
from kvlab.measure import MemoryTracker, expected_pool_bytes, module_kv_bytes_per_token, tensor_bytes
from kvlab.models import tiny_config, tiny_model
from kvlab.specs import arch
from kvlab.specs.sizing import kv_bytes_per_token

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def _reference(q, k, v, q_len, window=None):
    """Contiguous SDPA: the last `q_len` positions of a context attend causally to all of it."""
    ctx = k.shape[2]
    query_pos = torch.arange(ctx - q_len, ctx)[:, None]
    key_pos = torch.arange(ctx)[None, :]
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("gather_blocks", [None, 4, 0])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_contiguous_sdpa(window, gather_blocks, monkeypatch):
    """Mixed step: five decodes and two prefill chunks (one with a cached prefix), blocks scattered in the pool;
    read in one gather, in gathers of at most 4 blocks, and one sequence at a time."""
    if gather_blocks is not None:
        block_bytes = BLOCK * KV_HEADS * HEAD_DIM * 4
        monkeypatch.setattr(context, "GATHER_CHUNK_BYTES", 2 * block_bytes * gather_blocks)
    gen = torch.Generator().manual_seed(0)
    shape = KVShape(num_layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    pool = KVPool(shape, num_blocks=64, block_size=BLOCK)
    perm = torch.randperm(64, generator=gen).tolist()
    # (tokens already cached, tokens this step) per sequence; decodes longest first, as the runner orders them
    plan = [(60, 1), (0, 7), (58, 1), (5, 6), (14, 1), (9, 1), (3, 1)]
    tables, full_k, full_v = [], [], []
    for cached, new in plan:
        total = cached + new
        table = [perm.pop() for _ in range(-(-total // BLOCK))]
        tables.append(table)
        k = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=gen)
        v = torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=gen)
        full_k.append(k)
        full_v.append(v)
        if cached:  # an earlier step wrote these
            slots = torch.tensor(slots_for(table, 0, cached, BLOCK))
            pool.write(0, slots, k[0, :, :cached].transpose(0, 1), v[0, :, :cached].transpose(0, 1))
    queries = [torch.randn(1, HEADS, new, HEAD_DIM, generator=gen) for _, new in plan]
    slot_mapping = torch.tensor(
        [s for (c, n), t in zip(plan, tables, strict=True) for s in slots_for(t, c, c + n, BLOCK)]
    )
    ctx = PagedContext.build(pool, slot_mapping, [n for _, n in plan], [c + n for c, n in plan], tables)
    if gather_blocks is None:
        assert len(ctx.decodes) == 2, "long and short decodes attend in separate groups"
        assert len(ctx.gathers) == 1, "one copy per layer when everything fits"
    else:
        # Decode groups are cut into sequences whose blocks fit a gather; a part never straddles two
        assert [g.num_seqs for g in ctx.decodes] == [1] * 5
        # 4 blocks: the 3- and 1-block decodes share a gather
        expected = [16, 15, 4, 3, 1, 3] if gather_blocks == 0 else [16, 15, 4, 4, 3]
        assert [len(g) for g in ctx.gathers] == expected
    step_k = torch.cat([k[:, :, c:] for k, (c, _) in zip(full_k, plan, strict=True)], dim=2)
    step_v = torch.cat([v[:, :, c:] for v, (c, _) in zip(full_v, plan, strict=True)], dim=2)
    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=0),
        torch.cat(queries, dim=2),
        step_k,
        step_v,
        None,
        scaling=HEAD_DIM**-0.5,
        paged_context=ctx,
        sliding_window=window,
    )
    expected = torch.cat(
        [
            _reference(q, k, v, n, window)[0].transpose(0, 1)
            for q, k, v, (_, n) in zip(queries, full_k, full_v, plan, strict=True)
        ]
    )
    assert out.shape == (1, sum(n for _, n in plan), HEADS, HEAD_DIM)
    assert (out[0] - expected).abs().max().item() < 1e-5


def test_pool_write_lands_in_block_table_slots():
    pool = KVPool(KVShape(1, 1, 2), num_blocks=4, block_size=2)
    table = [3, 0]
    keys = torch.arange(6, dtype=torch.float32).reshape(3, 1, 2)
    pool.write(0, torch.tensor(slots_for(table, 0, 3, 2)), keys, -keys)
    k_pool, v_pool = pool.layer(0)
    assert torch.equal(k_pool[3], keys[:2]) and torch.equal(k_pool[0, 0], keys[2])
    assert torch.equal(v_pool[3], -keys[:2])
    assert slots_for(table, 1, 3, 2) == [7, 0]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_pool_bytes_per_token_equals_sizing(family):
    config = tiny_config(family, layers=3, hidden=64, heads=4, kv_heads=2)
    for dtype in (torch.float32, torch.bfloat16):
        assert KVPool.bytes_per_token(KVShape.from_config(config), dtype) == kv_bytes_per_token(config, dtype)


@pytest.mark.parametrize(
    "name", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B", "mistralai/Mixtral-8x7B-v0.1"]
)
def test_pool_bytes_per_token_equals_sizing_for_published_models(name):
    config = arch.get(name)
    assert KVPool.bytes_per_token(KVShape.from_config(config), torch.bfloat16) == kv_bytes_per_token(
        config, "bf16"
    )


def assert_pool_bytes_measured(model, engine_kwargs):
    """The engine's pool, measured two ways, against what the model's own K/V projections need.

    Measured: the bytes of the storage behind the pool tensor the engine allocated (`measure.tensor_bytes`), and
    what the engine's construction left allocated (`MemoryTracker`: storage accounting on CPU,
    `torch.cuda.memory_allocated` on a GPU). Expected: `measure.expected_pool_bytes`, from each attention module's
    `k_proj`/`v_proj` output sizes; neither side goes through `kvlab.specs.arch`, which shapes the pool.
    """
    device = next(model.parameters()).device
    with MemoryTracker(device) as mem:
        engine = LLMEngine(model, **engine_kwargs)
    expected = expected_pool_bytes(model, engine.block_manager.num_blocks * engine.config.block_size)
    assert tensor_bytes(engine.pool.kv) == expected
    assert engine.pool.nbytes == expected
    # The engine also keeps a one-element mask placeholder (512 B once the CUDA allocator rounds it up).
    assert 0 <= mem.retained_bytes - expected < 1024
    return engine


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_engine_pool_bytes_measured_equal_module_expectation(family):
    model = tiny_model(family, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
    engine = assert_pool_bytes_measured(model, dict(block_size=8, num_blocks=10))
    assert engine.runner.kv_bytes_per_token == kv_bytes_per_token(model.config, torch.float32)
    assert engine.pool.nbytes == 10 * 8 * 2 * 2 * (2 * 16) * 4  # layers × K,V × kv_heads × head_dim × fp32


@pytest.mark.parametrize("mutation", ["extra layer", "extra kv head"])
def test_pool_bytes_check_catches_a_pool_of_the_wrong_shape(monkeypatch, mutation):
    """Proof the check is independent: if kvlab.specs.arch reported one layer or one KV head too many, the pool (shaped
    from it) would be wrong, and the measured-vs-modules check must fail."""
    import kvlab.engine.kv_pool

    real_describe = kvlab.engine.kv_pool.describe

    def wrong(config):
        spec = real_describe(config)
        if mutation == "extra layer":
            layers = (*spec.layers, spec.layers[-1])
        else:
            layers = tuple(dataclasses.replace(layer, kv_heads=layer.kv_heads + 1) for layer in spec.layers)
        return dataclasses.replace(spec, layers=layers)

    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
    monkeypatch.setattr(kvlab.engine.kv_pool, "describe", wrong)
    with pytest.raises(AssertionError):
        assert_pool_bytes_measured(model, dict(block_size=8, num_blocks=10))


def test_module_kv_bytes_reads_projections_not_config():
    model = tiny_model("llama", layers=3, hidden=64, heads=4, kv_heads=2, vocab=256)
    assert module_kv_bytes_per_token(model) == 3 * 2 * 2 * 16 * 4
    assert module_kv_bytes_per_token(model, torch.bfloat16) == 3 * 2 * 2 * 16 * 2
    model.config.num_key_value_heads = 4  # the config can say what it likes: the modules decide
    assert module_kv_bytes_per_token(model) == 3 * 2 * 2 * 16 * 4
    with pytest.raises(ValueError, match="no attention module"):
        module_kv_bytes_per_token(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="num_tokens"):
        expected_pool_bytes(model, -1)


def test_tensor_bytes_counts_each_storage_once():
    base = torch.zeros(4, 8)
    assert tensor_bytes(base) == 128 and tensor_bytes(base[0], base[1:], base) == 128
    assert tensor_bytes(base, torch.zeros(2, dtype=torch.float64)) == 144
    with pytest.raises(TypeError, match="tensors"):
        tensor_bytes([1, 2])


def independent_fragmentation(lengths, block_size):
    """Last-block waste and table entries per sequence, from the lengths alone (no kvlab code): a sequence of n
    tokens needs (n + B - 1) // B blocks and leaves (-n) mod B slots of its last block empty."""
    waste = sum((-n) % block_size for n in lengths)
    entries = sum((n + block_size - 1) // block_size for n in lengths)
    return waste / len(lengths), entries / len(lengths)


def replay(model, trace, block_size, num_blocks=64):
    engine = LLMEngine(model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=4, clock="virtual")
    engine.replay(trace)
    return engine.step_stats


def check_fragmentation(stats, trace, block_size):
    """After each step the running sequences waste fewer than B slots each, and over the run the waste and table
    size per (sequence, step) equal the independent prediction from the trace's lengths."""
    for s in stats:
        assert s.reserved_token_slots - s.used_token_slots < block_size * max(s.num_running, 1)
    seq_steps = sum(s.num_running for s in stats)
    measured = (
        sum(s.reserved_token_slots - s.used_token_slots for s in stats) / seq_steps,
        sum(s.blocks_used for s in stats) / seq_steps,
    )
    assert measured == independent_fragmentation(resident_lengths(trace), block_size)


@pytest.fixture(scope="module")
def small_trace():
    return synthetic_trace(
        6, "alpaca", request_rate=50.0, scale=0.5, seed=5, max_input_len=24, max_output_len=12
    )


@pytest.mark.parametrize("block_size", [4, 16])
def test_fragmentation_equals_prediction_from_lengths(block_size, small_trace):
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
    stats = replay(model, small_trace, block_size, 256 // block_size)
    check_fragmentation(stats, small_trace, block_size)
    assert max(s.reserved_token_slots - s.used_token_slots for s in stats) > 0  # there is waste to predict


def test_fragmentation_check_catches_an_allocator_that_over_allocates(monkeypatch, small_trace):
    """Proof: make the allocator's block count one too many per sequence (in the helper the allocator and
    kvlab.engine.metrics share, as the audit did); kvlab.engine.metrics' own prediction still agrees, the independent one fails."""
    import kvlab.engine.block_manager
    import kvlab.engine.metrics
    import kvlab.engine.single_type_kv_cache_manager

    def one_too_many(num_tokens, block_size):
        return -(-num_tokens // block_size) + 1

    for module in (
        kvlab.engine.block_manager,
        kvlab.engine.single_type_kv_cache_manager,
        kvlab.engine.metrics,
    ):
        monkeypatch.setattr(module, "cdiv", one_too_many)
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
    stats = replay(model, small_trace, 4)
    assert measured_fragmentation(stats) == predicted_fragmentation(resident_lengths(small_trace), 4)
    with pytest.raises(AssertionError):
        check_fragmentation(stats, small_trace, 4)


def test_mla_is_rejected():
    with pytest.raises(ValueError, match="MLA"):
        KVShape.from_config(tiny_config("deepseek_v2"))


def test_paged_context_declares_decode_groups_and_prefill_chunks():
    pool = KVPool(KVShape(1, 1, 2), num_blocks=8, block_size=2)
    # decode (ctx 3), prefill from scratch (3 tokens), decode (ctx 4), chunk after 2 cached tokens (3 more)
    ctx = PagedContext.build(
        pool,
        torch.zeros(8, dtype=torch.long),
        [1, 3, 1, 3],
        [3, 3, 4, 5],
        [[1, 2], [3, 4], [5, 6], [7, 0, 2]],
    )
    assert {f.name for f in dataclasses.fields(ctx)} == {
        "pool",
        "slot_mapping",
        "block_ids",
        "decodes",
        "prefills",
        # block_ids cut into the runs a layer copies at once
        "gathers",
        "by_layer",  # one context per KV-cache group, for hybrid models (None otherwise)
    }
    assert ctx.by_layer is None
    (group,) = ctx.decodes
    assert (
        torch.equal(group.tokens, torch.tensor([0, 4]))
        and group.num_seqs == 2
        and group.blocks == slice(0, 4)
    )
    assert group.num_keys == 4 and not group.uniform
    assert [(c.start, c.query_len, c.context_len) for c in ctx.prefills] == [(1, 3, 3), (5, 3, 5)]
    assert ctx.prefills[0].blocks is None, "nothing cached: the chunk attends to the step's own K/V"
    assert ctx.block_ids.tolist() == [1, 2, 5, 6, 7, 0, 2] and ctx.prefills[1].blocks == slice(4, 7)
    assert group.mask(None, torch.device("cpu"), torch.float32).shape == (2, 1, 1, 4)
    assert ctx.prefills[0].mask(None, torch.device("cpu"), torch.float32) is None
    only_decodes = PagedContext.build(pool, torch.zeros(2, dtype=torch.long), [1, 1], [2, 2], [[1], [2]])
    assert (
        only_decodes.decodes[0].tokens == slice(0, 2)
        and only_decodes.decodes[0].mask(None, torch.device("cpu"), torch.float32) is None
    )
    assert only_decodes.prefills == []


def test_decode_groups_split_by_context_length():
    assert split_by_width([10, 10, 9]) == [3]
    assert split_by_width([40, 39, 38, 2, 2, 1]) == [3, 6], "short rows are not padded to the long ones"
    pool, slots = KVPool(KVShape(1, 1, 2), 64, 1), torch.zeros(4, dtype=torch.long)
    tables = [[0] * 40, [2] * 39, [1], [3]]
    ctx = PagedContext.build(pool, slots, [1] * 4, [40, 39, 1, 1], tables)
    assert [g.tokens for g in ctx.decodes] == [slice(0, 2), slice(2, 4)] and len(ctx.block_ids) == 80 + 2
    # The runner sorts a step once; a context built from another order would cut its groups wrong
    with pytest.raises(ValueError, match="longest block table first"):
        PagedContext.build(pool, slots, [1] * 4, [40, 1, 39, 1], [tables[0], tables[2], tables[1], tables[3]])


def every_cut_optimum(widths, group_cost):
    """The least cost of `split_by_width`'s problem, trying a cut before every row (the reference)."""
    best = [0] * (len(widths) + 1)
    for j in range(1, len(widths) + 1):
        best[j] = min(best[i] + (j - i) * widths[i] + group_cost for i in range(j))
    return best[-1]


@given(st.lists(st.integers(1, 12), max_size=24), st.integers(0, 20))
def test_split_by_width_cuts_only_where_the_width_changes_and_loses_nothing(widths, group_cost):
    widths.sort(reverse=True)
    ends = split_by_width(widths, group_cost)
    starts = [0, *ends[:-1]] if ends else []
    assert ends == sorted(set(ends)) and (ends[-1] if ends else 0) == len(widths)
    assert all(s == 0 or widths[s] != widths[s - 1] for s in starts if widths)
    cost = sum((e - s) * widths[s] + group_cost for s, e in zip(starts, ends, strict=True))
    assert cost == every_cut_optimum(widths, group_cost)


def test_pool_gather_reuses_its_workspace():
    pool = KVPool(KVShape(1, 1, 2), num_blocks=4, block_size=2)
    pool.kv.copy_(torch.arange(pool.kv.numel(), dtype=torch.float32).view_as(pool.kv))
    k, v = pool.gather(0, torch.tensor([3, 1]))
    assert torch.equal(k, pool.layer(0)[0][[3, 1]]) and torch.equal(v, pool.layer(0)[1][[3, 1]])
    workspace = pool.workspace.data_ptr()
    pool.gather(0, torch.tensor([0]))
    assert pool.workspace.data_ptr() == workspace


def test_paged_attention_is_set_once_and_plain_calls_stay_sdpa():
    """After an engine switched the model, `generate` (padded batch, sliding window) gives what SDPA gives."""
    model = tiny_model("mistral", window=4, layers=2, hidden=32, heads=2, vocab=64)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7]])
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        before_logits = model(ids, attention_mask=mask).logits
        before = model.generate(ids, **kwargs)
    enable_paged_attention(model)
    enable_paged_attention(model)  # idempotent
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    with torch.inference_mode():
        assert torch.allclose(model(ids, attention_mask=mask).logits, before_logits, atol=1e-5)
        assert torch.equal(model.generate(ids, **kwargs), before)
