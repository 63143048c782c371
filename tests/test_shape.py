"""The stored shapes of the registry are what transformers gives for each registry config."""

import json

import pytest

from kvlab.specs import arch, shape, sizing


@pytest.mark.parametrize("name", arch.registry())
def test_stored_shape_is_the_one_transformers_gives(name):
    stored = json.loads(shape.SHAPES.read_text())["models"][name]
    assert stored == json.loads(json.dumps(shape._encode(arch.get(name)))), (
        f"configs/shapes.json is stale for {name}: run python -m kvlab.specs.shape"
    )
    assert shape.shape(name).spec == arch.describe(arch.get(name))
    assert set(json.loads(shape.SHAPES.read_text())["models"]) == set(arch.registry())


def test_a_config_object_is_measured_not_looked_up():
    config = arch.get("Qwen/Qwen2.5-0.5B")
    config.num_hidden_layers = 2
    config.layer_types = config.layer_types[:2]
    assert shape.shape(config).spec.num_layers == 2
    assert sizing.param_count(config) < sizing.param_count("Qwen/Qwen2.5-0.5B")


def test_prepare_keeps_registry_names_and_configs():
    config = arch.get("meta-llama/Llama-3.1-8B")
    assert shape.prepare("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert shape.prepare(config) is config
