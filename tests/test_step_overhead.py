"""kvlab.timing.measure_step_overhead: the fixed per-step cost, measured on a hollow twin of the model."""

import math

import pytest
from transformers import PretrainedConfig

from kvlab import hardware
from kvlab.models import tiny_model
from kvlab.roofline import REALISM, decode_step, realistic_time
from kvlab.timing import hollow_config, measure_step_overhead


def test_hollow_twin_keeps_layers_and_heads_and_shrinks_widths():
    model = tiny_model("llama", layers=3, hidden=128, heads=8, kv_heads=2, vocab=512)
    hollow = hollow_config(model.config)
    assert (
        hollow.num_hidden_layers == 3 and hollow.num_attention_heads == 8 and hollow.num_key_value_heads == 2
    )
    assert hollow.hidden_size == 8 * 8 and hollow.intermediate_size == 16 and hollow.vocab_size == 32
    assert model.config.hidden_size == 128  # the model's own config is untouched


def test_a_config_without_heads_is_a_clear_error():
    with pytest.raises(ValueError, match="no num_attention_heads"):
        hollow_config(PretrainedConfig())


def test_measured_overhead_feeds_the_realistic_model():
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, device="cpu")
    hw = hardware.get("H100-SXM")
    overhead = measure_step_overhead(model, hw, repeat=5, warmup=1)
    assert len(overhead.timing.seconds) == 5 and all(
        math.isfinite(s) and s > 0 for s in overhead.timing.seconds
    )
    assert overhead.layers == 2 and 0 <= overhead.bound_s < overhead.timing.median_s
    assert overhead.step_s == pytest.approx(overhead.timing.median_s - overhead.bound_s)
    assert overhead.per_layer_s == pytest.approx(overhead.step_s / 2)
    realism = overhead.realism()
    assert realism.step_overhead_s == overhead.step_s
    assert realism.bandwidth_efficiency == REALISM.bandwidth_efficiency
    step = decode_step(model.config, hw, 1, 16)
    # the realistic time moves by exactly the difference between the measured and the default overhead
    delta = realistic_time(step, hw, realism=realism) - realistic_time(step, hw)
    assert delta == pytest.approx(overhead.step_s - REALISM.step_overhead_s)
