"""What sizing reads from a model's config, and its parameters grouped the way GPUs shard them: `ModelShape`.

`kvlab.specs.sizing` and `kvlab.costs.budget` compute every byte from a `ModelShape` and the model's `WeightGroup`s. For a
config object both come from transformers (`kvlab.specs.arch.describe`, and the parameters of the model built on the
`meta` device). For a registry name they are read from `configs/shapes.json`, which holds exactly what that
computation gives for each registry config, so that `kvlab size` of a registry model imports neither torch nor
transformers. The tests recompute every entry; `python -m kvlab.specs.shape` rewrites the file after a registry or
sizing change.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from kvlab.specs import arch
from kvlab.specs.arch import ArchSpec, config_cache
from kvlab.specs.layers import (
    FullAttention,
    HybridLayer,
    LayerSpec,
    MLAttention,
    NoCache,
    SlidingWindowAttention,
    StateLayer,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# A string alias: torch is imported by the functions that build a model on the meta device, not here.
DType: TypeAlias = "torch.dtype | str | None"

SHAPES = Path(__file__).with_name("configs") / "shapes.json"

# Outside the decoder layers, which pipeline stage holds a tensor: the first, the last, or both (a tied table).
Placement = int | Literal["first", "last", "both"]
# How tensor parallelism shards it: split `tp` ways, whole on every rank, K/V heads (copied past the KV-head
# count), or vocabulary rows (split only with a vocab-parallel embedding).
Sharding = Literal["split", "replicated", "kv", "vocab"]

_VOCAB = ("embed_tokens", "lm_head", "wte", "word_embeddings", "embed_out")
_REPLICATED = ("norm", "ln_", "layernorm", "q_a_proj", "kv_a_proj", "wpe", "embed_positions")
_ROW_PARALLEL_BIAS = (
    "o_proj.bias",
    "down_proj.bias",
    "dense.bias",
    "c_proj.bias",
    "out_proj.bias",
    "fc2.bias",
)
_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")
_LAYER_KINDS: dict[str, type[LayerSpec]] = {
    cls.kind: cls
    for cls in (FullAttention, SlidingWindowAttention, MLAttention, StateLayer, HybridLayer, NoCache)
}


@dataclass(frozen=True)
class ModelShape:
    """The config's facts that sizing reads: the per-layer cache layout and the widths of the forward."""

    spec: ArchSpec
    dtype: DType  # the declared dtype, else bf16 (`config_dtype`); a name once stored

    hidden_size: int
    mlp_width: int | None  # an expert's width for MoE models (moe_intermediate_size), else intermediate_size
    experts_per_token: int
    vocab_size: int
    max_context: int | None  # max_position_embeddings (n_positions for GPT-2)


@dataclass(frozen=True)
class WeightGroup:
    """Parameters of one placement and one sharding rule, summed."""

    placement: Placement  # a decoder layer's index, or a stage outside the layers
    sharding: Sharding
    elements: int


def prepare(config: PretrainedConfig | str) -> PretrainedConfig | str:
    """What a function that sizes one model several ways passes on: a config or a registry name as they are
    (the name's shape is stored), another name loaded once (`kvlab.specs.arch.get`). A config.json file that
    is a registry model but for its non-sizing keys is that model's name (`kvlab.specs.arch.registry_twin`), so
    that it too sizes without torch or transformers."""
    if isinstance(config, str) and config not in _stored():
        twin = arch.registry_twin(config)
        if twin is not None and twin in _stored():
            return twin
    found = _lookup(config)
    return config if isinstance(found, tuple) else found


def shape(config: PretrainedConfig | str) -> ModelShape:
    """The shape of a config, or of a registry name (stored) or another name (`kvlab.specs.arch.get`)."""
    found = _lookup(config)
    return found[0] if isinstance(found, tuple) else _from_config(found)


def weight_groups(config: PretrainedConfig | str) -> tuple[WeightGroup, ...]:
    """A model's parameters grouped by placement and sharding (`kvlab.specs.sizing.weight_bytes_per_stage`)."""
    found = _lookup(config)
    return found[1] if isinstance(found, tuple) else _weight_groups(found)


def _lookup(config: PretrainedConfig | str) -> tuple[ModelShape, tuple[WeightGroup, ...]] | PretrainedConfig:
    """A registry name's stored shape and weight groups; else the config, loaded for another name."""
    if isinstance(config, str):
        return _stored().get(config) or arch.get(config)
    return config


def config_dtype(config: PretrainedConfig) -> DType:
    """The dtype a config declares, else bf16 (what serving stacks default to for these models)."""
    declared = getattr(config.get_text_config(decoder=True), "dtype", None) or getattr(config, "dtype", None)
    return declared if declared is not None else "bf16"


def _from_config(config: PretrainedConfig) -> ModelShape:
    text = config.get_text_config(decoder=True)
    return ModelShape(
        spec=arch.describe(config),
        dtype=config_dtype(config),
        hidden_size=text.hidden_size,
        mlp_width=getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", None),
        experts_per_token=getattr(text, "num_experts_per_tok", None) or 1,
        vocab_size=text.vocab_size,
        max_context=getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None),
    )


@config_cache
def _weight_groups(config: PretrainedConfig) -> tuple[WeightGroup, ...]:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # e.g. image-text configs with no causal-LM head class registered
            model = AutoModel.from_config(config)
    has_kv_heads = bool(arch.describe(config).kv_heads)
    tied = bool(getattr(config.get_text_config(decoder=True), "tie_word_embeddings", False))
    totals: dict[tuple[Placement, Sharding], int] = {}
    # Tied embeddings are one tensor; named_parameters() yields it once.
    for name, p in model.named_parameters():
        key = (_placement(name, tied), _sharding(name, has_kv_heads))
        totals[key] = totals.get(key, 0) + p.numel()
    return tuple(WeightGroup(placement, sharding, n) for (placement, sharding), n in totals.items())


def _placement(name: str, tied: bool) -> Placement:
    match = _LAYER_INDEX.search(name)
    if match is not None:
        return int(match.group(1))
    if any(key in name for key in ("lm_head", "embed_out")) or ("norm" in name or "ln_f" in name):
        return "last"
    if tied and any(key in name for key in _VOCAB):
        return "both"
    return "first"


def _sharding(name: str, has_kv_heads: bool) -> Sharding:
    if any(key in name for key in _VOCAB):
        return "vocab"
    if (
        any(key in name for key in _REPLICATED)
        or name.endswith(_ROW_PARALLEL_BIAS)
        or name.endswith(".gate.weight")
    ):
        return "replicated"
    if any(key in name for key in ("k_proj", "v_proj")) and has_kv_heads:
        return "kv"
    return "split"


@functools.cache
def _stored() -> dict[str, tuple[ModelShape, tuple[WeightGroup, ...]]]:
    if not SHAPES.is_file():
        return {}
    return {name: _decode(entry) for name, entry in json.loads(SHAPES.read_text())["models"].items()}


def _encode(config: PretrainedConfig) -> dict[str, Any]:
    s = _from_config(config)
    spec = dataclasses.asdict(s.spec) | {
        "layers": [{"kind": layer.kind, **dataclasses.asdict(layer)} for layer in s.spec.layers]
    }
    groups = [[g.placement, g.sharding, g.elements] for g in _weight_groups(config)]
    dtype = str(s.dtype).removeprefix("torch.")
    return dataclasses.asdict(s) | {"spec": spec, "dtype": dtype, "weights": groups}


def _decode(entry: dict[str, Any]) -> tuple[ModelShape, tuple[WeightGroup, ...]]:
    spec = dict(entry["spec"])
    layers = tuple(
        _LAYER_KINDS[layer["kind"]](**{k: v for k, v in layer.items() if k != "kind"})
        for layer in spec["layers"]
    )
    fields = {k: v for k, v in entry.items() if k != "weights"}
    model_shape = ModelShape(**(fields | {"spec": ArchSpec(**(spec | {"layers": layers}))}))
    return model_shape, tuple(WeightGroup(*group) for group in entry["weights"])


def write_registry_shapes(path: Path = SHAPES) -> None:
    """Recompute every registry model's shape and weight groups from transformers and store them in `path`."""
    models = {name: _encode(arch.get(name)) for name in arch.registry()}
    about = "kvlab.specs.shape: each registry config's ModelShape and WeightGroups; rewrite with python -m kvlab.specs.shape"
    # One model a line, so that a change to one config shows as one changed line.
    lines = [
        f" {json.dumps(name)}: {json.dumps(entry, separators=(',', ':'))}" for name, entry in models.items()
    ]
    path.write_text(f'{{"about": {json.dumps(about)}, "models": {{\n' + ",\n".join(lines) + "\n}}\n")
    _stored.cache_clear()


if __name__ == "__main__":
    write_registry_shapes()
