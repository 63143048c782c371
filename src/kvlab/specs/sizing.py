"""How many bytes the KV cache and the weights take, exactly.

Per token and layer the cache holds K and V: ``2 × kv_heads × head_dim`` elements (MLA holds one latent of
``kv_lora_rank + qk_rope_head_dim`` instead). Summed over layers and multiplied by the bytes per element and the
active tokens, this is the whole cache. Sliding-window layers stop growing at ``window - 1`` tokens.
State layers (Mamba, Mamba-2, gated DeltaNet, short conv: `kvlab.specs.layers.StateLayer`, `HybridLayer`) add a
fixed-size state per sequence instead (`state_bytes_per_sequence`): a conv state in the cache dtype and a
recurrent state in float32, the same after one token as after a million.
`kv_cache_bytes` equals, to the byte, the K/V and state tensors a transformers 5.24 `DynamicCache` holds; the
tests prove it (tests/test_sizing.py, tests/test_state_sizing.py).
Chapter: *Sizing the cache* (book/02_sizing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.checks import check_count
from kvlab.specs.arch import ArchSpec, UnsupportedConfigError
from kvlab.specs.shape import DType, WeightGroup, prepare, shape, weight_groups
from kvlab.units import cdiv, dtype_bytes, join_words

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


def _spec_and_bytes(config: PretrainedConfig | str, dtype: DType) -> tuple[ArchSpec, int]:
    spec, dtype = _spec_and_dtype(config, dtype)
    return spec, dtype_bytes(dtype)


def _spec_and_dtype(config: PretrainedConfig | str, dtype: DType) -> tuple[ArchSpec, torch.dtype | str]:
    model = shape(config)
    chosen = model.dtype if dtype is None else dtype
    if chosen is None:
        raise ValueError(f"{model.spec.name}: no dtype to size its cache in")
    return model.spec, chosen


def refuse_state(spec: ArchSpec, what: str) -> None:
    """A one-line UnsupportedConfigError when `spec` has state layers, which `what` does not model."""
    if spec.has_state:
        count = sum(1 for layer in spec.layers if layer.state_shape)
        raise UnsupportedConfigError(
            f"{spec.name} ({spec.model_type!r}) has {count} state layer(s) (Mamba, linear attention or conv), "
            f"which {what} does not model"
        )


def check_parallel(spec: ArchSpec, tp: int = 1, pp: int = 1) -> None:
    """Raise a one-line ValueError when `tp` and `pp` cannot shard `spec` the way vLLM would.

    `tp` must divide the query heads, and it and the KV-head count must divide one another; `pp` must not
    exceed the layers.
    """
    check_count("tp", tp)
    check_count("pp", pp)
    if spec.num_attention_heads % tp:
        raise ValueError(
            f"tensor-parallel size {tp} does not divide the {spec.num_attention_heads} query heads of {spec.name}"
        )
    for layer in spec.layers:
        layer.kv_heads_per_rank(tp)  # raises when tp and the KV heads do not divide one another
    if pp > spec.num_layers:
        raise ValueError(f"pipeline-parallel size {pp} exceeds the {spec.num_layers} layers of {spec.name}")


def pipeline_stages(num_layers: int, pp: int) -> list[range]:
    """The layers each of `pp` pipeline stages runs, split as vLLM splits them (`get_pp_indices` in
    vllm/distributed/utils.py): evenly, with the remainder going one layer each to the stages before the last,
    counting backwards from the second to last (the last stage also holds the final norm and the lm_head)."""
    check_count("num_layers", num_layers)
    check_count("pp", pp)
    if pp > num_layers:
        raise ValueError(f"pipeline-parallel size {pp} exceeds the {num_layers} layers")
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def kv_bytes_per_token(config: PretrainedConfig | str, dtype: DType = None, tp: int = 1, pp: int = 1) -> int:
    """Bytes one more token adds to one sequence's cache at short context (every layer still growing).

    The fixed-size state of state layers is not per token and is not counted (`state_bytes_per_sequence`).

    With `tp` tensor-parallel ranks and `pp` pipeline stages: the bytes ONE GPU holds, on the stage that holds
    the most. A rank keeps `max(1, kv_heads // tp)` KV heads per layer (vLLM's rule, so heads are copied once
    `tp` exceeds the KV heads) and MLA's whole latent. `tp=1, pp=1` is the whole cache.
    """
    spec, nbytes = _spec_and_bytes(config, dtype)
    check_parallel(spec, tp, pp)
    return nbytes * max(
        sum(spec.layers[i].elements_per_token_per_rank(tp) for i in stage)
        for stage in pipeline_stages(spec.num_layers, pp)
    )


def kv_bytes_per_token_expanded(config: PretrainedConfig | str, dtype: DType = None) -> int:
    """Per-token bytes if every layer kept per-head K and V (for MLA: what the latent replaces)."""
    spec, nbytes = _spec_and_bytes(config, dtype)
    return sum(layer.expanded_elements_per_token for layer in spec.layers) * nbytes


def kv_cache_bytes(
    config: PretrainedConfig | str,
    seq_len: int,
    batch_size: int = 1,
    dtype: DType = None,
    tp: int = 1,
    pp: int = 1,
) -> int:
    """Bytes a transformers `DynamicCache` holds after a forward over `batch_size` sequences of `seq_len` tokens.

    The growing K/V of the attention layers plus, once `seq_len >= 1`, `batch_size` × the fixed state of the
    state layers (`state_bytes_per_sequence`). `dtype=None` takes the config's declared dtype (bf16 when it
    declares none); recurrent states are float32 whatever it is (`kvlab.specs.layers.RECURRENT_STATE_DTYPE`).
    With `tp` tensor-parallel ranks and `pp` pipeline stages: the bytes ONE GPU holds (see `kv_bytes_per_token`),
    on the largest stage; a model with state layers is refused at `tp > 1`.
    """
    return max(kv_cache_bytes_per_stage(config, seq_len, batch_size, dtype, tp, pp))


def kv_cache_bytes_per_stage(
    config: PretrainedConfig | str,
    seq_len: int,
    batch_size: int = 1,
    dtype: DType = None,
    tp: int = 1,
    pp: int = 1,
) -> list[int]:
    """`kv_cache_bytes` for one GPU of each of the `pp` pipeline stages, first stage first."""
    check_count("seq_len", seq_len, 0)
    check_count("batch_size", batch_size)
    spec, chosen = _spec_and_dtype(config, dtype)
    nbytes = dtype_bytes(chosen)
    check_parallel(spec, tp, pp)
    if tp > 1 and spec.has_state:
        # vLLM splits Mamba heads and conv channels across ranks, replicating groups that do not divide; kvlab
        # does not model that split.
        refuse_state(spec, f"kvlab's per-rank sizing at tp={tp}")
    # Before the first forward the state tensors do not exist (LinearAttentionLayer allocates them lazily).
    seen = 1 if seq_len else 0
    return [
        batch_size
        * sum(
            nbytes * spec.layers[i].cached_tokens(seq_len) * spec.layers[i].elements_per_token_per_rank(tp)
            + seen * spec.layers[i].state_bytes(chosen)
            for i in stage
        )
        for stage in pipeline_stages(spec.num_layers, pp)
    ]


def kv_read_bytes(config: PretrainedConfig | str, context: int, dtype: DType = None, tp: int = 1) -> int:
    """Bytes of one sequence's cache a decode step at `context` tokens reads on one of `tp` ranks: all it holds
    (`kv_cache_bytes`), less what a sparse attention leaves unread (DeepSeek-V3.2's latents past the indexer's
    top-k, `MLAttention.unread_elements`)."""
    spec, chosen = _spec_and_dtype(config, dtype)
    unread = sum(layer.unread_elements(context) for layer in spec.layers)
    return kv_cache_bytes(config, context, 1, chosen, tp=tp) - unread * dtype_bytes(chosen)


def evicted_context(
    context: int, keep_ratio: float | None = None, sinks: int = 0, window: int | None = None
) -> int:
    """Tokens a sequence of `context` tokens keeps under KV eviction (`kvlab.experiments.evict`): the first
    `sinks` and the last `window` (StreamingLLM), or ceil(`keep_ratio` × context), at least one. Give one rule."""
    check_count("context", context)
    if (keep_ratio is None) == (window is None):
        raise ValueError("give a keep ratio or a window (with sinks), not both and not neither")
    if window is not None:
        check_count("window", window)
        check_count("sinks", sinks, 0)
        return min(context, sinks + window)
    if sinks:
        raise ValueError("sinks go with a window, not with a keep ratio")
    if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, int | float) or not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    return max(1, math.ceil(keep_ratio * context - 1e-9))


def unevictable_kinds(spec: ArchSpec) -> list[str]:
    """The layer kinds of `spec` whose cache is bounded already (sliding windows, recurrent state), so that
    eviction, sized for layers that keep every token (full attention, MLA), does not apply to them."""
    return sorted(set(spec.kinds) - {"full", "mla", "none"})


def check_evictable(spec: ArchSpec) -> None:
    """Eviction applies to layers that keep every token (full attention, MLA): refuse windows and state."""
    others = unevictable_kinds(spec)
    if others:
        raise UnsupportedConfigError(
            f"{spec.name}: eviction is sized for full-attention and MLA layers only; it has {', '.join(others)}"
        )


def state_bytes_per_sequence(config: PretrainedConfig | str, dtype: DType = None) -> int:
    """Bytes of the fixed-size state one sequence keeps once it has seen a token, summed over the state layers.

    Per layer, transformers 5.24's `LinearAttentionLayer` (cache_utils.py): a conv state of `conv_channels ×
    conv_kernel` in `dtype` (the config's when None) and a recurrent state in float32. 0 for a model without
    state layers; `kv_cache_bytes` = the growing K/V + `batch_size` × this.
    """
    spec, chosen = _spec_and_dtype(config, dtype)
    return sum(layer.state_bytes(chosen) for layer in spec.layers)


def param_count(config: PretrainedConfig | str) -> int:
    """Parameters of the model a config describes, counted on the `meta` device (nothing is allocated)."""
    return sum(group.elements for group in weight_groups(config))


def weight_bytes(config: PretrainedConfig | str, dtype_or_bits: DType | int = None) -> int:
    """Bytes of the weights: parameters × bytes per element, or × bits / 8 for an int (e.g. 4 for 4-bit).

    Quantization scales and zero points are not counted, so this is the floor a quantized checkpoint reaches.
    """
    params = param_count(config)
    if isinstance(dtype_or_bits, int) and not isinstance(dtype_or_bits, bool):
        if dtype_or_bits not in (1, 2, 3, 4, 5, 6, 8, 16, 32):
            raise ValueError(f"weight bits must be one of 1-6, 8, 16 or 32, got {dtype_or_bits}")
        return math.ceil(params * dtype_or_bits / 8)
    if isinstance(dtype_or_bits, bool):
        raise ValueError(f"weight precision must be a dtype or a bit count, got {dtype_or_bits!r}")
    return params * dtype_bytes(shape(config).dtype if dtype_or_bits is None else dtype_or_bits)


def weight_bytes_per_gpu(
    config: PretrainedConfig | str,
    dtype_or_bits: DType | int = None,
    tp: int = 1,
    pp: int = 1,
    vocab_parallel: bool = True,
) -> int:
    """Weight bytes ONE GPU holds with `tp` tensor-parallel ranks and `pp` pipeline stages (the largest stage).

    Counted tensor by tensor on the `meta` device, the way vLLM shards a dense or MoE decoder: projections and
    experts are split `tp` ways (column- or row-wise); K and V projections keep `max(1, kv_heads // tp)` heads
    per rank, so they are copied past the KV-head count; norms, MLA's down-projections (`q_a_proj`,
    `kv_a_proj_with_mqa`), routers, position tables and the biases of row-parallel layers are whole on every
    rank; the embedding and lm_head are split by vocabulary rows when `vocab_parallel` (vLLM's
    `VocabParallelEmbedding`; its padding of the vocabulary is not counted), else whole. A stage holds its own
    layers, the first stage the input embedding, the last the final norm and the lm_head (a tied table on both).
    Fused QKV tensors (Falcon, Phi-3, GPT-2) are split `tp` ways, which is exact only where KV heads = heads.
    `tp=1, pp=1` equals `weight_bytes`.
    """
    return max(weight_bytes_per_stage(config, dtype_or_bits, tp, pp, vocab_parallel))


def weight_bytes_per_stage(
    config: PretrainedConfig | str,
    dtype_or_bits: DType | int = None,
    tp: int = 1,
    pp: int = 1,
    vocab_parallel: bool = True,
) -> list[int]:
    """`weight_bytes_per_gpu` for one GPU of each of the `pp` pipeline stages, first stage first."""
    config = prepare(config)
    spec, _ = _spec_and_bytes(config, None)
    check_parallel(spec, tp, pp)
    if isinstance(dtype_or_bits, int) and not isinstance(dtype_or_bits, bool):
        weight_bytes(config, dtype_or_bits)  # validates the bit count
        bits = dtype_or_bits
    elif isinstance(dtype_or_bits, bool):
        raise ValueError(f"weight precision must be a dtype or a bit count, got {dtype_or_bits!r}")
    else:
        bits = 8 * dtype_bytes(shape(config).dtype if dtype_or_bits is None else dtype_or_bits)
    kv_heads = spec.kv_heads or 1
    stages = pipeline_stages(spec.num_layers, pp)
    owners_of = {"first": [0], "last": [pp - 1], "both": sorted({0, pp - 1})}
    per_stage = [0] * pp  # elements × tp, to divide once
    for group in weight_groups(config):
        if isinstance(group.placement, int):
            owners = [s for s, stage in enumerate(stages) if group.placement in stage]
        else:
            owners = owners_of[group.placement]
        share = _share_times_tp(group, tp, kv_heads, vocab_parallel)
        for owner in owners:
            per_stage[owner] += share
    return [math.ceil(elements * bits / (8 * tp)) for elements in per_stage]


def _share_times_tp(group: WeightGroup, tp: int, kv_heads: int, vocab_parallel: bool = True) -> int:
    """One rank's elements of `group`, times `tp` (to divide once): vLLM's sharding rules."""
    numel = group.elements
    if group.sharding == "vocab":
        return numel if vocab_parallel else numel * tp
    if group.sharding == "replicated":
        return numel * tp
    if group.sharding == "kv":
        return numel * (tp // kv_heads if tp > kv_heads else 1)  # per rank: numel × max(1, kv // tp) / kv
    return numel


def _weight_bits(config: PretrainedConfig | str, dtype_or_bits: DType | int) -> int:
    if isinstance(dtype_or_bits, int) and not isinstance(dtype_or_bits, bool):
        weight_bytes(config, dtype_or_bits)  # validates the bit count
        return dtype_or_bits
    if isinstance(dtype_or_bits, bool):
        raise ValueError(f"weight precision must be a dtype or a bit count, got {dtype_or_bits!r}")
    return 8 * dtype_bytes(shape(config).dtype if dtype_or_bits is None else dtype_or_bits)


def crossover_context(
    config: PretrainedConfig | str, batch_size: int = 1, dtype: DType = None, weight_dtype: DType | int = None
) -> int | None:
    """Smallest context at which `batch_size` sequences' cache reaches the weights' bytes; None if never.

    Sliding-window layers stop growing, so a model whose every layer slides may never get there.
    """
    check_count("batch_size", batch_size)
    target = weight_bytes(config, weight_dtype)
    spec, _ = _spec_and_bytes(config, dtype)
    if not spec.grows:
        # At least one token: a state layer's state exists from the first token on and never grows.
        longest = max(1, *(layer.max_cached_tokens or 0 for layer in spec.layers))
        if kv_cache_bytes(config, longest, batch_size, dtype) < target:
            return None
    # kv_cache_bytes is non-decreasing in seq_len: bisect.
    lo, hi = 0, 1
    while kv_cache_bytes(config, hi, batch_size, dtype) < target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_cache_bytes(config, mid, batch_size, dtype) >= target:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class ModelSize:
    """The numbers the sizing chapter tabulates for one model."""

    name: str
    attention_type: str
    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    params: int
    weight_bytes: int
    max_context: int | None


def model_size(
    config: PretrainedConfig | str, kv_dtype: DType = "bf16", weight_dtype: DType | int = "bf16"
) -> ModelSize:
    model = shape(config)
    spec = model.spec
    return ModelSize(
        name=spec.name,
        attention_type=spec.attention_type,
        layers=spec.num_layers,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        kv_bytes_per_token=kv_bytes_per_token(config, kv_dtype),
        params=param_count(config),
        weight_bytes=weight_bytes(config, weight_dtype),
        max_context=model.max_context,
    )


def cached_shapes(config: PretrainedConfig | str) -> str:
    """The distinct per-layer shapes one token adds, in layer order, e.g. "2 × 8 × 128" or two for a hybrid."""
    shapes = [layer.cached_shape for layer in shape(config).spec.layers if layer.cached_shape]
    return " / ".join(dict.fromkeys(shapes))


def holders(sizes: list[ModelSize], kv_bytes_per_token: int, lang: str = "en") -> tuple[list[ModelSize], str]:
    """The models of `sizes` whose cache per token is `kv_bytes_per_token`, and a phrase naming them, in English
    or Chinese (`lang`, chapter 2 of either edition).

    Ties are named together; a tie of two models with the same layers and shapes says so."""
    group = [s for s in sizes if s.kv_bytes_per_token == kv_bytes_per_token]
    if not group:
        raise ValueError(f"no model of the {len(sizes)} given needs {kv_bytes_per_token} KV bytes per token")
    text = join_words([s.name for s in group], lang)
    layouts = {(s.layers, cached_shapes(s.name)) for s in group}
    if len(group) == 2 and len(layouts) == 1:
        ((num_layers, per_layer),) = layouts
        text += (
            f" (a tie: both have {num_layers} layers of {per_layer})"
            if lang == "en"
            else f"（并列：两者都是 {num_layers} 层，每层 {per_layer}）"
        )
    elif len(group) > 1:
        text += " (a tie)" if lang == "en" else "（并列）"
    return group, text


def rank_inversions(sizes: list[ModelSize]) -> list[tuple[ModelSize, ModelSize]]:
    """Pairs (small, big) where the model with fewer parameters needs more KV bytes per token."""
    return [
        (a, b)
        for a in sizes
        for b in sizes
        if a.params < b.params and a.kv_bytes_per_token > b.kv_bytes_per_token
    ]


# --- speculative decoding: the drafter's cache and weights, and the slots vLLM reserves ahead ---------------------
#
# Read from vLLM's source on GitHub (vllm-project/vllm main: vllm/config/speculative.py at 002e77c1f0ef,
# vllm/v1/core/sched/scheduler.py at 00024d314514, vllm/v1/core/kv_cache_manager.py at 003df2961dd8; newer than
# the 0.33.0 wheel the rest of kvlab reads, whose tree was not at hand, and unchanged in these rules since v1's
# first speculative releases):
#
# - `SpeculativeConfig` (vllm/config/speculative.py): `num_speculative_tokens` (K, > 0), `method` (`draft_model`,
#   `eagle`, `eagle3`, `mtp`, `ngram`, ...). The drafter's tensor-parallel size defaults to the target's
#   (`_verify_and_get_draft_tp`) and its pipeline is one stage (`create_draft_parallel_config`); its KV dtype
#   is the target's unless set. A draft model must have the target's vocabulary size
#   (`verify_equal_vocab_size_if_draft_model`) unless `use_heterogeneous_vocab` is set.
# - The drafter's attention layers (a draft model's, an EAGLE or MTP head's: `uses_draft_kv_cache`) register in
#   the same forward context as the target's, so `GPUModelRunner.get_kv_cache_spec` returns them beside the
#   target's and they join the same KV-cache groups: one block of the pool holds every layer's slots, and
#   `get_num_blocks` (vllm/v1/core/kv_cache_utils.py) divides the memory by the page sizes of all layers. Per
#   token, the pool pays target + draft layers.
# - Lookahead (vllm/v1/core/sched/scheduler.py `Scheduler.__init__`): with an EAGLE-style method or a draft model,
#   `num_lookahead_tokens = num_speculative_tokens`. A running request is scheduled `1 + K` new tokens (its last
#   sampled token and the K unverified drafts, `num_tokens_with_spec`), and `KVCacheManager.allocate_slots` holds
#   `min(computed + new + num_lookahead_tokens, max_model_len)` slots, in whole blocks: 2K slots beyond what the
#   sequence would hold without speculation, never past `max_model_len`.


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding of a target with `num_speculative_tokens` (K) drafts a step.

    The drafter is a separate `draft` model (vLLM's `method="draft_model"`) or, with `draft_layers`, an
    EAGLE/MTP-style head of that many decoder layers of the target's own attention shape (`eagle`, `eagle3`,
    `mtp`). `speculation` builds one after checking it."""

    num_speculative_tokens: int
    draft: PretrainedConfig | str | None = None
    draft_layers: int = 0

    @property
    def method(self) -> str:
        return "draft_model" if self.draft is not None else "eagle"

    @property
    def lookahead_slots(self) -> int:
        """Slots a running sequence holds beyond its tokens: K drafts under verification + K lookahead."""
        return speculative_slots(self.num_speculative_tokens)

    @property
    def draft_name(self) -> str:
        if self.draft is None:
            return f"an EAGLE-style head of {self.draft_layers} layer(s) of the target's shape"
        return self.draft if isinstance(self.draft, str) else shape(self.draft).spec.name

    def describe(self) -> str:
        return f"K={self.num_speculative_tokens}, drafter {self.draft_name} (vLLM method {self.method})"


def speculative_slots(num_speculative_tokens: int) -> int:
    """Slots one running sequence holds beyond its own tokens under speculation with a drafter that keeps a
    cache: the K unverified draft tokens scheduled with it plus vLLM's `num_lookahead_tokens` = K (see above)."""
    return 2 * check_count("num_speculative_tokens", num_speculative_tokens, 0)


def sequence_slots(context_len: int, lookahead_slots: int = 0, max_model_len: int | None = None) -> int:
    """Token slots one sequence of `context_len` tokens holds: its tokens plus the `lookahead_slots` allocated
    ahead of them, never past `max_model_len` (`KVCacheManager.allocate_slots`)."""
    slots = check_count("context_len", context_len) + check_count("lookahead_slots", lookahead_slots, 0)
    if max_model_len is not None:
        slots = min(slots, max(context_len, check_count("max_model_len", max_model_len)))
    return slots


def speculative_blocks_per_sequence(
    context_len: int, num_speculative_tokens: int, block_size: int, max_model_len: int | None = None
) -> int:
    """Blocks one sequence of `context_len` tokens holds at its last step under speculation:
    `ceil(min(context_len + 2K, max_model_len) / block_size)`."""
    slots = sequence_slots(context_len, speculative_slots(num_speculative_tokens), max_model_len)
    return cdiv(slots, check_count("block_size", block_size))


def speculation(
    config: PretrainedConfig | str,
    num_speculative_tokens: int = 0,
    draft: PretrainedConfig | str | None = None,
    draft_layers: int = 0,
    tp: int = 1,
    pp: int = 1,
) -> Speculation | None:
    """The checked speculative settings for `config`, or None when speculation is off (K = 0, no drafter).

    Raises a one-line ValueError for a negative K, a drafter without K (or K without a drafter), both a draft
    model and `draft_layers`, a draft kvlab cannot size, one whose vocabulary differs from the target's (vLLM's
    rule), one the target's `tp` cannot shard, or `pp > 1` (vLLM's drafter runs as one stage; kvlab does not
    model where it lives)."""
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise ValueError(f"speculative tokens (K) must be an integer >= 0, got {num_speculative_tokens!r}")
    if num_speculative_tokens < 0:
        raise ValueError(f"speculative tokens (K) must be >= 0, got {num_speculative_tokens}")
    if isinstance(draft_layers, bool) or not isinstance(draft_layers, int) or draft_layers < 0:
        raise ValueError(f"draft_layers must be an integer >= 0, got {draft_layers!r}")
    if draft is not None and draft_layers:
        raise ValueError("give a draft model or draft_layers (an EAGLE-style head), not both")
    has_drafter = draft is not None or draft_layers > 0
    if not num_speculative_tokens:
        if has_drafter:
            raise ValueError(
                "a draft (--draft or draft_layers) needs speculative tokens: give --speculative K >= 1"
            )
        return None
    if not has_drafter:
        raise ValueError(
            f"speculative decoding with K={num_speculative_tokens} needs a drafter: a draft model (--draft) or "
            "draft_layers (an EAGLE-style head); n-gram speculation, which keeps no draft cache, is not modelled"
        )
    if pp > 1:
        raise ValueError(f"speculative decoding at pp={pp}: kvlab sizes the drafter at pp=1 only")
    target = shape(config)
    if draft is None:
        _head_layer(target.spec)  # raises when the target has no attention layer to copy
        return Speculation(num_speculative_tokens, None, draft_layers)
    label = draft if isinstance(draft, str) else "the draft config"
    try:
        drafted = shape(draft)
    except (
        KeyError,
        ValueError,
    ) as err:  # UnknownModelError is a KeyError, UnsupportedConfigError a ValueError
        raise ValueError(f"draft {label} cannot be sized by kvlab: {err}") from None
    refuse_state(drafted.spec, "kvlab's speculative sizing of a draft model")
    if drafted.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft {drafted.spec.name} has a vocabulary of {drafted.vocab_size:,} tokens and the target "
            f"{target.spec.name} {target.vocab_size:,}: vLLM needs the same vocabulary size "
            "(SpeculativeConfig.verify_equal_vocab_size_if_draft_model)"
        )
    try:
        check_parallel(drafted.spec, tp, 1)
    except ValueError as err:
        raise ValueError(f"draft {drafted.spec.name} at the target's tp={tp}: {err}") from None
    return Speculation(num_speculative_tokens, prepare(draft), 0)


def _head_layer(spec: ArchSpec) -> int:
    """The target layer an EAGLE-style head copies: its last attention layer whose cache grows (full or MLA)."""
    for index in range(spec.num_layers - 1, -1, -1):
        layer = spec.layers[index]
        if layer.max_cached_tokens is None and layer.elements_per_token and not layer.state_shape:
            return index
    raise UnsupportedConfigError(f"{spec.name} has no full-attention layer for an EAGLE-style head to copy")


def draft_kv_bytes_per_token(
    config: PretrainedConfig | str, spec: Speculation, dtype: DType = None, tp: int = 1
) -> int:
    """Bytes the drafter's layers add per token to the shared KV pool, on ONE GPU at `tp`, in the target's KV
    dtype (vLLM's default for the drafter). A draft model: its own `kv_bytes_per_token`; an EAGLE-style head:
    `draft_layers` × the per-token elements of the target's last full-attention layer (an estimate of the
    head's shape: EAGLE and MTP heads copy the target's attention)."""
    target, chosen = _spec_and_dtype(config, dtype)
    if spec.draft is not None:
        return kv_bytes_per_token(spec.draft, chosen, tp=tp)
    layer = target.layers[_head_layer(target)]
    return spec.draft_layers * layer.elements_per_token_per_rank(tp) * dtype_bytes(chosen)


def speculative_kv_bytes_per_token(
    config: PretrainedConfig | str,
    num_speculative_tokens: int,
    draft: PretrainedConfig | str | None = None,
    draft_layers: int = 0,
    dtype: DType = None,
    tp: int = 1,
    pp: int = 1,
) -> int:
    """Per-token bytes of the pool vLLM shares between the target and its drafter: `kv_bytes_per_token` +
    `draft_kv_bytes_per_token` (just the target's when speculation is off)."""
    spec = speculation(config, num_speculative_tokens, draft, draft_layers, tp, pp)
    own = kv_bytes_per_token(config, dtype, tp, pp)
    return own if spec is None else own + draft_kv_bytes_per_token(config, spec, dtype, tp)


def draft_weight_bytes_per_gpu(
    config: PretrainedConfig | str, spec: Speculation, dtype_or_bits: DType | int = None, tp: int = 1
) -> int:
    """Weight bytes the drafter adds to ONE GPU at the target's `tp` (vLLM's default draft TP).

    A draft model: `weight_bytes_per_gpu` of it, in `dtype_or_bits` when that is a dtype and in its own dtype
    when it is a bit count (vLLM quantizes a drafter only when its own `quantization` is set). An EAGLE-style
    head, an estimate: `draft_layers` copies of the target's last full-attention decoder layer (sharded as
    vLLM shards the target's) and the fc that fuses the target's hidden state with the embedding, `2 × hidden²`
    whole on every rank (EAGLE's; EAGLE-3's wider fc and own small lm_head are not counted); the embedding and
    lm_head are the target's, shared as vLLM shares them."""
    own_dtype = (
        dtype_or_bits if not isinstance(dtype_or_bits, int) or isinstance(dtype_or_bits, bool) else None
    )
    if spec.draft is not None:
        return weight_bytes_per_gpu(spec.draft, own_dtype, tp=tp)
    target = shape(config)
    index = _head_layer(target.spec)
    bits = _weight_bits(config, own_dtype)
    kv_heads = target.spec.kv_heads or 1
    layer = sum(_share_times_tp(g, tp, kv_heads) for g in weight_groups(config) if g.placement == index)
    fc = 2 * target.hidden_size * target.hidden_size * tp  # replicated
    return math.ceil((spec.draft_layers * layer + fc) * bits / (8 * tp))
