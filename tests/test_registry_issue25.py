"""The registry models added for kvlab issue 25 (items 2 and 6): their stored files are the vendored bytes, and their
KV and state sizes are the ones their published configs give by hand.

No model card or paper of these models publishes a per-token KV or per-sequence state figure in bytes, so every
expected figure below is derived by hand from the config's own fields (cited per test); `kvlab.specs.sizing` must
agree with that arithmetic. bf16 is 2 bytes; the recurrent state of a state layer is float32 (4 bytes) whatever the
cache dtype (transformers 5.24's `LinearAttentionLayer`, see `sizing.state_bytes_per_sequence`).
"""

import hashlib
import json

import pytest

from kvlab.specs import arch, sizing

BF16, FP32 = 2, 4

# id -> the git blob id of the file at index.json's "found" (ai-dynamo/aiconfigurator at the cited commit): the
# stored copy must be those bytes, unedited.
BLOBS = {
    "openai/gpt-oss-20b": "2318561c6fcd793ca52d64b670a5f51cc0a05023",
    "openai/gpt-oss-120b": "2dbc99f5a0ec9e111a4e20139254653ef4e9baf9",
    "mistralai/Mixtral-8x22B-v0.1": "cb5434a64c61b80ea83ce7873534f9e4baf16041",
    "Qwen/Qwen3-30B-A3B": "2703739b9cfc422a3a0a6c932140db18533a8d1a",
    "deepseek-ai/DeepSeek-R1": "c482e777cbacba9cb292d0fceba48ef52956583e",
    "Qwen/Qwen3-Next-80B-A3B-Thinking": "5dd2306b54556f95ca808dc626e351786f496ff8",
    "nvidia/Nemotron-H-56B-Base-8K": "fba672a5c42ed1c246fbec88c4b84944b9a9f00f",
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "93adac73c757ca58fb9b1b3d7f4ff5ab322004ea",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": "6ad2d422ec6186af3d142a24c84d177039ff983d",
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct": "93dc9fc6a1adcf9595f85fc9b1607c70d516ee8d",
    "moonshotai/Kimi-K2-Instruct": "09a59d7ee7aa257764bdc823ae51efc269ae3b09",
    "deepseek-ai/DeepSeek-V3.2": "d44a9480898d1e6a0ef8229dbb5227394f5c06c4",
}


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.mark.parametrize("name", BLOBS)
def test_stored_copy_is_the_vendored_file_byte_for_byte(name):
    entry = json.loads(arch.config_path(name).with_name("index.json").read_text())["models"][name]
    assert (
        entry["status"] in ("verbatim", "verbatim, abridged")
        and entry["found"]["repo"] == "ai-dynamo/aiconfigurator"
    )
    assert _git_blob(arch.config_path(name).read_bytes()) == BLOBS[name]


@pytest.mark.parametrize("name", BLOBS)
def test_every_added_model_sizes(name):
    # All three entry points answer for every added model (none of them is refused).
    assert sizing.kv_bytes_per_token(name, "bf16") > 0
    assert sizing.kv_cache_bytes(name, 8192, 1, "bf16") > 0
    assert sizing.state_bytes_per_sequence(name, "bf16") >= 0


@pytest.mark.parametrize(
    "name, full_layers, sliding_layers",
    [("openai/gpt-oss-20b", 12, 12), ("openai/gpt-oss-120b", 18, 18)],
)
def test_gpt_oss_sliding_layers_stop_growing_at_128_tokens(name, full_layers, sliding_layers):
    # config.json: num_key_value_heads 8, head_dim 64, layer_types alternating sliding/full, sliding_window 128.
    # The attention sinks (one learned logit per head) are weights: nothing per token.
    per_layer = 2 * 8 * 64 * BF16  # K and V
    assert sizing.kv_bytes_per_token(name, "bf16") == (full_layers + sliding_layers) * per_layer
    # Past the window only the full layers grow.
    grown = sizing.kv_cache_bytes(name, 8192, 1, "bf16") - sizing.kv_cache_bytes(name, 4096, 1, "bf16")
    assert grown == full_layers * per_layer * 4096
    assert sizing.kv_cache_bytes(name, 8192, 1, "bf16") < (full_layers + sliding_layers) * per_layer * 8192
    assert sizing.state_bytes_per_sequence(name, "bf16") == 0


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mistralai/Mixtral-8x22B-v0.1", 56 * 2 * 8 * 128 * BF16),  # 56 layers, 8 KV heads, head_dim 6144/48
        ("Qwen/Qwen3-30B-A3B", 48 * 2 * 4 * 128 * BF16),  # 48 layers, 4 KV heads, head_dim 128
        ("deepseek-ai/DeepSeek-R1", 61 * (512 + 64) * BF16),  # MLA: kv_lora_rank 512 + qk_rope_head_dim 64
        # DeepSeek-V3's latent on 61 layers; its 64 query heads do not enter the cache
        ("moonshotai/Kimi-K2-Instruct", 61 * (512 + 64) * BF16),
    ],
)
def test_full_attention_models_per_token(name, expected):
    assert sizing.kv_bytes_per_token(name, "bf16") == expected
    assert sizing.kv_cache_bytes(name, 8192, 1, "bf16") == expected * 8192
    assert sizing.state_bytes_per_sequence(name, "bf16") == 0


def test_qwen3_next_gated_deltanet_state_and_kv():
    name = "Qwen/Qwen3-Next-80B-A3B-Thinking"
    # full_attention_interval 4 over 48 layers: 12 attention layers (2 KV heads, head_dim 256), 36 gated DeltaNet.
    kv = 12 * 2 * 2 * 256 * BF16
    # Each DeltaNet layer: a conv over q, k, v (2 × 16 key heads × 128 + 32 value heads × 128 = 8192 channels,
    # linear_conv_kernel_dim 4) and a 128 × 128 delta-rule state per value head (32 heads).
    state = 36 * (8192 * 4 * BF16 + 32 * 128 * 128 * FP32)
    assert sizing.kv_bytes_per_token(name, "bf16") == kv
    assert sizing.state_bytes_per_sequence(name, "bf16") == state
    assert sizing.kv_cache_bytes(name, 8192, 1, "bf16") == kv * 8192 + state
    assert sizing.kv_cache_bytes(name, 8192, 3, "bf16") == 3 * (kv * 8192 + state)


@pytest.mark.parametrize(
    "name, attention, mamba, kv_heads, hidden_heads, head_dim, groups, d_state",
    [
        # hybrid_override_pattern: 10 "*" and 54 "M" of 118; mamba_num_heads 256 × mamba_head_dim 64,
        # n_groups 8, ssm_state_size 256; num_key_value_heads 8, attention_head_dim 128.
        ("nvidia/Nemotron-H-56B-Base-8K", 10, 54, 8, 256, 64, 8, 256),
        # 6 "*" and 23 "M" of 52; mamba_num_heads 64 × mamba_head_dim 64, n_groups 8, ssm_state_size 128;
        # num_key_value_heads 2, head_dim 128.
        ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", 6, 23, 2, 64, 64, 8, 128),
    ],
)
def test_nemotron_h_mamba2_state_and_kv(
    name, attention, mamba, kv_heads, hidden_heads, head_dim, groups, d_state
):
    kv = attention * 2 * kv_heads * 128 * BF16
    # Mamba-2: the conv runs over x, B and C (heads × head_dim + 2 × n_groups × d_state channels, conv_kernel 4);
    # the SSM state is head_dim × d_state per head.
    conv_channels = hidden_heads * head_dim + 2 * groups * d_state
    state = mamba * (conv_channels * 4 * BF16 + hidden_heads * head_dim * d_state * FP32)
    assert sizing.kv_bytes_per_token(name, "bf16") == kv
    assert sizing.state_bytes_per_sequence(name, "bf16") == state
    assert sizing.kv_cache_bytes(name, 8192, 1, "bf16") == kv * 8192 + state


@pytest.mark.parametrize(
    "name", ["meta-llama/Llama-4-Scout-17B-16E-Instruct", "meta-llama/Llama-4-Maverick-17B-128E-Instruct"]
)
def test_llama4_chunked_layers_stop_growing_at_their_chunk(name):
    # text_config: 48 layers, num_key_value_heads 8, head_dim 128, attention_chunk_size 8192; transformers'
    # default no_rope_layers makes every fourth layer global (12) and the others chunked (36).
    per_layer = 2 * 8 * 128 * BF16
    assert sizing.kv_bytes_per_token(name, "bf16") == 48 * per_layer
    # A chunked layer holds at most 8191 earlier tokens (transformers' ChunkedSlidingLayer, as a window)
    assert sizing.kv_cache_bytes(name, 8191, 1, "bf16") == 48 * per_layer * 8191
    grown = sizing.kv_cache_bytes(name, 32768, 1, "bf16") - sizing.kv_cache_bytes(name, 16384, 1, "bf16")
    assert grown == 12 * per_layer * 16384
    assert sizing.state_bytes_per_sequence(name, "bf16") == 0


def test_deepseek_v32_caches_an_indexer_key_beside_the_latent_and_reads_the_top_k_latents():
    # config.json: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64, index_head_dim 128, index_topk 2048.
    # transformers' DynamicIndexedLayer keeps [batch, seq_len, index_head_dim] indexer keys beside the latent.
    name = "deepseek-ai/DeepSeek-V3.2"
    assert sizing.kv_bytes_per_token(name, "bf16") == 61 * (512 + 64 + 128) * BF16
    assert sizing.kv_cache_bytes(name, 131072, 1, "bf16") == 61 * (512 + 64 + 128) * BF16 * 131072
    # A decode step reads every indexer key but only the 2048 latents the indexer picks
    assert sizing.kv_read_bytes(name, 131072, "bf16") == 61 * ((512 + 64) * 2048 + 128 * 131072) * BF16
    assert sizing.kv_read_bytes(name, 2048, "bf16") == sizing.kv_cache_bytes(name, 2048, 1, "bf16")
    # DeepSeek-V3's cache, the same latent without the indexer, for comparison
    assert sizing.kv_bytes_per_token("deepseek-ai/DeepSeek-V3", "bf16") == 61 * (512 + 64) * BF16
