"""Hybrid and state-space models: `kvlab.specs.sizing.kv_cache_bytes` equals, to the byte, every tensor the
transformers 5.24 cache object holds after a forward: the growing K/V of the attention layers plus the fixed-size
conv and recurrent (SSM / delta-rule) state of the Mamba, Mamba-2, gated-DeltaNet and short-conv layers (kvlab
issue 25). A family kvlab cannot size is a one-line `UnsupportedConfigError` naming the model type and layer type.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from kvlab.specs import arch, layers, sizing
from kvlab.specs.arch import UnsupportedConfigError
from kvlab.units import format_bytes

transformers.logging.set_verbosity_error()

BATCH, PROMPT = 2, 7


def _tiny(name: str):
    """A few-layer config of each family, mixing the layer types the family has."""
    T = transformers
    common = dict(vocab_size=64, hidden_size=32)
    attention = dict(num_attention_heads=4, num_key_value_heads=2)
    mamba2 = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2)
    moe = dict(num_experts_per_tok=1)
    configs = {
        "jamba": lambda: T.JambaConfig(
            **common,
            **attention,
            **moe,
            intermediate_size=64,
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
        ),
        "bamba": lambda: T.BambaConfig(
            **common,
            **attention,
            **mamba2,
            intermediate_size=64,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_chunk_size=4,
        ),
        "granitemoehybrid": lambda: T.GraniteMoeHybridConfig(
            **common,
            **attention,
            **mamba2,
            **moe,
            intermediate_size=64,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_local_experts=2,
            shared_intermediate_size=32,
            mamba_chunk_size=4,
        ),
        "nemotron_h": lambda: T.NemotronHConfig(
            **common,
            **attention,
            **moe,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
            head_dim=8,
            intermediate_size=64,
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            conv_kernel=3,
            expand=2,
            chunk_size=4,
            n_routed_experts=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
        ),
        "qwen3_next": lambda: T.Qwen3NextConfig(
            **common,
            **attention,
            **moe,
            intermediate_size=64,
            num_hidden_layers=4,
            head_dim=8,
            linear_conv_kernel_dim=3,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=2,
        ),
        "lfm2": lambda: T.Lfm2Config(
            **common,
            **attention,
            intermediate_size=64,
            num_hidden_layers=4,
            full_attn_idxs=[1, 3],
            conv_L_cache=3,
        ),
        "falcon_h1": lambda: T.FalconH1Config(
            **common,
            **attention,
            **mamba2,
            intermediate_size=64,
            num_hidden_layers=2,
            mamba_d_ssm=48,
            mamba_chunk_size=4,
        ),
        "zamba2": lambda: T.Zamba2Config(
            **common,
            **attention,
            num_hidden_layers=4,
            layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
            mamba_d_state=8,
            mamba_d_conv=3,
            mamba_expand=2,
            mamba_ngroups=2,
            n_mamba_heads=4,
            chunk_size=4,
            adapter_rank=4,
        ),
        "mamba": lambda: T.MambaConfig(
            **common, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=3, time_step_rank=4
        ),
        "mamba2": lambda: T.Mamba2Config(
            **common,
            num_heads=4,
            head_dim=16,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=3,
            n_groups=2,
            chunk_size=4,
        ),
        # Attention only, but sliding (window 4, attention sinks) and chunked (chunk 4) beside global layers.
        "gpt_oss": lambda: T.GptOssConfig(
            **common,
            **attention,
            **moe,
            intermediate_size=32,
            num_hidden_layers=2,
            head_dim=8,
            num_local_experts=2,
            sliding_window=4,
        ),
        "llama4_text": lambda: T.Llama4TextConfig(
            **common,
            **attention,
            **moe,
            intermediate_size=32,
            intermediate_size_mlp=32,
            num_hidden_layers=4,
            head_dim=8,
            num_local_experts=2,
            attention_chunk_size=4,
            no_rope_layers=[1, 1, 1, 0],
        ),
    }
    return configs[name]()


FAMILIES = [
    "jamba", "bamba", "granitemoehybrid", "nemotron_h", "qwen3_next", "lfm2", "falcon_h1", "zamba2", "mamba",
    "mamba2", "gpt_oss", "llama4_text",
]  # fmt: skip
STATE_FAMILIES = FAMILIES[:10]


def _tensors(obj, found: dict[int, torch.Tensor], seen: set[int], depth: int = 0) -> None:
    """Every tensor reachable from `obj` through attributes, dicts, lists and tuples, each object once."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, found, seen, depth + 1)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _tensors(value, found, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type | torch.nn.Module):
        for value in vars(obj).values():
            _tensors(value, found, seen, depth + 1)


def cache_bytes(cache) -> int:
    """Bytes of every tensor the cache object holds, walked generically; a view of the same storage region
    counted once. The 0-d integer window size a sliding layer keeps (`_sliding_window_tensor`) is bookkeeping,
    not cache: kvlab counts K/V and state only, as `kvlab.measure.cache_tensor_bytes` does."""
    found: dict[int, torch.Tensor] = {}
    _tensors(cache, found, set())
    regions = {}
    for tensor in found.values():
        if tensor.dim() == 0 and not tensor.is_floating_point():
            continue
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
        )
        regions[key] = tensor.numel() * tensor.element_size()
    return sum(regions.values())


def _forward(name: str, dtype: torch.dtype, seq_len: int = PROMPT, decode: int = 0) -> tuple[int, object]:
    config = _tiny(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(0, config.vocab_size, (BATCH, seq_len))
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(ids, use_cache=True)
        for _ in range(decode):
            out = model(out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
    return cache_bytes(out.cache), config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_kv_cache_bytes_equal_the_cache_object(name, dtype):
    held, config = _forward(name, dtype)
    assert held == sizing.kv_cache_bytes(config, PROMPT, BATCH, dtype)


@pytest.mark.parametrize("name", ["jamba", "lfm2", "qwen3_next", "zamba2"])
def test_a_prompt_shorter_than_the_conv_kernel_and_decode_steps(name):
    # Two tokens: the conv state is padded to the kernel. Then three decode steps: the state stays fixed.
    held, config = _forward(name, torch.bfloat16, seq_len=2, decode=3)
    assert held == sizing.kv_cache_bytes(config, 5, BATCH, torch.bfloat16)


@pytest.mark.parametrize("name", STATE_FAMILIES)
def test_state_is_a_fixed_part_per_sequence(name):
    config = _tiny(name)
    state = sizing.state_bytes_per_sequence(config, "bf16")
    assert state > 0
    growing = sizing.kv_bytes_per_token(config, "bf16")
    for seq_len, batch in ((1, 1), (9, 3), (1000, 2)):
        held = sizing.kv_cache_bytes(config, seq_len, batch, "bf16")
        spec = arch.describe(config)
        kv = batch * sum(
            layer.cached_tokens(seq_len) * layer.kv_bytes_per_token("bf16") for layer in spec.layers
        )
        assert held == kv + batch * state
    assert sizing.kv_cache_bytes(config, 0, 2, "bf16") == 0  # nothing allocated before the first token
    assert growing == sum(layer.kv_bytes_per_token("bf16") for layer in arch.describe(config).layers)


def test_recurrent_state_is_fp32_whatever_the_dtype():
    layer = layers.StateLayer(conv_channels=96, conv_kernel=3, recurrent_shape=(4, 16, 8))
    assert layer.state_bytes("bf16") == 96 * 3 * 2 + 4 * 16 * 8 * 4
    assert layer.state_bytes(torch.float16) == 96 * 3 * 2 + 4 * 16 * 8 * 4
    assert layer.state_bytes("fp32") == (96 * 3 + 4 * 16 * 8) * 4
    conv_only = layers.StateLayer(conv_channels=32, conv_kernel=3, recurrent_shape=())
    assert conv_only.state_bytes("bf16") == 32 * 3 * 2 and conv_only.state_shape == "conv 32 × 3"


def _kv(layers_: int, kv_heads: int, head_dim: int, tokens: int = 1024) -> int:
    return layers_ * 2 * kv_heads * head_dim * 2 * tokens  # bf16


def _mamba2(
    layers_: int, inner: int, heads: int, head_dim: int, groups: int, d_state: int, kernel: int = 4
) -> int:
    return layers_ * ((inner + 2 * groups * d_state) * kernel * 2 + heads * head_dim * d_state * 4)


# transformers 5.24's default configs, bf16, one sequence of 1024 tokens, worked by hand:
# (state bytes per sequence, kv_cache_bytes). Before issue 25 kvlab counted only the attention K/V (or nothing).
DEFAULTS = {
    # 4 of 32 layers attend (8 KV heads × 128); 28 Mamba layers: conv 8192 × 4, SSM 8192 × 16.
    "JambaConfig": (28 * (8192 * 4 * 2 + 8192 * 16 * 4), _kv(4, 8, 128)),
    # 12 of 48 attend (2 × 256); 36 gated-DeltaNet layers: conv (2·16·128 + 32·128) × 4, state 32 × 128 × 128.
    "Qwen3NextConfig": (36 * ((2 * 16 * 128 + 32 * 128) * 4 * 2 + 32 * 128 * 128 * 4), _kv(12, 2, 256)),
    # 32 Mamba-2 layers, no attention: 128 heads × 64, one group, d_state 256.
    "GraniteMoeHybridConfig": (_mamba2(32, 8192, 128, 64, 1, 256), 0),
    "BambaConfig": (_mamba2(32, 8192, 128, 64, 1, 256), 0),
    # The default LFM2 attends in every layer (full_attn_idxs = all): no conv layer, nothing was missing.
    "Lfm2Config": (0, _kv(32, 8, 80)),
    # Pattern Mamba, MoE, attention, MLP: one Mamba-2 layer (128 × 64, 8 groups, d_state 128), one attention.
    "NemotronHConfig": (_mamba2(1, 8192, 128, 64, 8, 128), _kv(1, 8, 128)),
    # 32 hybrid layers: attention (8 × 128) and a Mamba-2 mixer (d_ssm 1024 = 128 heads × 8, d_state 256).
    "FalconH1Config": (_mamba2(32, 1024, 128, 8, 1, 256), _kv(32, 8, 128)),
    # 54 Mamba-2 layers (8 heads × 640, d_state 64), 9 of them hybrid with the shared attention (32 × 160).
    "Zamba2Config": (_mamba2(54, 5120, 8, 640, 1, 64), _kv(9, 32, 160)),
    # 32 Mamba layers: conv 1536 × 4, SSM 1536 × 16.
    "MambaConfig": (32 * (1536 * 4 * 2 + 1536 * 16 * 4), 0),
    "Mamba2Config": (_mamba2(64, 8192, 128, 64, 8, 128), 0),
}


@pytest.mark.parametrize("name", DEFAULTS)
def test_default_configs_are_sized_exactly(name):
    config = getattr(transformers, name)()
    state, kv = DEFAULTS[name]
    assert sizing.state_bytes_per_sequence(config, "bf16") == state
    assert sizing.kv_cache_bytes(config, 1024, 1, "bf16") == kv + state
    assert sizing.kv_cache_bytes(config, 1024, 3, "bf16") == 3 * (kv + state)


def test_default_state_bytes_per_sequence():
    # The figures the report quotes: bf16 conv states, fp32 recurrent states.
    got = {name: sizing.state_bytes_per_sequence(getattr(transformers, name)(), "bf16") for name in DEFAULTS}
    assert got == {
        "JambaConfig": 16515072,
        "Qwen3NextConfig": 77856768,
        "GraniteMoeHybridConfig": 270663680,
        "BambaConfig": 270663680,
        "Lfm2Config": 0,
        "NemotronHConfig": 4276224,
        "FalconH1Config": 33947648,
        "Zamba2Config": 73046016,
        "MambaConfig": 3538944,
        "Mamba2Config": 273678336,
    }


def test_pure_state_models_describe_without_attention():
    spec = arch.describe(transformers.MambaConfig(num_hidden_layers=3))
    assert spec.kinds == {"state": 3} and spec.attention_type == "none" and spec.num_attention_heads == 0
    assert (spec.kv_heads, spec.head_dim, spec.grows, spec.has_state) == (0, 0, False, True)
    # A pure state model's cache never grows, but enough sequences' states still outweigh the weights.
    config = _tiny("mamba")
    assert sizing.crossover_context(config, batch_size=10**6) == 1


@pytest.mark.parametrize(
    "name",
    ["FalconMambaConfig", "KimiLinearConfig", "Qwen3_5TextConfig", "RecurrentGemmaConfig", "ZambaConfig"],
)
def test_unsized_state_families_are_refused_in_one_line(name):
    config = getattr(transformers, name)()
    with pytest.raises(UnsupportedConfigError) as err:
        sizing.kv_cache_bytes(config, 16, 1, "bf16")
    message = str(err.value)
    assert repr(config.model_type) in message and "'linear_attention'" in message and "\n" not in message


def test_a_state_layer_type_in_an_attention_family_is_refused():
    config = _tiny("lfm2")
    config.model_type = "llama"  # a family whose state kvlab does not know
    with pytest.raises(UnsupportedConfigError, match="'llama' has type 'conv'"):
        arch.describe(config)
    zamba = _tiny("zamba2")
    zamba.layer_types = ["linear_attention", "conv", "linear_attention", "hybrid"]
    with pytest.raises(UnsupportedConfigError, match="layer 1 of 'zamba2' has type 'conv'"):
        arch.describe(zamba)


def test_missing_state_fields_are_a_clear_error():
    config = _tiny("mamba2")
    config.n_groups = 0
    with pytest.raises(UnsupportedConfigError, match="Mamba2Config.n_groups must be an integer >= 1"):
        arch.describe(config)


def test_tensor_parallel_state_and_vllm_budget_are_refused():
    config = _tiny("jamba")
    with pytest.raises(UnsupportedConfigError, match="state layer"):
        sizing.kv_cache_bytes(config, 16, 1, "bf16", tp=2)
    # Pipeline stages split the layers, states included: the stages sum to the whole.
    stages = sizing.kv_cache_bytes_per_stage(config, 16, 2, "bf16", pp=2)
    assert sum(stages) == sizing.kv_cache_bytes(config, 16, 2, "bf16")
    from kvlab.costs import budget, sglang

    with pytest.raises(UnsupportedConfigError, match="vLLM memory budget"):
        budget.memory_budget(config, "H100-SXM")
    with pytest.raises(UnsupportedConfigError, match="SGLang pool"):
        sglang.sglang_pool(config, "H100-SXM")


def test_stored_shapes_round_trip_state_layers():
    from kvlab.specs import shape

    for name in ("zamba2", "lfm2", "mamba"):
        config = _tiny(name)
        stored, _ = shape._decode(json.loads(json.dumps(shape._encode(config))))
        assert stored.spec == arch.describe(config)


def test_size_report_shows_the_state(tmp_path):
    from kvlab import cli

    _tiny("jamba").save_pretrained(tmp_path)
    text = cli.size_report(str(tmp_path), 1024, 2)
    assert "2 state, 2 full" in text and "KV state/seq" in text
    state = sizing.state_bytes_per_sequence(_tiny("jamba"), "bf16")
    assert f"KV state/seq {format_bytes(state)} fixed, in 2 state layers" in text


# Every registry model's kv_cache_bytes(name, 1000, 3, "bf16") before the state layers were added (issue 25):
# none of them has a state layer, so none may change.
REGISTRY_BEFORE = {
    "meta-llama/Llama-2-7b-hf": 1572864000,
    "meta-llama/Llama-2-13b-hf": 2457600000,
    "meta-llama/Llama-2-70b-hf": 983040000,
    "meta-llama/Llama-3.1-8B": 393216000,
    "meta-llama/Llama-3.1-70B": 983040000,
    "meta-llama/Llama-3.1-405B": 1548288000,
    "mistralai/Mistral-7B-v0.1": 393216000,
    "mistralai/Mixtral-8x7B-v0.1": 393216000,
    "Qwen/Qwen2.5-0.5B": 36864000,
    "Qwen/Qwen2.5-7B": 172032000,
    "Qwen/Qwen2.5-72B": 983040000,
    "Qwen/Qwen3-8B": 442368000,
    "google/gemma-2-9b": 1032192000,
    "google/gemma-3-27b-it": 1523712000,
    "tiiuae/falcon-7b": 24576000,
    "facebook/opt-13b": 2457600000,
    "openai-community/gpt2": 110592000,
    "microsoft/Phi-3-mini-4k-instruct": 1179648000,
    "deepseek-ai/DeepSeek-V2-Lite": 93312000,
    "deepseek-ai/DeepSeek-V3": 210816000,
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": 67584000,
}


def test_registry_models_are_unchanged():
    # The registry has grown since (issue 25, items 2 and 6): these 21 are still in it, and still unchanged.
    assert set(REGISTRY_BEFORE) <= set(arch.registry())
    for name, before in REGISTRY_BEFORE.items():
        assert sizing.kv_cache_bytes(name, 1000, 3, "bf16") == before
        assert sizing.state_bytes_per_sequence(name) == 0
        assert not arch.describe(name).has_state
