"""The `vllm serve` command line of a `kvlab size` setting: `kvlab size --json` prints it, the book's calculator
shows it (book/calculator).

The flag names and values are vLLM 0.34.0's, read from its wheel: `EngineArgs.add_cli_args` in
`vllm/engine/arg_utils.py` (the flags), `ModelDType` in `vllm/config/model.py` (`--dtype`), `CacheDType` in
`vllm/config/cache.py` (`--kv-cache-dtype`: "auto" stores the model's dtype, an explicit float16 or bfloat16
must match it, "fp8" is fp8_e4m3), `QuantizationMethods` in `vllm/model_executor/layers/quantization/__init__.py`
("fp8": a 16-bit checkpoint quantized as it loads) and `SpeculativeMethod` in `vllm/config/speculative.py`
("draft_model"). Every value the budget was sized with is written out, defaults included, so that the command
means the same under another release's defaults. A setting no vLLM flag sets is listed in `unmatched`, never
dropped in silence.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

VLLM_VERSION = "0.34.0"
# kvlab's precision names -> vLLM's `--dtype` (ModelDType)
MODEL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class ServeCommand:
    """`vllm serve MODEL` and its flags, plus the settings no flag reproduces."""

    model: str
    flags: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)

    def add(self, flag: str, value: object) -> None:
        self.flags += [flag, value if isinstance(value, str) else json.dumps(value)]

    @property
    def command(self) -> str:
        return shlex.join(["vllm", "serve", self.model, *self.flags])

    def as_dict(self) -> dict[str, Any]:
        return {
            "vllm_version": VLLM_VERSION,
            "command": self.command,
            "flags": self.flags,
            "unmatched": self.unmatched,
        }


def _model_dtype(weight_dtype: str | int, kv_dtype: str) -> str:
    """The 16- or 32-bit dtype the model computes in: the weights', else the cache's, else bf16."""
    if weight_dtype in MODEL_DTYPES:
        return str(weight_dtype)
    return kv_dtype if kv_dtype in MODEL_DTYPES else "bf16"


def serve_command(
    model: str,
    *,
    max_model_len: int,
    kv_dtype: str,
    weight_dtype: str | int,
    tp: int,
    pp: int,
    gpu_memory_utilization: float | None,
    block_size: int | None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    usage_context: str = "serve",
    limit_images: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    speculative: int = 0,
    draft: str | None = None,
    draft_layers: int = 0,
    evicts: bool = False,
) -> ServeCommand:
    """The `vllm serve` command of one `kvlab size` setting (its long flags' values, resolved)."""
    out = ServeCommand(model)
    out.add("--max-model-len", max_model_len)
    out.add("--tensor-parallel-size", tp)
    out.add("--pipeline-parallel-size", pp)
    model_dtype = _model_dtype(weight_dtype, kv_dtype)
    out.add("--dtype", MODEL_DTYPES[model_dtype])
    if weight_dtype == "fp8":
        out.add("--quantization", "fp8")
    elif weight_dtype not in MODEL_DTYPES:
        out.unmatched.append(
            f"weights in {weight_dtype if weight_dtype != 4 else '4-bit'}: no flag quantizes them so; serve a "
            "checkpoint quantized that way (vLLM reads its quantization_config)"
        )
    if kv_dtype == model_dtype:
        out.add("--kv-cache-dtype", "auto")
    elif kv_dtype == "fp8":
        out.add("--kv-cache-dtype", "fp8")
    elif kv_dtype == "int8":
        out.unmatched.append(
            "an int8 cache: vLLM's --kv-cache-dtype has no plain int8 (int8_per_token_head keeps a scale per "
            "token and head, which kvlab's int8 figures leave out)"
        )
    else:
        out.unmatched.append(
            f"a {kv_dtype} cache beside {model_dtype} compute: vLLM's explicit float16/bfloat16 cache must match "
            "the model's dtype"
        )
    # None: the release's default, which the budget did not resolve (no --gpu)
    if gpu_memory_utilization is not None:
        out.add("--gpu-memory-utilization", gpu_memory_utilization)
    if block_size is not None:
        out.add("--block-size", block_size)
    if max_num_batched_tokens is not None:
        out.add("--max-num-batched-tokens", max_num_batched_tokens)
    if max_num_seqs is not None:
        out.add("--max-num-seqs", max_num_seqs)
    if limit_images is not None:
        out.add("--limit-mm-per-prompt", {"image": limit_images})
    pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    if pixels:
        out.add("--mm-processor-kwargs", pixels)
    if draft is not None:
        out.add(
            "--speculative-config",
            {"method": "draft_model", "model": draft, "num_speculative_tokens": speculative},
        )
    elif draft_layers:
        out.unmatched.append(
            f"a {draft_layers}-layer EAGLE/MTP head: --speculative-config names its checkpoint "
            f"(num_speculative_tokens {speculative})"
        )
    if usage_context != "serve":
        out.unmatched.append(
            "the LLM class's batch defaults (--usage-context llm): pass these values as LLM(...) keywords"
        )
    if evicts:
        out.unmatched.append("KV eviction (--keep-ratio, --window): vLLM keeps every token of a sequence")
    return out
