"""Published architectures, offline, and what each layer of them caches.

`get_config(name)` returns a `transformers.PretrainedConfig` for a Hugging Face model id without touching the
network. The values below are copied field by field from each model's published `config.json`; only the fields
that shape the model are kept (tokenizer ids, dropout and similar are left at their defaults).

`describe(config)` reads a config the same way transformers 5.24's `DynamicCache` does (through
`transformers.cache_utils.get_layer_types_and_kwargs`) and returns, per layer, what one token adds to the cache.
Chapter: *Sizing the cache* (book/02_sizing).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from kvlab.layers import FullAttention, LayerSpec, MLAttention, NoCache, SlidingWindowAttention


class UnknownModelError(KeyError):
    """A model id that is neither in the registry nor loadable from the Hugging Face Hub or a local path."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class UnsupportedConfigError(ValueError):
    """A config whose cache layout kvlab cannot size exactly."""


def _hf(name: str) -> str:
    return f"https://huggingface.co/{name}/blob/main/config.json"


# Each entry: model id -> (model_type, config fields). The source of each is the config.json at _hf(model id),
# read on the dates the models were published; gated repositories (Llama) show the same file after sign-in.
_REGISTRY: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 2 (Touvron et al., 2023, arXiv:2307.09288), config.json of each checkpoint.
    "meta-llama/Llama-2-7b-hf": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            dtype="float16",
        ),
    ),
    "meta-llama/Llama-2-13b-hf": (
        "llama",
        dict(
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
            vocab_size=32000,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            dtype="float16",
        ),
    ),
    "meta-llama/Llama-2-70b-hf": (
        "llama",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            dtype="float16",
        ),
    ),
    # Llama 3.1 (Llama Team, 2024, arXiv:2407.21783), config.json of each checkpoint.
    "meta-llama/Llama-3.1-8B": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    "meta-llama/Llama-3.1-70B": (
        "llama",
        dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    "meta-llama/Llama-3.1-405B": (
        "llama",
        dict(
            hidden_size=16384,
            intermediate_size=53248,
            num_hidden_layers=126,
            num_attention_heads=128,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # Mistral 7B (Jiang et al., 2023, arXiv:2310.06825): 4096-token sliding window on every layer.
    "mistralai/Mistral-7B-v0.1": (
        "mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            sliding_window=4096,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # Mixtral 8x7B (Jiang et al., 2024, arXiv:2401.04088): sliding_window is null in the released config.
    "mistralai/Mixtral-8x7B-v0.1": (
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            sliding_window=None,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            rope_theta=1e6,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # Qwen2.5 (Qwen Team, 2024, arXiv:2412.15115): use_sliding_window is false, so every layer is full.
    "Qwen/Qwen2.5-0.5B": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            use_sliding_window=False,
            sliding_window=32768,
            max_window_layers=24,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=True,
            dtype="bfloat16",
        ),
    ),
    "Qwen/Qwen2.5-7B": (
        "qwen2",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=131072,
            use_sliding_window=False,
            sliding_window=131072,
            max_window_layers=28,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    "Qwen/Qwen2.5-72B": (
        "qwen2",
        dict(
            hidden_size=8192,
            intermediate_size=29568,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=152064,
            max_position_embeddings=131072,
            use_sliding_window=False,
            sliding_window=131072,
            max_window_layers=80,
            rms_norm_eps=1e-5,
            rope_theta=1e6,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # Qwen3 (Qwen Team, 2025, arXiv:2505.09388): explicit head_dim=128.
    "Qwen/Qwen3-8B": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # Gemma 2 (Gemma Team, 2024, arXiv:2408.00118): local (4096 window) and global layers alternate; head_dim 256.
    "google/gemma-2-9b": (
        "gemma2",
        dict(
            hidden_size=3584,
            intermediate_size=14336,
            num_hidden_layers=42,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            rms_norm_eps=1e-6,
            dtype="bfloat16",
        ),
    ),
    # Gemma 3 (Gemma Team, 2025, arXiv:2503.19786): five local layers (1024 window) per global layer.
    # The -it checkpoint is the image-text model; only its text decoder holds a KV cache.
    "google/gemma-3-27b-it": (
        "gemma3",
        dict(
            text_config=dict(
                hidden_size=5376,
                intermediate_size=21504,
                num_hidden_layers=62,
                num_attention_heads=32,
                num_key_value_heads=16,
                head_dim=128,
                vocab_size=262208,
                max_position_embeddings=131072,
                sliding_window=1024,
                sliding_window_pattern=6,
                query_pre_attn_scalar=168,
                rms_norm_eps=1e-6,
                rope_theta=1e6,
                rope_local_base_freq=10000.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0},
            ),
            vision_config=dict(
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                image_size=896,
                patch_size=14,
                vision_use_head=False,
            ),
            mm_tokens_per_image=256,
            dtype="bfloat16",
        ),
    ),
    # Falcon-7B (Almazrouei et al., 2023, arXiv:2311.16867): multi-query attention, one KV head for 71 query heads.
    "tiiuae/falcon-7b": (
        "falcon",
        dict(
            hidden_size=4544,
            num_hidden_layers=32,
            num_attention_heads=71,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            bias=False,
            alibi=False,
            vocab_size=65024,
            dtype="bfloat16",
        ),
    ),
    # OPT-13B (Zhang et al., 2022, arXiv:2205.01068): multi-head attention.
    "facebook/opt-13b": (
        "opt",
        dict(
            hidden_size=5120,
            ffn_dim=20480,
            num_hidden_layers=40,
            num_attention_heads=40,
            vocab_size=50272,
            max_position_embeddings=2048,
            word_embed_proj_dim=5120,
            do_layer_norm_before=True,
            dtype="float16",
        ),
    ),
    # GPT-2 small (Radford et al., 2019).
    "openai-community/gpt2": (
        "gpt2",
        dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024, dtype="float32"),
    ),
    # Phi-3-mini-4k (Abdin et al., 2024, arXiv:2404.14219). Its config declares sliding_window=2047, which
    # transformers honours on every layer.
    "microsoft/Phi-3-mini-4k-instruct": (
        "phi3",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32064,
            max_position_embeddings=4096,
            original_max_position_embeddings=4096,
            sliding_window=2047,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            pad_token_id=32000,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # DeepSeek-V2-Lite (DeepSeek-AI, 2024, arXiv:2405.04434): multi-head latent attention, no query LoRA.
    "deepseek-ai/DeepSeek-V2-Lite": (
        "deepseek_v2",
        dict(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            topk_method="greedy",
            vocab_size=102400,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # DeepSeek-V3 (DeepSeek-AI, 2024, arXiv:2412.19437). transformers does not build the multi-token-prediction
    # module, so the count is the 671B main model.
    "deepseek-ai/DeepSeek-V3": (
        "deepseek_v3",
        dict(
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            n_group=8,
            topk_group=4,
            vocab_size=129280,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
    # TinyLlama 1.1B (Zhang et al., 2024, arXiv:2401.02385).
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            dtype="bfloat16",
        ),
    ),
}


def registry() -> list[str]:
    """The model ids that `get_config` knows without a network."""
    return list(_REGISTRY)


def source(name: str) -> str:
    """Where a registry entry's numbers come from."""
    if name not in _REGISTRY:
        raise UnknownModelError(f"{name!r} is not in the kvlab registry")
    return _hf(name)


def get_config(name: str) -> PretrainedConfig:
    """A fresh config for `name`: from the offline registry, else from `AutoConfig` (Hub id or local path)."""
    if not isinstance(name, str) or not name:
        raise UnknownModelError(f"a model name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        model_type, fields = _REGISTRY[name]
        config = AutoConfig.for_model(model_type, **_deepcopy(fields))
        config.name_or_path = name
        return config
    if os.path.isdir(name) or _hub_reachable():
        try:
            return AutoConfig.from_pretrained(name)
        except Exception as err:
            reason = f"AutoConfig could not load it ({type(err).__name__})"
    else:
        reason = "the Hugging Face Hub is unreachable (offline), so only the registry and local paths work"
    raise UnknownModelError(
        f"unknown model {name!r}: it is not in the kvlab registry and {reason}. Known models: {', '.join(_REGISTRY)}"
    )


def _hub_reachable(timeout: float = 2.0) -> bool:
    """Fail fast offline: huggingface_hub would otherwise retry a dead connection for ~20 s."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _deepcopy(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in fields.items()}


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
    def grows(self) -> bool:
        """Whether some layer's cache grows with the context (False if every layer slides or keeps nothing)."""
        return any(layer.max_cached_tokens is None for layer in self.layers)

    @property
    def attention_type(self) -> str:
        """MHA, GQA, MQA or MLA, by how query heads share KV heads."""
        if "mla" in self.kinds:
            return "MLA"
        kv = self.kv_heads
        if kv == self.num_attention_heads:
            return "MHA"
        return "MQA" if kv == 1 else "GQA"


def _resolve(config: PretrainedConfig | str) -> PretrainedConfig:
    return get_config(config) if isinstance(config, str) else config


def _positive(config: PretrainedConfig, field: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedConfigError(
            f"{type(config).__name__}.{field} must be a positive integer to size the cache, got {value!r}"
        )
    return value


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
_SLIDING = {"sliding_attention", "chunked_attention"}
_NONE = {"dummy", "linear_attention", "conv", "mamba", "recurrent"}


def describe(config: PretrainedConfig | str) -> ArchSpec:
    """Per-layer attention kind, KV heads and head dim of `config` (a config object or a registry name)."""
    config = _resolve(config)
    text = config.get_text_config(decoder=True)
    heads, _, _ = _attention_shape(text)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    layer_configs = text.per_layer_config
    mla = getattr(text, "kv_lora_rank", None) is not None
    layers = []
    for index, (layer_type, kwargs, layer_config) in enumerate(
        zip(layer_types, layer_kwargs, layer_configs, strict=True)
    ):
        if layer_type in _NONE:
            layers.append(NoCache())
            continue
        if layer_type not in _FULL | _SLIDING:
            raise UnsupportedConfigError(
                f"layer {index} of {text.model_type!r} has type {layer_type!r}, whose cache layout kvlab cannot size"
            )
        if mla:
            if layer_type != "full_attention":
                raise UnsupportedConfigError(f"layer {index}: MLA with {layer_type!r} is not supported")
            n_heads = _positive(layer_config, "num_attention_heads", layer_config.num_attention_heads)
            layers.append(
                MLAttention(
                    num_heads=n_heads,
                    qk_head_dim=layer_config.qk_nope_head_dim + layer_config.qk_rope_head_dim,
                    v_head_dim=layer_config.v_head_dim,
                    latent_dim=_positive(layer_config, "kv_lora_rank", layer_config.kv_lora_rank),
                    rope_dim=_positive(layer_config, "qk_rope_head_dim", layer_config.qk_rope_head_dim),
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
