"""Published architectures, offline, and what each layer of them caches.

`get(name)` returns a `transformers.PretrainedConfig` for a Hugging Face model id. The registry (`registry()`)
is each model's published `config.json`, stored whole in `kvlab/specs/configs/` and cited in `configs/index.json`; it
loads through `AutoConfig.from_pretrained` like a local path or a Hub id, without touching the network.

`describe(config)` reads a config the same way transformers 5.24's `DynamicCache` does (through
`transformers.cache_utils.get_layer_types_and_kwargs`) and returns, per layer, what one token adds to the cache,
and for the state layers of hybrid and state-space models (Mamba, Mamba-2, gated DeltaNet, short conv) the
fixed-size state one sequence keeps (`_STATE_FAMILIES`). A layer type or family it cannot size exactly is an
`UnsupportedConfigError`, never a guess.
Chapter: *Sizing the cache* (book/02_sizing).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvlab.checks import check_count
from kvlab.specs.layers import (
    FixedState,
    FullAttention,
    HybridLayer,
    LayerSpec,
    MLAttention,
    NoCache,
    SlidingWindowAttention,
    StateLayer,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class UnknownModelError(KeyError):
    """A model id that is neither in the registry nor loadable from the Hugging Face Hub or a local path."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class UnsupportedConfigError(ValueError):
    """A config whose cache layout kvlab cannot size exactly."""


_CONFIGS = Path(__file__).with_name("configs")


@functools.cache
def _index() -> dict[str, dict[str, Any]]:
    """configs/index.json: per model id its model_type, the published config's URL, the paper, and how the
    stored copy was checked (the file's "about" says what each status means)."""
    return json.loads((_CONFIGS / "index.json").read_text())["models"]


def registry() -> list[str]:
    """The model ids that `get` knows without a network."""
    return list(_index())


def _entry(name: str) -> dict[str, Any]:
    if name not in _index():
        raise UnknownModelError(f"{name!r} is not in the kvlab registry")
    return _index()[name]


def source(name: str) -> str:
    """The published config.json a registry entry is a copy of."""
    return _entry(name)["config"]


def image_processor(name: str) -> dict[str, Any] | None:
    """A registry image-text model's stored image-processor settings (pixel limits and their source), or None."""
    return _index().get(name, {}).get("image_processor")


def config_path(name: str) -> Path:
    """The stored copy of a registry model's published config.json (`configs/<org>--<name>.json`)."""
    _entry(name)
    return _CONFIGS / f"{name.replace('/', '--')}.json"


def get(name: str) -> PretrainedConfig:
    """A fresh config for `name`: a registry id, a local path or a Hub id, all through `AutoConfig.from_pretrained`.

    The registry and a local path answer without a network. A Hub id is asked once (`HF_HUB_ETAG_TIMEOUT`, else
    `HUB_TIMEOUT_S`; huggingface_hub's own endpoint and proxies), with no retries: a repository that does not
    exist, or a Hub that cannot be reached, is one `UnknownModelError` line at once, unless a copy is in the
    Hugging Face cache. With huggingface_hub offline (`HF_HUB_OFFLINE`) only that cache is read.
    """
    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"a model name must be a non-empty string, got {name!r}")
    if name in _index():
        return copy.deepcopy(_published(name))
    missing = None if Path(name).exists() else _hub_missing(name)
    if missing is not None:
        raise UnknownModelError(
            f"unknown model {name!r}: it is not in the kvlab registry, not a local path, and {missing}. "
            f"Known models: {', '.join(registry())}"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except Exception as err:
        raise UnknownModelError(
            f"unknown model {name!r}: AutoConfig could not load it ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). Known models: {', '.join(registry())}"
        ) from None


# Seconds the one Hub request of `get` may take when HF_HUB_ETAG_TIMEOUT is not set (huggingface_hub's own
# default is 10 s, then five retries with backoff: 27 s before an error on a machine without network).
HUB_TIMEOUT_S = 1.5


def _hub_missing(name: str) -> str | None:
    """None when the Hugging Face cache holds `name`'s config.json or the Hub serves it; else why not, for a
    one-line error. One request, no retries; offline (`HF_HUB_OFFLINE`), the cache alone."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, is_offline_mode, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except ValueError as err:
        # huggingface_hub's HFValidationError: not of the form org/name.
        return f"it is not a Hugging Face repository id ({str(err).splitlines()[0]})"
    if is_offline_mode():
        return "huggingface_hub is offline (HF_HUB_OFFLINE is set) with no cached copy"
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT", HUB_TIMEOUT_S))
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=timeout, retry_on_errors=False)
    except Exception as err:
        # huggingface_hub's errors carry the HTTP response; a transport error (no network) carries none.
        response = getattr(err, "response", None)
        if response is not None:
            return f"the Hugging Face Hub does not serve its config.json (HTTP {response.status_code})"
        return f"the Hugging Face Hub could not be reached ({type(err).__name__}) and no copy is cached"
    return None


@functools.cache
def _published(name: str) -> PretrainedConfig:
    # Parsed once (from_pretrained costs milliseconds); `get` hands out deep copies that callers may edit.
    # An index entry's "defaults" fill what the published file leaves out (GPT-2 declares no dtype); its
    # "load_as" names the transformers config class of a model_type transformers does not register (Kimi K2's
    # kimi_k2 is DeepSeek-V3's architecture).
    from transformers import CONFIG_MAPPING, AutoConfig
    from transformers.utils import logging

    entry = _index()[name]
    loader = CONFIG_MAPPING[entry["load_as"]] if "load_as" in entry else AutoConfig
    # The registry's files are checked by kvlab's tests: transformers' remarks on them (a rope field it would
    # validate otherwise, a model_type read by another class) are not the user's to act on.
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        config = loader.from_pretrained(config_path(name), **entry.get("defaults", {}))
    finally:
        logging.set_verbosity(verbosity)
    config.name_or_path = name
    return config


# Keys of a config.json that name, credit or tune a model without changing what it caches or which parameters it
# has: a config that differs from a registry config in these alone is that model, and sizes as it does
# (`registry_twin`; tests/test_registry_twin.py rebuilds every registry model with them changed).
NON_SIZING_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "architectures",
        "auto_map",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "attention_dropout",
        "hidden_dropout",
        "rms_norm_eps",
        "layer_norm_epsilon",
        "rope_theta",
        "rope_scaling",
        "quantization_config",
    }
)


def _sizing_view(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's keys less the non-sizing ones, at the top and in nested configs (text_config, ...)."""
    return {
        key: _sizing_view(value) if isinstance(value, dict) else value
        for key, value in config.items()
        if key not in NON_SIZING_KEYS
    }


def twin_candidates() -> list[str]:
    """Registry models a pasted config can be the twin of: those transformers reads from the published file
    alone (an entry's "defaults" or "load_as" is kvlab's own fix to that file)."""
    return [name for name, entry in _index().items() if "defaults" not in entry and "load_as" not in entry]


@functools.cache
def _twin_views() -> dict[str, dict[str, Any]]:
    return {name: _sizing_view(json.loads(config_path(name).read_text())) for name in twin_candidates()}


def read_config_json(path: str | Path) -> dict[str, Any] | None:
    """A config.json file's object; None for a path that is no such file (a registry name, a Hub id)."""
    if not str(path).endswith(".json") or not Path(path).is_file():
        return None
    try:
        config = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, ValueError) as err:
        raise UnsupportedConfigError(f"{path} is not JSON: {err}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise UnsupportedConfigError(f"{path} is not a model's config.json: it has no model_type")
    return config


def registry_twin(path: str | Path) -> str | None:
    """The registry model a config.json file is, differing from its published config in `NON_SIZING_KEYS` alone:
    its stored shape sizes the file without transformers (`kvlab.specs.shape.prepare`). None if there is none."""
    config = read_config_json(path)
    if config is None:
        return None
    view = _sizing_view(config)
    return next((name for name, twin in _twin_views().items() if twin == view), None)


def nearest_twin(path: str | Path) -> str:
    """For a config.json with no registry twin: the registry model of its model_type it differs from in the
    fewest keys, and those keys (up to four), in one clause."""
    config = read_config_json(path)
    if config is None:
        raise ValueError(f"{path} is not a config.json file")
    view = _sizing_view(config)

    def differing(twin: dict[str, Any]) -> list[str]:
        return sorted(k for k in view.keys() | twin.keys() if view.get(k, None) != twin.get(k, None))

    same_type = {
        n: differing(t) for n, t in _twin_views().items() if t.get("model_type") == view["model_type"]
    }
    if not same_type:
        return f"no registry model has model_type {view['model_type']!r}"
    name, keys = min(same_type.items(), key=lambda item: len(item[1]))
    shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return f"the nearest registry model, {name}, differs in {shown}"


def resolve(config: PretrainedConfig | str) -> PretrainedConfig:
    """`config` itself, or `get(config)` for a name: what every function that takes either calls first."""
    return get(config) if isinstance(config, str) else config


@dataclass(frozen=True)
class ArchSpec:
    """Per-layer cache layout of a model, plus the shape facts the book quotes."""

    name: str
    model_type: str
    layers: tuple[LayerSpec, ...]
    num_attention_heads: int
    hidden_size: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kinds(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.kind] = counts.get(layer.kind, 0) + 1
        return counts

    @property
    def kv_heads(self) -> int:
        """KV heads of the attention layers (MLA counts its single shared latent as one)."""
        return max(layer.cache_heads for layer in self.layers)

    @property
    def head_dim(self) -> int:
        return max(layer.key_dim for layer in self.layers)

    @property
    def has_state(self) -> bool:
        """Whether some layer keeps a fixed-size state per sequence (Mamba, linear attention, short conv)."""
        return any(isinstance(layer, FixedState) for layer in self.layers)

    @property
    def grows(self) -> bool:
        """Whether some layer's cache grows with the context (False if every layer slides or keeps nothing)."""
        return any(layer.max_cached_tokens is None for layer in self.layers)

    @property
    def layer_mix(self) -> str:
        """Which kinds of layer hold the cache, in a fixed order: "full", "sliding + full", "state + full", ...
        (layers that keep nothing are left out)."""
        names = {"full": "full", "sliding": "sliding window", "mla": "MLA latent", "state": "state",
                 "hybrid": "attention + state in one layer"}  # fmt: skip
        present = {layer.kind for layer in self.layers}
        if any(getattr(layer, "index_dim", 0) for layer in self.layers):
            names["mla"] = "MLA latent + sparse-attention indexer"
        return " + ".join(names[k] for k in ("state", "hybrid", "sliding", "mla", "full") if k in present)

    @property
    def attention_type(self) -> str:
        """MHA, GQA, MQA or MLA, by how query heads share KV heads ("none" for a model without attention)."""
        if "mla" in self.kinds:
            return "MLA"
        kv = self.kv_heads
        if kv == 0:
            return "none"
        if kv == self.num_attention_heads:
            return "MHA"
        return "MQA" if kv == 1 else "GQA"


def _positive(config: PretrainedConfig, field: str, value: Any) -> int:
    return check_count(f"{type(config).__name__}.{field}", value, 1, UnsupportedConfigError)


def _attention_shape(layer_config: PretrainedConfig) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) the way the modeling code reads them."""
    heads = _positive(layer_config, "num_attention_heads", layer_config.num_attention_heads)
    hidden = _positive(layer_config, "hidden_size", layer_config.hidden_size)
    if layer_config.model_type == "falcon":
        # Falcon-7B's multi_query means one KV head. The 40B/180B "new decoder" has num_kv_heads groups, but
        # transformers' Falcon broadcasts them to every query head before caching, so its cache holds `heads`.
        if layer_config.new_decoder_architecture:
            kv_heads = heads
        else:
            kv_heads = 1 if layer_config.multi_query else layer_config.num_kv_heads
    else:
        kv_heads = getattr(layer_config, "num_key_value_heads", None) or heads
    head_dim = getattr(layer_config, "head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise UnsupportedConfigError(
                f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and no head_dim is set"
            )
        head_dim = hidden // heads
    return (
        heads,
        _positive(layer_config, "num_key_value_heads", kv_heads),
        _positive(layer_config, "head_dim", head_dim),
    )


_FULL = {"full_attention"}
# DeepSeek-V3.2's sparse attention: MLA plus the indexer's own key cache (`DynamicIndexedLayer`)
_INDEXED = {"indexed_attention"}
_SLIDING = {"sliding_attention", "chunked_attention"}
# transformers' `DummyLayer` (and "moe"/"mlp", which get_layer_types_and_kwargs renames to "dummy"): no cache.
_NONE = {"dummy"}
# Layer types transformers 5.24 gives a `LinearAttentionLayer` ("conv", "linear_attention") or a linear-attention
# state beside a dynamic attention layer ("hybrid"): sized only for the families of `_STATE_FAMILIES`.
_STATE = {"conv", "linear_attention"}
_HYBRID = {"hybrid"}


def _field(config: PretrainedConfig, name: str) -> int:
    """A positive int field of `config`, or a one-line UnsupportedConfigError naming it."""
    if not hasattr(config, name):
        raise UnsupportedConfigError(
            f"{config.model_type!r} config has no {name!r}, which its state size needs"
        )
    return _positive(config, name, getattr(config, name))


def _factor(config: PretrainedConfig, name: str) -> float:
    """A positive number field of `config` (an expansion factor), or a one-line UnsupportedConfigError."""
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise UnsupportedConfigError(
            f"{config.model_type!r} config: {name} must be a positive number, got {value!r}"
        )
    return value


def _mamba2_state(
    intermediate: int, heads: int, head_dim: int, groups: int, d_state: int, kernel: int
) -> tuple[int, int, tuple[int, ...]]:
    # Mamba-2 mixers convolve x, B and C together: conv_dim = intermediate + 2 × n_groups × d_state, and keep
    # one (head_dim × d_state) SSM state per head (`conv_dim`, `mamba2_chunk_scan`'s final state).
    return intermediate + 2 * groups * d_state, kernel, (heads, head_dim, d_state)


def _mamba_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/mamba/modeling_mamba.py: MambaMixer.intermediate_size = config.intermediate_size (expand × hidden).
    inner = _field(c, "intermediate_size")
    return inner, _field(c, "conv_kernel"), (inner, _field(c, "state_size"))


def _jamba_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/jamba/modeling_jamba.py: JambaMambaMixer, intermediate = mamba_expand × hidden_size.
    inner = int(_factor(c, "mamba_expand") * _field(c, "hidden_size"))
    return inner, _field(c, "mamba_d_conv"), (inner, _field(c, "mamba_d_state"))


def _mamba2_family_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/mamba2/modeling_mamba2.py: Mamba2Mixer, intermediate = int(expand × hidden_size).
    return _mamba2_state(
        int(_factor(c, "expand") * _field(c, "hidden_size")),
        _field(c, "num_heads"),
        _field(c, "head_dim"),
        _field(c, "n_groups"),
        _field(c, "state_size"),
        _field(c, "conv_kernel"),
    )


def _bamba_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/bamba/modeling_bamba.py and models/granitemoehybrid/modeling_granitemoehybrid.py: the Mamba-2 mixer
    # with intermediate = int(mamba_expand × hidden_size).
    return _mamba2_state(
        int(_factor(c, "mamba_expand") * _field(c, "hidden_size")),
        _field(c, "mamba_n_heads"),
        _field(c, "mamba_d_head"),
        _field(c, "mamba_n_groups"),
        _field(c, "mamba_d_state"),
        _field(c, "mamba_d_conv"),
    )


def _nemotron_h_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/nemotron_h/modeling_nemotron_h.py: NemotronHMamba2Mixer, intermediate = heads × head_dim.
    heads, head_dim = _field(c, "mamba_num_heads"), _field(c, "mamba_head_dim")
    return _mamba2_state(
        heads * head_dim,
        heads,
        head_dim,
        _field(c, "n_groups"),
        _field(c, "ssm_state_size"),
        _field(c, "conv_kernel"),
    )


def _falcon_h1_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/falcon_h1/modeling_falcon_h1.py: FalconH1Mixer, intermediate = mamba_d_ssm, else mamba_expand × hidden.
    d_ssm = getattr(c, "mamba_d_ssm", None)
    inner = (
        int(_factor(c, "mamba_expand") * _field(c, "hidden_size"))
        if d_ssm is None
        else _field(c, "mamba_d_ssm")
    )
    return _mamba2_state(
        inner,
        _field(c, "mamba_n_heads"),
        _field(c, "mamba_d_head"),
        _field(c, "mamba_n_groups"),
        _field(c, "mamba_d_state"),
        _field(c, "mamba_d_conv"),
    )


def _zamba2_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/zamba2/modeling_zamba2.py: Zamba2MambaMixer, intermediate = int(mamba_expand × hidden_size).
    return _mamba2_state(
        int(_factor(c, "mamba_expand") * _field(c, "hidden_size")),
        _field(c, "n_mamba_heads"),
        _field(c, "mamba_headdim"),
        _field(c, "mamba_ngroups"),
        _field(c, "mamba_d_state"),
        _field(c, "mamba_d_conv"),
    )


def _qwen3_next_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/qwen3_next/modeling_qwen3_next.py: Qwen3NextGatedDeltaNet convolves q, k and v together
    # (conv_dim = 2 × key heads × key dim + value heads × value dim) and keeps one (key dim × value dim)
    # delta-rule state per value head.
    k_heads, k_dim = _field(c, "linear_num_key_heads"), _field(c, "linear_key_head_dim")
    v_heads, v_dim = _field(c, "linear_num_value_heads"), _field(c, "linear_value_head_dim")
    return 2 * k_heads * k_dim + v_heads * v_dim, _field(c, "linear_conv_kernel_dim"), (v_heads, k_dim, v_dim)


def _lfm2_state(c: PretrainedConfig) -> tuple[int, int, tuple[int, ...]]:
    # models/lfm2/modeling_lfm2.py: Lfm2ShortConv caches the last conv_L_cache inputs B·x, hidden_size channels;
    # no recurrent state.
    return _field(c, "hidden_size"), _field(c, "conv_L_cache"), ()


# model_type -> (the layer types whose state kvlab sizes, the reader of one layer's state). Every entry is checked
# against the cache object of a forward, in fp32 and bf16, by tests/test_state_sizing.py (transformers 5.24).
_STATE_FAMILIES: dict[
    str, tuple[frozenset[str], Callable[[PretrainedConfig], tuple[int, int, tuple[int, ...]]]]
] = {
    "mamba": (frozenset({"linear_attention"}), _mamba_state),
    "jamba": (frozenset({"linear_attention"}), _jamba_state),
    "mamba2": (frozenset({"linear_attention"}), _mamba2_family_state),
    "bamba": (frozenset({"linear_attention"}), _bamba_state),
    "granitemoehybrid": (frozenset({"linear_attention"}), _bamba_state),
    "nemotron_h": (frozenset({"linear_attention"}), _nemotron_h_state),
    "falcon_h1": (frozenset({"hybrid"}), _falcon_h1_state),
    "zamba2": (frozenset({"linear_attention", "hybrid"}), _zamba2_state),
    "qwen3_next": (frozenset({"linear_attention"}), _qwen3_next_state),
    "lfm2": (frozenset({"conv"}), _lfm2_state),
}


def _state_of(
    model_type: str, index: int, layer_type: str, kwargs: dict[str, Any], layer_config: PretrainedConfig
) -> tuple[int, int, tuple[int, ...]]:
    """(conv channels, conv kernel, recurrent shape) of one state layer, or a one-line UnsupportedConfigError."""
    family = _STATE_FAMILIES.get(model_type)
    if family is None or layer_type not in family[0]:
        raise UnsupportedConfigError(
            f"layer {index} of {model_type!r} has type {layer_type!r}, a fixed-size state kvlab cannot size for "
            f"this model type (sized: {', '.join(sorted(_STATE_FAMILIES))})"
        )
    if kwargs.get("number_of_states", 1) != 1:
        raise UnsupportedConfigError(
            f"layer {index} of {model_type!r} ({layer_type!r}) keeps {kwargs['number_of_states']} states; "
            "kvlab sizes one"
        )
    return family[1](layer_config)


def describe(config: PretrainedConfig | str) -> ArchSpec:
    """Per-layer attention kind, KV heads and head dim of `config` (a config object or a registry name), and the
    fixed-size state of its state layers."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = resolve(config)
    text = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    # A pure state-space model (Mamba) has no attention heads to read.
    attends = any(t in _FULL | _SLIDING | _HYBRID | _INDEXED for t in layer_types) or not layer_types
    layer_configs = text.per_layer_config
    # Query heads from the first attending layer's own config: a heterogeneous config (Gemma 4) refuses to give
    # a per-layer field such as head_dim globally
    attending = [c for t, c in zip(layer_types, layer_configs, strict=True) if t not in _NONE | _STATE]
    heads = _attention_shape(attending[0] if attending else text)[0] if attends else 0
    mla = getattr(text, "kv_lora_rank", None) is not None
    layers: list[LayerSpec] = []
    for index, (layer_type, kwargs, layer_config) in enumerate(
        zip(layer_types, layer_kwargs, layer_configs, strict=True)
    ):
        if layer_type in _NONE:
            layers.append(NoCache())
            continue
        if layer_type in _STATE | _HYBRID:
            conv_channels, conv_kernel, recurrent = _state_of(
                text.model_type, index, layer_type, kwargs, layer_config
            )
            if layer_type in _STATE:
                layers.append(StateLayer(conv_channels, conv_kernel, recurrent))
            else:
                _, kv_heads, head_dim = _attention_shape(layer_config)
                layers.append(
                    HybridLayer(kv_heads, head_dim, head_dim, conv_channels, conv_kernel, recurrent)
                )
            continue
        if layer_type not in _FULL | _SLIDING | (_INDEXED if mla else set()):
            raise UnsupportedConfigError(
                f"layer {index} of {text.model_type!r} has type {layer_type!r}, whose cache layout kvlab cannot size"
            )
        if mla:
            if layer_type not in _FULL | _INDEXED:
                raise UnsupportedConfigError(f"layer {index}: MLA with {layer_type!r} is not supported")
            n_heads = _positive(layer_config, "num_attention_heads", layer_config.num_attention_heads)
            indexer: dict[str, Any] = {}
            if layer_type in _INDEXED:
                indexer = dict(
                    index_dim=_positive(
                        layer_config, "index_head_dim", getattr(layer_config, "index_head_dim", None)
                    ),
                    index_heads=_positive(
                        layer_config, "index_n_heads", getattr(layer_config, "index_n_heads", None)
                    ),
                    index_topk=_positive(
                        layer_config, "index_topk", getattr(layer_config, "index_topk", None)
                    ),
                )
            layers.append(
                MLAttention(
                    num_heads=n_heads,
                    qk_head_dim=layer_config.qk_nope_head_dim + layer_config.qk_rope_head_dim,
                    v_head_dim=layer_config.v_head_dim,
                    latent_dim=_positive(layer_config, "kv_lora_rank", layer_config.kv_lora_rank),
                    rope_dim=_positive(layer_config, "qk_rope_head_dim", layer_config.qk_rope_head_dim),
                    **indexer,
                )
            )
            continue
        _, kv_heads, head_dim = _attention_shape(layer_config)
        if layer_type in _SLIDING:
            try:
                layers.append(
                    SlidingWindowAttention(kv_heads, head_dim, head_dim, window=kwargs["sliding_window"])
                )
            except ValueError as err:
                raise UnsupportedConfigError(f"layer {index}: {err}") from None
        else:
            layers.append(FullAttention(kv_heads, head_dim, head_dim))
    return ArchSpec(
        name=getattr(config, "name_or_path", "") or text.model_type,
        model_type=text.model_type,
        layers=tuple(layers),
        num_attention_heads=heads,
        hidden_size=text.hidden_size,
    )


_T = TypeVar("_T")


def config_cache(fn: Callable[[PretrainedConfig], _T]) -> Callable[[PretrainedConfig], _T]:
    """Memoise a pure function of a config, keyed by the config's full JSON (configs are mutable, so unhashable).

    The wrapped function receives the config object itself; nothing is rebuilt from JSON.
    """
    cache: dict[tuple[str, str], _T] = {}

    @functools.wraps(fn)
    def cached(config: PretrainedConfig) -> _T:
        key = (config.model_type, config.to_json_string(use_diff=False))
        if key not in cache:
            if len(cache) >= 128:
                cache.pop(next(iter(cache)))  # oldest first
            cache[key] = fn(config)
        return cache[key]

    return cached
