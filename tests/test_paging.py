from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kvlab.arch import get_config
from kvlab.engine import LLMEngine
from kvlab.models import tiny_config, tiny_model
from kvlab.paging import (
    ATTN_IMPLEMENTATION,
    KVPool,
    KVShape,
    PagedContext,
    paged_attention_forward,
    slots_for,
    use_paged_attention,
)
from kvlab.sizing import kv_bytes_per_token

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


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_contiguous_sdpa(window):
    """Mixed step: two decodes and two prefill chunks (one with a cached prefix), blocks scattered in the pool."""
    gen = torch.Generator().manual_seed(0)
    shape = KVShape(num_layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    pool = KVPool(shape, num_blocks=32, block_size=BLOCK)
    perm = torch.randperm(32, generator=gen).tolist()
    # (tokens already cached, tokens this step) per sequence
    plan = [(9, 1), (0, 7), (5, 6), (14, 1)]
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
    ctx = PagedContext(pool, slot_mapping, [n for _, n in plan], [c + n for c, n in plan], tables)
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
    config = get_config(name)
    assert KVPool.bytes_per_token(KVShape.from_config(config), torch.bfloat16) == kv_bytes_per_token(
        config, "bf16"
    )


def test_engine_pool_memory_is_blocks_times_sizing():
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
    engine = LLMEngine(model, block_size=8, num_blocks=10)
    per_token = kv_bytes_per_token(model.config, torch.float32)
    assert engine.kv_bytes_per_token == per_token
    assert engine.pool.nbytes == 10 * 8 * per_token


def test_mla_is_rejected():
    with pytest.raises(ValueError, match="MLA"):
        KVShape.from_config(tiny_config("deepseek_v2"))


def test_use_paged_attention_restores_implementation():
    model = tiny_model("llama", layers=1, hidden=32, heads=2, vocab=64)
    before = model.config._attn_implementation
    with use_paged_attention(model):
        assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="PagedContext"), use_paged_attention(model):
        model(torch.tensor([[1, 2, 3]]), use_cache=False)
