"""kvlab.specs.sizing must equal, to the byte, what a transformers 5.24 DynamicCache holds."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab import measure, models
from kvlab.specs import arch, sizing


def _forward_cache_bytes(config, seq_len: int, batch: int, dtype=torch.float32) -> int:
    model = models.tiny_model(config=config, dtype=dtype, device="cpu")
    ids = torch.randint(0, config.get_text_config().vocab_size, (batch, seq_len))
    with torch.inference_mode():
        return measure.cache_tensor_bytes(model(ids, use_cache=True).cache)


@st.composite
def tiny_configs(draw, family):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv_heads = (
        heads
        if family in ("opt", "gpt2")
        else draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0]))
    )
    head_dim = draw(st.sampled_from([4, 8, 16]))
    knobs = dict(layers=draw(st.integers(1, 4)), heads=heads, kv_heads=kv_heads, vocab=64)
    if family in models._HEAD_DIM_FAMILIES or family.startswith("deepseek"):
        knobs.update(hidden=heads * 8, head_dim=head_dim)
    else:
        knobs["hidden"] = heads * head_dim
    if family in models._SLIDING_FAMILIES and draw(st.booleans()):
        knobs["window"] = draw(st.integers(2, 24))
    if family == "gemma3_text":
        knobs["sliding_window_pattern"] = draw(st.integers(1, 4))
    if family.startswith("deepseek"):
        knobs.update(latent=draw(st.sampled_from([4, 8, 16])), rope_dim=draw(st.sampled_from([2, 4, 8])))
    return models.tiny_config(family, **knobs)


@pytest.mark.parametrize("family", models.FAMILIES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_predicted_equals_cache_bytes(family, data):
    config = data.draw(tiny_configs(family))
    seq_len = data.draw(st.integers(1, 40))
    batch = data.draw(st.integers(1, 3))
    assert _forward_cache_bytes(config, seq_len, batch) == sizing.kv_cache_bytes(
        config, seq_len, batch, torch.float32
    )


@pytest.mark.parametrize("name", arch.registry())
def test_every_registry_model_scaled_down_matches(name):
    config = models.scaled_down(name, window=8)
    spec_full, spec_tiny = arch.describe(name), arch.describe(config)
    assert spec_full.attention_type == spec_tiny.attention_type
    assert set(spec_full.kinds) == set(spec_tiny.kinds)
    full_types = getattr(arch.get(name).get_text_config(decoder=True), "layer_types", None)
    if config.model_type in models._PATTERN_FAMILIES:
        # Every layer type of the real model (Nemotron-H: Mamba-2, attention, MLP or MoE), in its order.
        assert set(config.layer_types) == set(full_types)
    for seq_len in (1, 7, 8, 9, 30):
        assert _forward_cache_bytes(config, seq_len, 2) == sizing.kv_cache_bytes(
            config, seq_len, 2, torch.float32
        )


# The scaled-down layer patterns of the families that list their layer types, shortened to 6 layers.
S, F, M, N, E = "sliding_attention", "full_attention", "linear_attention", "mlp", "moe"
SCALED_PATTERNS = {
    "openai/gpt-oss-20b": [S, F, S, F, S, F],
    "openai/gpt-oss-120b": [S, F, S, F, S, F],
    "Qwen/Qwen3-Next-80B-A3B-Thinking": [M, M, M, F, M, M],
    # M-M-M-M*-...: its first attention layer is the 8th; the 6 keep it, after the first five.
    "nvidia/Nemotron-H-56B-Base-8K": [M, N, M, N, M, F],
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": [M, E, M, E, M, F],
}


@pytest.mark.parametrize("name", SCALED_PATTERNS)
def test_scaled_down_keeps_the_layer_pattern(name):
    config = models.scaled_down(name)
    assert list(config.layer_types) == SCALED_PATTERNS[name]
    assert config.num_hidden_layers == 6
    if config.model_type == "gpt_oss":
        assert config.sliding_window == 16


def test_shorten_pattern_keeps_every_type_in_order():
    assert models.shorten_pattern(["a", "b", "a", "b", "c", "a"], 4) == ["a", "b", "a", "c"]
    assert models.shorten_pattern(["a", "a", "a", "b"], 2) == ["a", "b"]
    # Fewer layers than types: the earliest types.
    assert models.shorten_pattern(["a", "b", "c"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="positive"):
        models.shorten_pattern(["a"], 0)
    with pytest.raises(ValueError, match="3 layer types; pass layers >= 3"):
        models.scaled_down("nvidia/Nemotron-H-56B-Base-8K", layers=2)


def test_chapter_2_lab_parity_for_every_registry_model():
    # book/02_sizing/lab.ipynb with its CPU defaults: a scaled-down model of every registry model, seeded ids,
    # the cache after a prefill measured (K/V and state tensors) and predicted to the byte.
    seq_lens, window, batch, seed = [1, 7, 15, 16, 17, 40, 96], 16, 2, 0
    mismatches = []
    for name in arch.registry():
        config = models.scaled_down(name, window=window)
        model = models.tiny_model(config=config, seed=seed, device="cpu")
        for seq_len in seq_lens:
            generator = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
            with torch.inference_mode():
                cache = model(ids, use_cache=True).cache
            predicted = sizing.kv_cache_bytes(config, seq_len, batch, torch.float32)
            measured = measure.cache_tensor_bytes(cache)
            if predicted != measured:
                mismatches.append((name, seq_len, predicted, measured))
    assert not mismatches, mismatches


def test_bf16_cache_matches_too():
    config = models.tiny_config("mistral", layers=2, hidden=32, heads=4, kv_heads=2, window=5)
    assert _forward_cache_bytes(config, 9, 2, torch.bfloat16) == sizing.kv_cache_bytes(
        config, 9, 2, torch.bfloat16
    )


# Hand-worked published numbers: layers x 2 x kv_heads x head_dim x 2 bytes (bf16).
@pytest.mark.parametrize(
    "name, per_token",
    [
        ("meta-llama/Llama-2-7b-hf", 32 * 2 * 32 * 128 * 2),  # 512 KiB
        ("meta-llama/Llama-3.1-8B", 32 * 2 * 8 * 128 * 2),  # 128 KiB
        ("meta-llama/Llama-3.1-70B", 80 * 2 * 8 * 128 * 2),
        ("Qwen/Qwen2.5-0.5B", 24 * 2 * 2 * 64 * 2),
        ("Qwen/Qwen3-8B", 36 * 2 * 8 * 128 * 2),
        ("tiiuae/falcon-7b", 32 * 2 * 1 * 64 * 2),  # multi-query
        ("openai-community/gpt2", 12 * 2 * 12 * 64 * 2),
        ("google/gemma-2-9b", 42 * 2 * 8 * 256 * 2),
        ("deepseek-ai/DeepSeek-V3", 61 * (512 + 64) * 2),  # MLA latent
        ("deepseek-ai/DeepSeek-V2-Lite", 27 * (512 + 64) * 2),
    ],
)
def test_published_per_token_bytes(name, per_token):
    assert sizing.kv_bytes_per_token(name, "bf16") == per_token


def test_sparse_mla_attends_to_its_top_k_and_its_indexer_scores_every_token():
    from kvlab.specs.layers import MLAttention

    plain = MLAttention(num_heads=4, qk_head_dim=24, v_head_dim=16, latent_dim=16, rope_dim=8)
    sparse = MLAttention(4, 24, 16, 16, 8, index_dim=16, index_heads=2, index_topk=8)
    assert (plain.elements_per_token, sparse.elements_per_token) == (24, 40)
    assert sparse.expanded_elements_per_token == plain.expanded_elements_per_token + 16
    assert (sparse.attended(5), sparse.attended(20), plain.attended(20)) == (5, 8, 20)
    assert sparse.unread_elements(20) == 24 * 12 and sparse.unread_elements(8) == 0 == plain.unread_elements(
        20
    )
    # decode: the latent attention over the top 8, plus 2 index heads x q.k of 16 over all 20 tokens
    assert sparse.attention_flops(20, 4) == plain.attention_flops(8, 4) + 2 * 2 * 16 * 20
    # prefill: a ramp to 8 keys then 8 per query for the latent; the whole triangle for the indexer
    assert sparse.prefill_pairs(20) == 8 * 9 / 2 + 12 * 8
    assert (
        sparse.prefill_attention_flops(20, 4) == 4 * plain.pair_flops_per_head * (36 + 96) + 2 * 2 * 16 * 210
    )


@pytest.mark.parametrize(
    "extra",
    [{}, {"global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True}],
    ids=["uniform", "wide-global-layers"],
)
def test_a_heterogeneous_gemma4_config_sizes_layer_by_layer(extra):
    # Gemma 4's config refuses a global head_dim (AmbiguousGlobalPerLayerAttributeError): kvlab reads each
    # layer's own config, so its global layers' wider heads and fewer KV heads are counted as transformers caches them
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma4_text",
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        intermediate_size=128,
        sliding_window=8,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        **extra,
    )
    spec = arch.describe(config)
    assert [layer.kind for layer in spec.layers] == ["sliding"] * 5 + ["full"]
    for seq_len in (1, 9, 20):
        assert _forward_cache_bytes(config, seq_len, 2) == sizing.kv_cache_bytes(
            config, seq_len, 2, torch.float32
        )


def test_mla_expanded_size():
    # DeepSeek-V3: 128 heads x (K: 128 + 64, V: 128) per layer.
    assert sizing.kv_bytes_per_token_expanded("deepseek-ai/DeepSeek-V3", "bf16") == 61 * 128 * (192 + 128) * 2


def test_sliding_window_caps_at_window_minus_one():
    per_token = sizing.kv_bytes_per_token("mistralai/Mistral-7B-v0.1", "bf16")
    assert sizing.kv_cache_bytes("mistralai/Mistral-7B-v0.1", 100_000, 1, "bf16") == 4095 * per_token
    assert sizing.kv_cache_bytes("mistralai/Mistral-7B-v0.1", 1000, 3, "bf16") == 3 * 1000 * per_token


def test_gemma3_pattern():
    spec = arch.describe("google/gemma-3-27b-it")
    assert spec.kinds == {"sliding": 52, "full": 10}
    assert [layer.kind for layer in spec.layers[:6]] == ["sliding"] * 5 + ["full"]
    assert spec.layers[0].window == 1024


def test_dtypes():
    assert sizing.kv_bytes_per_token("meta-llama/Llama-3.1-8B", "fp8") * 2 == sizing.kv_bytes_per_token(
        "meta-llama/Llama-3.1-8B", torch.bfloat16
    )
    assert sizing.kv_bytes_per_token("meta-llama/Llama-3.1-8B", "fp32") == 4 * 32 * 2 * 8 * 128
    # default: the config's declared dtype (Llama 2: float16)
    assert sizing.kv_bytes_per_token("meta-llama/Llama-2-7b-hf") == 512 * 1024
    with pytest.raises(ValueError, match="unknown dtype"):
        sizing.kv_bytes_per_token("meta-llama/Llama-3.1-8B", "fp7")


def test_bad_sizes_are_errors():
    with pytest.raises(ValueError, match="seq_len"):
        sizing.kv_cache_bytes("meta-llama/Llama-3.1-8B", -1)
    with pytest.raises(ValueError, match="batch_size"):
        sizing.kv_cache_bytes("meta-llama/Llama-3.1-8B", 10, 0)
    with pytest.raises(ValueError, match="batch_size"):
        sizing.crossover_context("meta-llama/Llama-3.1-8B", batch_size=-2)


@pytest.mark.parametrize(
    "name, billions",
    [
        ("meta-llama/Llama-2-7b-hf", 6.74),
        ("meta-llama/Llama-3.1-8B", 8.03),
        ("meta-llama/Llama-3.1-405B", 405.85),
        ("mistralai/Mixtral-8x7B-v0.1", 46.70),
        ("Qwen/Qwen2.5-0.5B", 0.494),
        ("deepseek-ai/DeepSeek-V3", 671.03),
        ("openai-community/gpt2", 0.1244),
    ],
)
def test_param_counts_match_model_cards(name, billions):
    assert sizing.param_count(name) / 1e9 == pytest.approx(billions, rel=2e-3)


def test_weight_bytes_dtype_and_bits():
    params = sizing.param_count("meta-llama/Llama-3.1-8B")
    assert sizing.weight_bytes("meta-llama/Llama-3.1-8B", "bf16") == 2 * params
    assert sizing.weight_bytes("meta-llama/Llama-3.1-8B", 4) == params // 2
    with pytest.raises(ValueError, match="bits"):
        sizing.weight_bytes("meta-llama/Llama-3.1-8B", 7)


def test_crossover_is_tight_and_none_when_window_caps():
    n = sizing.crossover_context("meta-llama/Llama-3.1-8B", 1, "bf16", "bf16")
    weights = sizing.weight_bytes("meta-llama/Llama-3.1-8B", "bf16")
    assert sizing.kv_cache_bytes("meta-llama/Llama-3.1-8B", n, 1, "bf16") >= weights
    assert sizing.kv_cache_bytes("meta-llama/Llama-3.1-8B", n - 1, 1, "bf16") < weights
    assert sizing.crossover_context("mistralai/Mistral-7B-v0.1", 1, "bf16", "bf16") is None
    assert sizing.crossover_context("mistralai/Mistral-7B-v0.1", 32, "bf16", "bf16") is not None


# --- tensor and pipeline parallelism: the bytes ONE GPU holds (chapter Many GPUs) ---------------------------


@pytest.mark.parametrize("name", arch.registry())
def test_tp1_pp1_is_unchanged(name):
    assert sizing.kv_bytes_per_token(name, "bf16", tp=1) == sizing.kv_bytes_per_token(name, "bf16")
    assert sizing.kv_cache_bytes(name, 4096, 3, "bf16", tp=1, pp=1) == sizing.kv_cache_bytes(
        name, 4096, 3, "bf16"
    )


def test_tp_splits_kv_heads_then_copies_them():
    name = "meta-llama/Llama-3.1-8B"  # 32 query heads, 8 KV heads
    whole = sizing.kv_bytes_per_token(name, "bf16")
    assert [sizing.kv_bytes_per_token(name, "bf16", tp=t) for t in (2, 4, 8)] == [
        whole // 2,
        whole // 4,
        whole // 8,
    ]
    assert (
        sizing.kv_bytes_per_token(name, "bf16", tp=16) == whole // 8
    )  # one head per GPU, each head on 2 GPUs
    tiny = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"  # 32 query heads, 4 KV heads
    assert sizing.kv_bytes_per_token(tiny, "bf16", tp=8) == sizing.kv_bytes_per_token(tiny, "bf16", tp=4)
    layer = arch.describe(tiny).layers[0]
    assert (layer.kv_heads_per_rank(8), layer.replicas(8)) == (1, 2)


def test_mla_latent_is_whole_on_every_rank():
    name = "deepseek-ai/DeepSeek-V3"
    assert sizing.kv_cache_bytes(name, 8192, 1, "bf16", tp=8) == sizing.kv_cache_bytes(name, 8192, 1, "bf16")
    assert {layer.replicas(8) for layer in arch.describe(name).layers} == {8}


def test_pipeline_stages_follow_vllm_and_sum_to_the_whole():
    assert [len(s) for s in sizing.pipeline_stages(61, 4)] == [15, 15, 16, 15]
    assert [len(s) for s in sizing.pipeline_stages(7, 4)] == [2, 2, 2, 1]
    assert [len(s) for s in sizing.pipeline_stages(32, 2)] == [16, 16]
    name = "google/gemma-2-9b"  # alternating sliding and full layers: stages differ at long context
    stages = sizing.kv_cache_bytes_per_stage(name, 32768, 2, "bf16", pp=3)
    assert sum(stages) == sizing.kv_cache_bytes(name, 32768, 2, "bf16")
    assert sizing.kv_cache_bytes(name, 32768, 2, "bf16", pp=3) == max(stages)
    weights = sizing.weight_bytes_per_stage(name, "bf16", pp=2, vocab_parallel=False)
    tied = sizing.weight_bytes(name, "bf16") + 2 * 3584 * 256000  # a tied table sits on both end stages
    assert sum(weights) == tied


@pytest.mark.parametrize(
    "name", ["meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-72B", "mistralai/Mixtral-8x7B-v0.1"]
)
def test_weight_bytes_per_gpu(name):
    whole = sizing.weight_bytes(name, "bf16")
    assert sizing.weight_bytes_per_gpu(name, "bf16") == whole
    for tp in (2, 4, 8):
        per_gpu = sizing.weight_bytes_per_gpu(name, "bf16", tp=tp)
        assert (
            whole / tp <= per_gpu < whole / tp * 1.01
        )  # norms (and nothing else here) are whole on every rank
    assert sizing.weight_bytes_per_gpu(name, 4, tp=8) == pytest.approx(
        sizing.weight_bytes_per_gpu(name, "bf16", tp=8) / 4, abs=1
    )


@pytest.mark.parametrize(
    "name, tp, pp, message",
    [
        ("Qwen/Qwen2.5-7B", 8, 1, "does not divide the 28 query heads"),
        ("meta-llama/Llama-3.1-8B", 3, 1, "does not divide the 32 query heads"),
        ("meta-llama/Llama-3.1-8B", 1, 33, "exceeds the 32 layers"),
        ("meta-llama/Llama-3.1-8B", 0, 1, "tp must be an integer"),
    ],
)
def test_bad_parallel_sizes(name, tp, pp, message):
    with pytest.raises(ValueError, match=message):
        sizing.kv_cache_bytes(name, 1024, 1, "bf16", tp=tp, pp=pp)


def test_kv_heads_and_tp_must_divide_one_another():
    config = models.tiny_config("llama", heads=12, kv_heads=4, hidden=96)
    with pytest.raises(ValueError, match="4 KV heads must divide one another"):
        sizing.kv_bytes_per_token(config, "bf16", tp=6)


@pytest.mark.parametrize(
    ("name", "shapes"),
    [
        ("meta-llama/Llama-3.1-8B", "2 × 8 × 128"),
        ("tiiuae/falcon-7b", "2 × 1 × 64"),
        ("deepseek-ai/DeepSeek-V3", "latent 512 + rope 64"),
    ],
)
def test_cached_shapes_name_what_one_token_adds(name, shapes):
    assert sizing.cached_shapes(name) == shapes


def test_holders_name_ties_together():
    llama = sizing.model_size("meta-llama/Llama-3.1-8B")
    mistral = sizing.model_size("mistralai/Mistral-7B-v0.1")
    falcon = sizing.model_size("tiiuae/falcon-7b")
    group, text = sizing.holders([llama, falcon, mistral], llama.kv_bytes_per_token)
    assert group == [llama, mistral]
    assert text == (
        "meta-llama/Llama-3.1-8B and mistralai/Mistral-7B-v0.1 (a tie: both have 32 layers of 2 × 8 × 128)"
    )
    assert sizing.holders([llama, falcon], falcon.kv_bytes_per_token) == ([falcon], "tiiuae/falcon-7b")
    with pytest.raises(ValueError, match="no model of the 2 given needs 1 KV bytes per token"):
        sizing.holders([llama, falcon], 1)


def test_holders_name_a_tie_in_chinese_too():
    llama2 = sizing.model_size("meta-llama/Llama-2-13b-hf", "bf16", "bf16")
    opt = sizing.model_size("facebook/opt-13b", "bf16", "bf16")
    _, en = sizing.holders([llama2, opt], llama2.kv_bytes_per_token)
    _, zh = sizing.holders([llama2, opt], llama2.kv_bytes_per_token, lang="zh")
    assert en.startswith("meta-llama/Llama-2-13b-hf and facebook/opt-13b (a tie: both have 40 layers")
    assert zh.startswith("meta-llama/Llama-2-13b-hf 和 facebook/opt-13b（并列：两者都是 40 层")
