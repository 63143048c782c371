import json
import time
from pathlib import Path

import pytest
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from kvlab import models
from kvlab.specs import arch, images, shape
from kvlab.specs.layers import SlidingWindowAttention


def test_registry_has_required_models():
    required = {
        "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-13b-hf", "meta-llama/Llama-2-70b-hf",
        "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-405B",
        "mistralai/Mistral-7B-v0.1", "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B",
        "Qwen/Qwen2.5-72B", "Qwen/Qwen3-8B", "google/gemma-2-9b", "google/gemma-3-27b-it", "tiiuae/falcon-7b",
        "facebook/opt-13b", "openai-community/gpt2", "microsoft/Phi-3-mini-4k-instruct",
        "deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V3", "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    }  # fmt: skip
    assert required <= set(arch.registry())


CONFIGS = Path(arch.__file__).with_name("configs")
INDEX = json.loads((CONFIGS / "index.json").read_text())["models"]

# What the chapters read off each published config: layers, query heads, KV heads (1 for MLA's shared latent),
# head dim (MLA: nope + rope), hidden size, vocab, the config's dtype, and the layer kinds with their windows.
FULL, MLA, STATE, NONE = "full", "mla", "state", "none"
# Both Llama 4 models share one text decoder's attention: 48 layers, 40 query and 8 KV heads of 128, hidden 5120
LLAMA4_TEXT = (48, 40, 8, 128, 5120, 202048, "bfloat16", {8192: 36, "full": 12})
EXPECTED = {
    "meta-llama/Llama-2-7b-hf": (32, 32, 32, 128, 4096, 32000, "float16", {FULL: 32}),
    "meta-llama/Llama-2-13b-hf": (40, 40, 40, 128, 5120, 32000, "float16", {FULL: 40}),
    "meta-llama/Llama-2-70b-hf": (80, 64, 8, 128, 8192, 32000, "float16", {FULL: 80}),
    "meta-llama/Llama-3.1-8B": (32, 32, 8, 128, 4096, 128256, "bfloat16", {FULL: 32}),
    "meta-llama/Llama-3.1-70B": (80, 64, 8, 128, 8192, 128256, "bfloat16", {FULL: 80}),
    "meta-llama/Llama-3.1-405B": (126, 128, 8, 128, 16384, 128256, "bfloat16", {FULL: 126}),
    "mistralai/Mistral-7B-v0.1": (32, 32, 8, 128, 4096, 32000, "bfloat16", {4096: 32}),
    "mistralai/Mixtral-8x7B-v0.1": (32, 32, 8, 128, 4096, 32000, "bfloat16", {FULL: 32}),
    "Qwen/Qwen2.5-0.5B": (24, 14, 2, 64, 896, 151936, "bfloat16", {FULL: 24}),
    "Qwen/Qwen2.5-7B": (28, 28, 4, 128, 3584, 152064, "bfloat16", {FULL: 28}),
    "Qwen/Qwen2.5-72B": (80, 64, 8, 128, 8192, 152064, "bfloat16", {FULL: 80}),
    "Qwen/Qwen3-8B": (36, 32, 8, 128, 4096, 151936, "bfloat16", {FULL: 36}),
    "google/gemma-2-9b": (42, 16, 8, 256, 3584, 256000, "bfloat16", {4096: 21, FULL: 21}),
    "google/gemma-3-27b-it": (62, 32, 16, 128, 5376, 262208, "bfloat16", {1024: 52, FULL: 10}),
    "tiiuae/falcon-7b": (32, 71, 1, 64, 4544, 65024, "bfloat16", {FULL: 32}),
    "facebook/opt-13b": (40, 40, 40, 128, 5120, 50272, "float16", {FULL: 40}),
    "openai-community/gpt2": (12, 12, 12, 64, 768, 50257, "float32", {FULL: 12}),
    "microsoft/Phi-3-mini-4k-instruct": (32, 32, 32, 96, 3072, 32064, "bfloat16", {2047: 32}),
    "deepseek-ai/DeepSeek-V2-Lite": (27, 16, 1, 192, 2048, 102400, "bfloat16", {MLA: 27}),
    "deepseek-ai/DeepSeek-V3": (61, 128, 1, 192, 7168, 129280, "bfloat16", {MLA: 61}),
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": (22, 32, 4, 64, 2048, 32000, "bfloat16", {FULL: 22}),
    # Added for kvlab issue 25 (items 2 and 6). gpt-oss declares no torch_dtype: config_dtype falls back to bf16.
    "openai/gpt-oss-20b": (24, 64, 8, 64, 2880, 201088, "bf16", {128: 12, FULL: 12}),
    "openai/gpt-oss-120b": (36, 64, 8, 64, 2880, 201088, "bf16", {128: 18, FULL: 18}),
    "mistralai/Mixtral-8x22B-v0.1": (56, 48, 8, 128, 6144, 32000, "bfloat16", {FULL: 56}),
    "Qwen/Qwen3-30B-A3B": (48, 32, 4, 128, 2048, 151936, "bfloat16", {FULL: 48}),
    "deepseek-ai/DeepSeek-R1": (61, 128, 1, 192, 7168, 129280, "bfloat16", {MLA: 61}),
    "Qwen/Qwen3-Next-80B-A3B-Thinking": (48, 16, 2, 256, 2048, 151936, "bfloat16", {STATE: 36, FULL: 12}),
    "nvidia/Nemotron-H-56B-Base-8K": (
        118,
        64,
        8,
        128,
        8192,
        131072,
        "bfloat16",
        {STATE: 54, NONE: 54, FULL: 10},
    ),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (
        52,
        32,
        2,
        128,
        2688,
        131072,
        "bfloat16",
        {STATE: 23, NONE: 23, FULL: 6},
    ),
    # Llama 4: chunked local attention (8192-token chunks) on three layers in four, cached as a window
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": LLAMA4_TEXT,
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct": LLAMA4_TEXT,
    "moonshotai/Kimi-K2-Instruct": (61, 64, 1, 192, 7168, 163840, "bfloat16", {MLA: 61}),
    # MLA with DeepSeek Sparse Attention's indexer on every layer (indexed_attention)
    "deepseek-ai/DeepSeek-V3.2": (61, 128, 1, 192, 7168, 129280, "bfloat16", {MLA: 61}),
    # An image-text model: the decoder's text_config alone holds the cache (image tokens included)
    "Qwen/Qwen3-VL-8B-Instruct": (36, 32, 8, 128, 4096, 151936, "bfloat16", {FULL: 36}),
}
MLA_RANKS = {
    "deepseek-ai/DeepSeek-V2-Lite": (None, 512, 64),
    "deepseek-ai/DeepSeek-V3": (1536, 512, 64),
    "deepseek-ai/DeepSeek-R1": (1536, 512, 64),
    "moonshotai/Kimi-K2-Instruct": (1536, 512, 64),
    "deepseek-ai/DeepSeek-V3.2": (1536, 512, 64),
}
STATUSES = {"verbatim", "verbatim, abridged", "content-verified", "reconstructed, not verified verbatim"}


def test_every_stored_config_is_indexed_and_every_entry_stored():
    # besides the configs: the index, the stored shapes and the image rules (kvlab.specs.images)
    stored = {p.name for p in CONFIGS.glob("*.json")} - {"index.json", shape.SHAPES.name, images.RULES.name}
    assert stored == {arch.config_path(name).name for name in INDEX}
    assert list(INDEX) == arch.registry() and set(EXPECTED) == set(INDEX)


@pytest.mark.parametrize("name", arch.registry())
def test_index_cites_config_paper_and_where_the_copy_was_checked(name):
    entry = INDEX[name]
    assert arch.source(name) == entry["config"] == f"https://huggingface.co/{name}/blob/main/config.json"
    assert entry["paper"] and entry["note"] and entry["status"] in STATUSES
    if entry["status"] != "reconstructed, not verified verbatim":
        assert set(entry["found"]) == {"repo", "path", "commit"} and len(entry["found"]["commit"]) == 40


@pytest.mark.parametrize("name", arch.registry())
def test_stored_config_is_json_with_the_indexed_model_type(name):
    published = json.loads(arch.config_path(name).read_text())
    assert published["model_type"] == INDEX[name]["model_type"] == arch.get(name).model_type
    assert published.get("architectures")


@pytest.mark.parametrize("name", arch.registry())
def test_stored_config_has_the_fields_the_chapters_rely_on(name):
    layers, heads, kv_heads, head_dim, hidden, vocab, dtype, kinds = EXPECTED[name]
    config = arch.get(name)
    spec = arch.describe(config)
    assert (spec.num_layers, spec.num_attention_heads, spec.kv_heads, spec.head_dim, spec.hidden_size) == (
        layers, heads, kv_heads, head_dim, hidden
    )  # fmt: skip
    assert config.get_text_config(decoder=True).vocab_size == vocab
    assert str(shape.config_dtype(config)).removeprefix("torch.") == dtype
    got: dict[int | str, int] = {}
    for layer in spec.layers:
        key = layer.window if isinstance(layer, SlidingWindowAttention) else layer.kind
        got[key] = got.get(key, 0) + 1
    assert got == kinds
    if name in MLA_RANKS:
        published = json.loads(arch.config_path(name).read_text())
        ranks = (published["q_lora_rank"], published["kv_lora_rank"], published["qk_rope_head_dim"])
        assert ranks == MLA_RANKS[name]


@pytest.mark.parametrize("name", arch.registry())
def test_get_returns_a_fresh_copy_of_the_published_file(name):
    a, b = arch.get(name), arch.get(name)
    assert isinstance(a, PretrainedConfig) and a is not b and a.name_or_path == name
    a.get_text_config(decoder=True).num_hidden_layers = -1  # editing a copy leaves the registry alone
    assert arch.get(name).get_text_config(decoder=True).num_hidden_layers == EXPECTED[name][0]
    # The same path as any local file or Hub id: AutoConfig.from_pretrained on the stored config.json.
    loader = CONFIG_MAPPING[INDEX[name]["load_as"]] if "load_as" in INDEX[name] else AutoConfig
    direct = loader.from_pretrained(arch.config_path(name), **INDEX[name].get("defaults", {}))
    assert direct.to_diff_dict() | {"_name_or_path": name} == b.to_diff_dict() | {"_name_or_path": name}


def test_a_model_type_transformers_does_not_register_is_read_as_its_architecture():
    # Kimi K2's kimi_k2 is DeepSeek-V3's architecture (its config's own architectures and auto_map say so)
    assert (
        INDEX["moonshotai/Kimi-K2-Instruct"]["load_as"] == "deepseek_v3" and "kimi_k2" not in CONFIG_MAPPING
    )
    kimi = arch.get("moonshotai/Kimi-K2-Instruct")
    assert type(kimi) is CONFIG_MAPPING["deepseek_v3"] and kimi.model_type == "kimi_k2"
    assert arch.describe(kimi).attention_type == "MLA"


def test_resolve_takes_a_config_or_a_name():
    config = models.tiny_config("llama")
    assert arch.resolve(config) is config
    assert arch.resolve("Qwen/Qwen3-8B").model_type == "qwen3"


@pytest.mark.parametrize(
    "name, kind",
    [
        ("meta-llama/Llama-2-7b-hf", "MHA"),
        ("meta-llama/Llama-3.1-8B", "GQA"),
        ("tiiuae/falcon-7b", "MQA"),
        ("deepseek-ai/DeepSeek-V3", "MLA"),
    ],
)
def test_attention_type(name, kind):
    assert arch.describe(name).attention_type == kind


def test_describe_honours_explicit_head_dim_and_falcon_quirks():
    assert arch.describe("Qwen/Qwen3-8B").head_dim == 128  # 4096 / 32 = 128 as well; check a mismatch too
    cfg = models.tiny_config("qwen3", hidden=64, heads=4, head_dim=32)
    assert arch.describe(cfg).head_dim == 32
    falcon = arch.describe("tiiuae/falcon-7b")
    assert (falcon.kv_heads, falcon.head_dim) == (1, 64)


def test_describe_linear_layers_of_an_unsized_family_are_refused():
    # A linear-attention layer keeps a fixed-size state; kvlab sizes it only for the families it knows
    # (tests/test_state_sizing.py), never as "nothing" (kvlab issue 25).
    cfg = models.tiny_config("llama", layers=3)
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(arch.UnsupportedConfigError, match="layer 1 of 'llama' has type 'linear_attention'"):
        arch.describe(cfg)


def test_unknown_layer_type_is_a_clear_error():
    cfg = models.tiny_config("llama", layers=2)
    cfg.layer_types = ["full_attention", "heavily_compressed_attention"]
    with pytest.raises(arch.UnsupportedConfigError, match="heavily_compressed_attention"):
        arch.describe(cfg)


def test_window_of_one_is_rejected():
    cfg = models.tiny_config("mistral", window=2)
    cfg.sliding_window = 1
    with pytest.raises(arch.UnsupportedConfigError, match="window"):
        arch.describe(cfg)


def test_unknown_model_offline_names_it_and_lists_registry(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(arch.UnknownModelError) as err:
        arch.get("no-such-org/no-such-model")
    assert time.perf_counter() - start < 5  # huggingface_hub's offline mode: no connection attempt
    message = str(err.value)
    assert (
        "no-such-org/no-such-model" in message
        and "meta-llama/Llama-3.1-8B" in message
        and "\n" not in message
    )
    with pytest.raises(arch.UnknownModelError, match="not in the kvlab registry"):
        arch.source("no-such-org/no-such-model")


def test_local_directory_falls_back_to_autoconfig(tmp_path):
    models.tiny_config("qwen2", hidden=32, heads=2).save_pretrained(tmp_path)
    assert arch.get(str(tmp_path)).model_type == "qwen2"
