"""Real Hugging Face causal LMs for the labs: tiny random ones offline, real checkpoints when online.

`tiny_model` builds the same transformers classes a real checkpoint uses (so the attention code and the
`DynamicCache` are the real ones), only with few layers, small widths and seeded random weights.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvlab.env import pick_device

FAMILIES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
    "falcon", "opt", "gpt2", "deepseek_v2", "deepseek_v3",
)  # fmt: skip
_SLIDING_FAMILIES = {"mistral", "mixtral", "qwen2", "gemma2", "gemma3_text", "phi3"}
_MHA_ONLY = {"opt", "gpt2"}
_HEAD_DIM_FAMILIES = {"llama", "mistral", "mixtral", "qwen3", "gemma2", "gemma3_text"}


def tiny_config(
    family: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    window: int | None = None,
    vocab: int = 256,
    intermediate: int | None = None,
    max_positions: int = 4096,
    latent: int = 32,
    rope_dim: int = 8,
    **overrides: Any,
) -> PretrainedConfig:
    """A small config of a real architecture family.

    `kv_heads` defaults to `heads` (MHA). `window` turns on sliding-window attention for the families that have
    it (for Gemma 2 and 3, on their local layers only). `latent` and `rope_dim` are MLA's kv_lora_rank and
    qk_rope_head_dim (DeepSeek families). Any other config field can be set through `overrides`.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    for name, value in dict(layers=layers, hidden=hidden, heads=heads, vocab=vocab).items():
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must be positive and divide heads={heads}")
    if head_dim is None and hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads} (or pass head_dim)")
    if head_dim is not None and family not in _HEAD_DIM_FAMILIES | {"deepseek_v2", "deepseek_v3"}:
        raise ValueError(f"{family} derives head_dim from hidden/heads; pass hidden and heads instead")
    if window is not None and family not in _SLIDING_FAMILIES:
        raise ValueError(f"{family} has no sliding-window attention; window must be None")
    if family in _MHA_ONLY and kv_heads != heads:
        raise ValueError(f"{family} is multi-head attention only; kv_heads must equal heads")

    fields: dict[str, Any] = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    inter = intermediate or 2 * hidden
    if family == "falcon":
        fields.update(
            new_decoder_architecture=kv_heads not in (1, heads),
            multi_query=kv_heads == 1,
            num_kv_heads=kv_heads,
            parallel_attn=True,
            bias=False,
            alibi=False,
        )
    elif family == "opt":
        fields.update(ffn_dim=inter, word_embed_proj_dim=hidden, do_layer_norm_before=True)
    elif family == "gpt2":
        fields.update(n_inner=inter, n_positions=max_positions)
    else:
        fields.update(intermediate_size=inter, num_key_value_heads=kv_heads)
    if family in _HEAD_DIM_FAMILIES:
        # Some families default to a fixed head_dim (Qwen3: 128) rather than hidden / heads.
        fields["head_dim"] = head_dim or hidden // heads
    if family in ("gemma2", "gemma3_text"):
        fields.update(
            sliding_window=window if window is not None else max_positions,
            query_pre_attn_scalar=fields["head_dim"],
        )
        if family == "gemma3_text":
            fields["sliding_window_pattern"] = overrides.pop("sliding_window_pattern", 6)
    elif family == "qwen2":
        fields.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
    elif family in _SLIDING_FAMILIES:
        fields["sliding_window"] = window
    if family == "mixtral":
        fields.update(num_local_experts=4, num_experts_per_tok=2)
    if family in ("deepseek_v2", "deepseek_v3"):
        qk_nope = head_dim or hidden // heads
        fields.update(
            kv_lora_rank=latent,
            qk_rope_head_dim=rope_dim,
            qk_nope_head_dim=qk_nope,
            v_head_dim=qk_nope,
            q_lora_rank=None if family == "deepseek_v2" else 2 * latent,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=inter // 2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_key_value_heads=heads,
        )
    fields.update(overrides)
    return AutoConfig.for_model(family, **fields)


def tiny_model(
    family: str = "llama",
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    config: PretrainedConfig | None = None,
    **knobs: Any,
) -> PreTrainedModel:
    """A randomly initialised (seeded) causal LM of `family`, in eval mode, on `device` (default: cuda if any).

    Architecture knobs are those of `tiny_config`; pass `config` instead to build from a ready config.
    """
    config = config if config is not None else tiny_config(family, **knobs)
    torch.manual_seed(seed)
    # None lets transformers pick (sdpa where the family supports it, eager otherwise).
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    # Random init leaves some norms at exactly 1 and biases at 0; that is fine for cache and timing labs.
    torch.nn.Module.to(model, pick_device(device))
    return model.eval()


def load_model(
    name_or_path: str,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str = "auto",
    **kwargs: Any,
) -> PreTrainedModel:
    """Real weights from a Hub id (needs internet) or a local `save_pretrained` directory, in eval mode."""
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)
    except OSError as err:
        raise OSError(
            f"could not load model {name_or_path!r}: {err}. Hub ids need internet access; offline, pass a local "
            "directory written by save_pretrained, or use kvlab.models.tiny_model for a random model."
        ) from None
    torch.nn.Module.to(model, pick_device(device))
    return model.eval()


def scaled_down(
    name: str, *, layers: int = 6, hidden: int = 64, heads: int = 8, window: int = 16, vocab: int = 256
) -> PretrainedConfig:
    """A tiny config with the registry model's family, attention type and layer pattern.

    MHA/GQA/MQA/MLA stays what it is (GQA keeps 4 query heads per KV head, or the model's own ratio if smaller),
    sliding layers keep their place in the pattern with a `window`-token window, MLA keeps a latent.
    """
    from kvlab.arch import describe, get

    config = get(name)
    text = config.get_text_config(decoder=True)
    spec = describe(config)
    family = "gemma3_text" if text.model_type == "gemma3_text" else text.model_type
    if family not in FAMILIES:
        raise ValueError(f"{name!r} is a {family!r} model; tiny models exist for {', '.join(FAMILIES)}")
    kinds = [layer.kind for layer in spec.layers]
    kv_heads = {"MHA": heads, "MQA": 1, "MLA": heads}.get(
        spec.attention_type, max(1, heads // min(4, spec.num_attention_heads // spec.kv_heads))
    )
    knobs: dict[str, Any] = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab)
    if "sliding" in kinds:
        knobs["window"] = window
    if family == "gemma3_text":
        knobs["sliding_window_pattern"] = kinds.index("full") + 1
    return tiny_config(family, **knobs)


def equal_param_configs(family: str, kv_heads_options: list[int], **knobs: Any) -> list[PretrainedConfig]:
    """One config per KV-head count, with the MLP width adjusted so all have the first one's parameter count.

    Fewer KV heads shrink the K and V projections; the freed parameters go to the MLP, so the comparison is at
    equal model size, as in the grouped-query attention paper (Ainslie et al., 2023, arXiv:2305.13245).
    """
    from kvlab.sizing import param_count

    hidden = knobs.get("hidden", 64)
    base = knobs.pop("intermediate", None) or 2 * hidden
    target = param_count(tiny_config(family, kv_heads=kv_heads_options[0], intermediate=base, **knobs))
    configs = []
    for kv_heads in kv_heads_options:
        # Parameters are affine in the MLP width: solve p(base) + slope * (width - base) = target.
        p0 = param_count(tiny_config(family, kv_heads=kv_heads, intermediate=base, **knobs))
        p1 = param_count(tiny_config(family, kv_heads=kv_heads, intermediate=base + 1, **knobs))
        width = base + round((target - p0) / (p1 - p0))
        configs.append(tiny_config(family, kv_heads=kv_heads, intermediate=width, **knobs))
    return configs
