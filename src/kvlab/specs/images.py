"""How many tokens an image adds to a vision-language model's context, and what vLLM reserves for them.

An image enters the decoder as placeholder tokens that the vision tower's embeddings fill; from there on they
sit in the KV cache like text, at the decoder's bytes per token (`kvlab.specs.sizing`). Two rules cover the
registry's image-text models:

- **fixed**: every image becomes the same number of tokens (Gemma 3: `mm_tokens_per_image`, 256, with
  pan-and-scan off, which is its processor's default);
- **dynamic resolution** (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the image is resized to multiples of
  `patch_size × spatial_merge_size` pixels with its area clamped to the processor's [min_pixels, max_pixels]
  (transformers' `smart_resize`, which vLLM calls too), and each merged patch is one token.

vLLM profiles the worst case at start-up: the largest image its processor allows, as many as the encoder
budget holds (vLLM 0.33.0 `vllm/v1/core/encoder_cache_manager.py`, `compute_mm_encoder_budget`: the budget is
the larger of `max_num_batched_tokens` and one image's maximum tokens). That is why a Qwen2.5-VL server
reserves 16,384 tokens an image (vllm-project/vllm#20123) whatever size the images really are.
Chapter: *Long context* (book/06_long_context).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvlab.checks import check_count
from kvlab.specs.arch import UnsupportedConfigError, config_path, get, image_processor, registry
from kvlab.units import dtype_bytes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvlab.specs.shape import DType

_DYNAMIC = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}
_FIXED = {"gemma3"}
# Each registry image-text model's `ImageRule`, as `image_rule` reads it from transformers' config: what sizes
# its images and encoder cache without transformers (the book's calculator). tests/test_images.py recomputes
# them; `python -m kvlab.specs.images` rewrites the file.
RULES = Path(__file__).with_name("configs") / "image_rules.json"


@dataclass(frozen=True)
class ImageRule:
    """How one model turns an image into decoder tokens.

    `boundary_tokens` are the special tokens its prompt format puts around each image (Qwen's
    <|vision_start|> and <|vision_end|>, Gemma 3's <start_of_image> and <end_of_image>); they are text tokens
    in the cache, not part of the vision tower's output. `embed_elements` is the width of one image token's
    vision embedding as vLLM's encoder cache stores it: the decoder's hidden size, times 1 + the number of
    DeepStack levels for Qwen3-VL, whose tower also hands intermediate features to early decoder layers."""

    model_type: str
    kind: Literal["fixed", "dynamic"]
    embed_elements: int
    boundary_tokens: int = 2
    fixed_tokens: int = 0
    patch_size: int = 0
    merge_size: int = 0
    min_pixels: int = 0
    max_pixels: int = 0

    def checked(self) -> ImageRule:
        """This rule, after the checks on its processor's pixel limits (dynamic rule)."""
        if self.kind == "dynamic":
            check_count("min_pixels", self.min_pixels)
            check_count("max_pixels", self.max_pixels)
            if self.min_pixels > self.max_pixels:
                raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")
        return self

    @property
    def factor(self) -> int:
        """The side, in pixels, of the square that one token covers (dynamic rule)."""
        return self.patch_size * self.merge_size

    def tokens(self, width: int, height: int) -> int:
        """Placeholder tokens of one `width × height` image: what vLLM calls its feature size."""
        check_count("width", width)
        check_count("height", height)
        if self.kind == "fixed":
            return self.fixed_tokens
        # The PIL backend's copy: the torchvision one needs torchvision, which kvlab does not install.
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        # transformers raises on aspect ratios beyond 200, as the processor does for a real image.
        resized_h, resized_w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (resized_h // self.factor) * (resized_w // self.factor)

    def prompt_tokens(self, width: int, height: int) -> int:
        """Tokens one image adds to the prompt, and so to the KV cache: its placeholders and boundary tokens."""
        return self.tokens(width, height) + self.boundary_tokens

    def max_tokens(self) -> int:
        """The most placeholder tokens one image can become: the size vLLM profiles and reserves per image.

        For the dynamic rule this is `max_pixels // factor²`, an upper bound that a square image of side
        `floor(√max_pixels / factor) × factor` reaches whenever `max_pixels` is a square of such a side
        (Qwen2.5-VL's 3584², Qwen3-VL's 4096²)."""
        if self.kind == "fixed":
            return self.fixed_tokens
        return self.max_pixels // self.factor**2


def image_rule(
    model: PretrainedConfig | str, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> ImageRule:
    """The image rule of a registry model (name) or of a config with the processor's pixel limits given.

    `min_pixels`/`max_pixels` override the registry's (vLLM's `--mm-processor-kwargs`); a dynamic-resolution
    config from outside the registry needs both. A model kvlab cannot count image tokens for is an error."""
    stored_rule = _stored_rules().get(model) if isinstance(model, str) else None
    if stored_rule is not None and stored_rule.kind == "fixed":
        return stored_rule
    if stored_rule is not None:
        return dataclasses.replace(
            stored_rule,
            min_pixels=stored_rule.min_pixels if min_pixels is None else min_pixels,
            max_pixels=stored_rule.max_pixels if max_pixels is None else max_pixels,
        ).checked()
    config = get(model) if isinstance(model, str) else model
    model_type = config.model_type
    text = config.get_text_config(decoder=True)
    vision = getattr(config, "vision_config", None)
    if model_type in _FIXED:
        tokens = getattr(config, "mm_tokens_per_image", None)
        if vision is None or not tokens:
            raise UnsupportedConfigError(
                f"{model_type}: the config has no vision_config or mm_tokens_per_image"
            )
        return ImageRule(model_type, "fixed", embed_elements=text.hidden_size, fixed_tokens=int(tokens))
    if model_type not in _DYNAMIC or vision is None:
        raise UnsupportedConfigError(
            f"kvlab cannot count image tokens for model_type {model_type!r}"
            + ("" if vision is not None else " (its config has no vision_config)")
            + f"; it can for {', '.join(sorted(_FIXED | _DYNAMIC))}"
        )
    stored = image_processor(model) if isinstance(model, str) else None
    low = min_pixels if min_pixels is not None else (stored or {}).get("min_pixels")
    high = max_pixels if max_pixels is not None else (stored or {}).get("max_pixels")
    if low is None or high is None:
        raise ValueError(
            f"{model_type}: the image processor's min_pixels and max_pixels are not in kvlab's registry for this"
            " config; pass both (they are in the model's preprocessor_config.json)"
        )
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    return ImageRule(
        model_type,
        "dynamic",
        embed_elements=vision.out_hidden_size * (1 + levels),
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        min_pixels=low,
        max_pixels=high,
    ).checked()


def parse_image_size(text: str) -> tuple[int, int]:
    """`"1280x720"` as (width, height); a one-line error for anything else."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"an image size is WIDTHxHEIGHT in pixels, such as 1280x720, got {text!r}")
    return int(parts[0]), int(parts[1])


@dataclass(frozen=True)
class ImageCost:
    """What `images` images of `width × height` cost one request, and what vLLM reserves for them."""

    rule: ImageRule
    images: int
    width: int
    height: int
    kv_bytes_per_token: int
    max_num_batched_tokens: int
    encoder_dtype_bytes: int

    @property
    def tokens_per_image(self) -> int:
        return self.rule.prompt_tokens(self.width, self.height)

    @property
    def prompt_tokens(self) -> int:
        """Tokens the images add to one request's context."""
        return self.images * self.tokens_per_image

    @property
    def kv_bytes(self) -> int:
        """KV cache bytes those tokens hold in one sequence."""
        return self.prompt_tokens * self.kv_bytes_per_token

    @property
    def encoder(self) -> EncoderCache:
        """What vLLM reserves for this model's images at these settings, whatever the images are."""
        return EncoderCache(self.rule, self.max_num_batched_tokens, self.encoder_dtype_bytes)

    @property
    def encoder_cache_tokens(self) -> int:
        return self.encoder.tokens

    @property
    def encoder_cache_bytes(self) -> int:
        return self.encoder.nbytes

    @property
    def encoder_cache_note(self) -> str:
        return self.encoder.note

    @property
    def profiled_images(self) -> int:
        return self.encoder.profiled_images


@dataclass(frozen=True)
class EncoderCache:
    """vLLM 0.33.0's encoder cache for an image-text model: reserved at start-up from the model and the token
    budget alone, whatever images requests later bring (`compute_mm_encoder_budget`)."""

    rule: ImageRule
    max_num_batched_tokens: int
    dtype_bytes: int

    @property
    def tokens(self) -> int:
        """Image tokens it holds: max(max_num_batched_tokens, one image's maximum)."""
        return max(self.max_num_batched_tokens, self.rule.max_tokens())

    @property
    def nbytes(self) -> int:
        """Those tokens' vision embeddings as vLLM holds them while it profiles (one embedding per token)."""
        return self.tokens * self.rule.embed_elements * self.dtype_bytes

    @property
    def note(self) -> str:
        """Where `nbytes` comes from, for a budget line."""
        return (
            f"max(max_num_batched_tokens {self.max_num_batched_tokens:,}, the largest image's "
            f"{self.rule.max_tokens():,}) × {self.rule.embed_elements:,} × {self.dtype_bytes} B; "
            f"the vision tower's own activation peak is not counted"
        )

    @property
    def profiled_images(self) -> int:
        """How many largest images vLLM's profile run encodes at once (at least one)."""
        return max(1, self.tokens // self.rule.max_tokens())


def encoder_cache(
    model: PretrainedConfig | str, max_num_batched_tokens: int, dtype: DType = "bfloat16"
) -> EncoderCache | None:
    """vLLM's encoder cache for `model` (a registry name or config) at `max_num_batched_tokens`, or None for a
    model without a vision tower. An image-text model kvlab has no image rule for is an error
    (`UnsupportedConfigError`), as is a dynamic-resolution config without its processor's pixel limits."""
    check_count("max_num_batched_tokens", max_num_batched_tokens)
    if isinstance(model, str) and model in registry():
        # The stored JSON answers for a text model, and the stored rule for an image-text one, so that `kvlab
        # size` of a registry model never imports transformers.
        if "vision_config" not in json.loads(config_path(model).read_text()):
            return None
        if model in _stored_rules():
            return EncoderCache(image_rule(model), max_num_batched_tokens, dtype_bytes(dtype))
        config = get(model)
    else:
        config = get(model) if isinstance(model, str) else model
    if getattr(config, "vision_config", None) is None:
        return None
    return EncoderCache(image_rule(model), max_num_batched_tokens, dtype_bytes(dtype))


def image_cost(
    model: str,
    images: int,
    width: int,
    height: int,
    *,
    kv_bytes_per_token: int,
    max_num_batched_tokens: int,
    dtype: DType = "bfloat16",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> ImageCost:
    """The cost of `images` images per request on `model` (a registry name), for `kvlab size --images`."""
    check_count("images", images)
    check_count("max_num_batched_tokens", max_num_batched_tokens)
    rule = image_rule(model, min_pixels=min_pixels, max_pixels=max_pixels)
    # Resolve the size now, so that a bad one fails here with the processor's own error.
    rule.tokens(width, height)
    return ImageCost(
        rule, images, width, height, kv_bytes_per_token, max_num_batched_tokens, dtype_bytes(dtype)
    )


@functools.cache
def _stored_rules() -> dict[str, ImageRule]:
    if not RULES.is_file():
        return {}
    return {name: ImageRule(**fields) for name, fields in json.loads(RULES.read_text())["models"].items()}


def registry_rules() -> dict[str, ImageRule]:
    """Each registry image-text model's rule, read from transformers' config (what `RULES` stores)."""
    names = [n for n in registry() if "vision_config" in json.loads(config_path(n).read_text())]
    return {name: image_rule(get(name), **_registry_pixels(name)) for name in names}


def _registry_pixels(name: str) -> dict[str, int]:
    stored = image_processor(name) or {}
    return {k: stored[k] for k in ("min_pixels", "max_pixels") if k in stored}


def write_registry_rules(path: Path = RULES) -> None:
    """Store `registry_rules()` in `path`, one model a line."""
    about = "kvlab.specs.images: each registry image-text model's ImageRule; rewrite with python -m kvlab.specs.images"
    lines = [
        f" {json.dumps(name)}: {json.dumps(dataclasses.asdict(rule))}"
        for name, rule in registry_rules().items()
    ]
    path.write_text(f'{{"about": {json.dumps(about)}, "models": {{\n' + ",\n".join(lines) + "\n}}\n")
    _stored_rules.cache_clear()


if __name__ == "__main__":
    write_registry_rules()
