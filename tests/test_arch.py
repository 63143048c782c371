import pytest
from transformers import PretrainedConfig

from kvlab import arch, models


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


@pytest.mark.parametrize("name", arch.registry())
def test_get_config_returns_fresh_config(name):
    a, b = arch.get_config(name), arch.get_config(name)
    assert isinstance(a, PretrainedConfig) and a is not b
    assert arch.source(name).startswith("https://huggingface.co/")


def test_registry_entries_cite_their_source():
    text = open(arch.__file__).read()
    body = text[text.index("_REGISTRY") : text.index("def registry")]
    entries = body.count('": (')
    assert entries == len(arch.registry())
    assert body.count("# ") >= len({arch.get_config(n).model_type for n in arch.registry()})


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


def test_describe_linear_layers_store_nothing():
    cfg = models.tiny_config("llama", layers=3)
    cfg.layer_types = ["full_attention", "linear_attention", "full_attention"]
    assert [layer.kind for layer in arch.describe(cfg).layers] == ["full", "none", "full"]


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
    with pytest.raises(arch.UnknownModelError) as err:
        arch.get_config("no-such-org/no-such-model")
    message = str(err.value)
    assert "no-such-org/no-such-model" in message and "meta-llama/Llama-3.1-8B" in message


def test_local_directory_falls_back_to_autoconfig(tmp_path):
    models.tiny_config("qwen2", hidden=32, heads=2).save_pretrained(tmp_path)
    assert arch.get_config(str(tmp_path)).model_type == "qwen2"
