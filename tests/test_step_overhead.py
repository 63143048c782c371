"""kvlab.experiments.timing.measure_step_overhead: the fixed per-step cost, measured on a hollow twin of the model."""

import math

import pytest
from transformers import PretrainedConfig

from kvlab.costs.roofline import REALISM, Realism, decode_step, realistic_time
from kvlab.experiments import timing
from kvlab.experiments.timing import hollow_config, measure_step_overhead
from kvlab.models import tiny_model
from kvlab.specs import hardware


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
    assert overhead.layers == 2 and 0 <= overhead.bound_s < overhead.timing.best_s
    assert overhead.step_s == pytest.approx(overhead.timing.best_s - overhead.bound_s)
    assert overhead.per_layer_s == pytest.approx(overhead.step_s / 2)
    realism = overhead.realism()
    assert realism.step_overhead_s == overhead.step_s
    assert realism.bandwidth_efficiency == REALISM.bandwidth_efficiency
    step = decode_step(model.config, hw, 1, 16)
    # the realistic time moves by exactly the difference between the measured and the default overhead
    delta = realistic_time(step, hw, realism=realism) - realistic_time(step, hw)
    assert delta == pytest.approx(overhead.step_s - REALISM.step_overhead_s)


# A measured device with round figures, so the predictions below are exact arithmetic (no timing involved).
FAKE_DEVICE = hardware.Measurement(
    name="fake device",
    memory_bytes=2**34,
    bandwidth_bytes_per_s=10e9,
    flops=40e9,
    flops_dtype="float32",
    host_link_bytes_per_s=None,
    copy_bytes=2**28,
    matmul_size=1024,
)


def test_compare_decode_adds_the_measured_overhead_to_the_roofline():
    model = tiny_model("llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, device="cpu")
    realism = Realism(step_overhead_s=2e-3)
    bare, real = (
        timing.compare_decode(model, FAKE_DEVICE, [1, 2], [8], repeat=2, warmup=0, realism=r)
        for r in (None, realism)
    )
    for b, r in zip(bare, real, strict=True):
        assert b.predicted_s is None and b.prediction_s == b.predicted.time_s
        step = r.predicted
        # a measured device's ceilings are used whole: max(FLOPs / peak, bytes / bandwidth) + overhead, plus
        # the DynamicCache's append copy (the cache read and written anew) at the bandwidth
        expected = max(step.flops / 40e9, step.bytes / 10e9) + 2e-3 + 2 * step.kv_bytes / 10e9
        assert r.prediction_s == pytest.approx(expected)
        assert r.best_ratio == r.measured.best_s / expected and r.ratio == r.measured.median_s / expected
        assert r.overhead_s == 2e-3 and r.work_s == pytest.approx(expected - 2e-3)


def test_rounds_collect_repeat_steps_per_round_at_every_point():
    model = tiny_model("llama", layers=2, hidden=64, heads=4, vocab=256, device="cpu")
    rows = timing.compare_decode(model, FAKE_DEVICE, [1, 3], [4, 9], repeat=2, warmup=1, rounds=3)
    assert [(r.measured.batch_size, r.measured.tokens) for r in rows] == [(1, 4), (1, 9), (3, 4), (3, 9)]
    assert all(len(r.measured.seconds) == 6 for r in rows)
    with pytest.raises(ValueError, match="rounds"):
        timing.compare_decode(model, FAKE_DEVICE, [1], [4], rounds=0)


def test_best_ratio_uses_the_fastest_step():
    step = decode_step("meta-llama/Llama-3.1-8B", "H100-SXM", 1, 1024, dtype="bf16")
    row = timing.DecodeComparison(timing.StepTiming(1, 1024, (3.0, 1.0, 2.0)), step, predicted_s=0.5)
    assert (row.best_ratio, row.ratio) == (2.0, 4.0)
