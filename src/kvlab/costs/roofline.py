"""Roofline predictions of prefill and decode time: max(compute term, memory term).

A step takes at least its FLOPs over the peak FLOP/s, and at least its bytes moved over the memory bandwidth;
the larger of the two is the prediction (Williams et al., 2009, "Roofline", CACM 52(4)).

Memory term, decode: every weight byte is read once per step, plus the whole KV cache of every sequence
(`kvlab.specs.sizing.kv_cache_bytes` at `context_len`, so sliding-window layers count at most window - 1 tokens).
`context_len` is the length of the cache the step attends over. An untied input-embedding table is a gather:
a step reads only the rows of its tokens (a tied table doubles as the lm_head and is read whole, once).
Activations are not counted. MoE: a step reads only the experts its tokens route to; with uniform routing of `k` of `E` experts,
`t` tokens touch E·(1 - (1 - k/E)^t) experts per layer on average, which is `k` at one token and all `E` at a
large batch.

Compute term: a token costs 2 FLOP (one multiply-add) per weight it multiplies (Kaplan et al., 2020,
arXiv:2001.08361, Table 1), counting only the experts it routes to, and not the input embedding (a gather).
Attention adds, per layer and per token attended to, the q·k score (2 · heads · head_dim FLOP) and the
weighted sum of v (2 · heads · v_head_dim): 4 · layers · heads · head_dim · context per token. Kaplan's table
lists only the score term; the value sum costs as much again, which is the count in e.g. Chen (2022),
"Transformer inference arithmetic" (kipp.ly). Query heads count, not KV heads: grouped-query attention
shares K/V, it does not shrink the products. MLA is counted in its absorbed form (scores against the
kv_lora_rank + rope latent, values from the latent), as serving engines run it; transformers 5.24 instead
re-expands the latent for every cached token each step, which costs more. Prefill is causal: token i attends
to min(i + 1, window) tokens, summed over the triangle, and logits are computed for each prompt's last token
only. Approximations: norm weights count as if multiplied, rotary, softmax and activation functions are
ignored (each well under 1 % here); MoE experts are gated MLPs (3 × hidden × width) routed uniformly, while
real routers are skewed and so touch fewer distinct experts at a given batch.

`hw` is a spec-sheet entry (`kvlab.specs.hardware.get`), a name for one, or a `kvlab.specs.hardware.measure()` result.
Chapters: *Prefill and decode*, *Why decode is bandwidth-bound*, *Beyond HBM*, *Many GPUs*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from transformers import PretrainedConfig

from kvlab.checks import check_count
from kvlab.specs import hardware
from kvlab.specs.arch import ArchSpec, config_cache, describe, resolve
from kvlab.specs.shape import config_dtype
from kvlab.specs.sizing import (
    DType,
    dtype_bytes,
    kv_cache_bytes,
    kv_read_bytes,
    param_count,
    weight_bytes,
)

Hardware = hardware.Ceilings | str
Config = PretrainedConfig | str


@dataclass(frozen=True)
class StepEstimate:
    """One prefill or decode step on the roofline."""

    compute_s: float  # flops / peak FLOP/s
    memory_s: float  # bytes / bandwidth
    flops: float
    bytes: float  # weights read + KV read (decode) or written (prefill)
    weight_bytes: float
    kv_bytes: float
    tokens: int  # tokens the step produces: batch_size for decode, batch_size × prompt_len for prefill

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> Literal["compute", "memory"]:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte moved; the step is compute-bound where this exceeds the hardware's ridge point."""
        return self.flops / self.bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s


@dataclass(frozen=True)
class ModelCost:
    """What the roofline needs from a config, worked out once. Counts are of the text decoder."""

    spec: ArchSpec
    params: int
    matmul_params: int  # params a token multiplies when every expert is active (no input embedding)
    lm_head_params: int
    input_embedding_params: (
        int  # an untied input table, of which a step gathers only its tokens' rows (0 if tied)
    )
    vocab_size: int
    expert_params: int  # routed experts, all of them (0 for a dense model)
    num_experts: int
    experts_per_token: int

    @property
    def active_params(self) -> int:
        """Params one token multiplies: the dense part plus its `experts_per_token` routed experts."""
        if not self.num_experts:
            return self.matmul_params
        return self.matmul_params - self.expert_params * (self.num_experts - self.experts_per_token) // (
            self.num_experts
        )

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts per MoE layer that `tokens` tokens route to (uniform routing)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** tokens)

    def attention_flops(self, context: float) -> float:
        """FLOPs of one token's attention at sequence length `context`, in every layer (window-capped per layer)."""
        heads = self.spec.num_attention_heads
        return sum(layer.attention_flops(context, heads) for layer in self.spec.layers)

    def prefill_attention_flops(self, prompt_len: int) -> float:
        """FLOPs of causal attention over a prompt: token i attends to min(i + 1, window) tokens."""
        heads = self.spec.num_attention_heads
        return sum(layer.prefill_attention_flops(prompt_len, heads) for layer in self.spec.layers)


def _routed_experts(text: PretrainedConfig) -> tuple[int, int, int]:
    """(routed expert params in all layers, experts, experts per token), from the config's MoE fields.

    Each expert is a gated MLP: 3 × hidden × expert width. Mixtral's experts are `intermediate_size` wide in
    every layer; DeepSeek's are `moe_intermediate_size` wide in every layer from `first_k_dense_replace` on.
    Shared experts are always active and count as dense weights.
    """
    experts = getattr(text, "num_local_experts", None) or getattr(text, "n_routed_experts", None) or 0
    if not experts:
        return 0, 0, 0
    per_token = text.num_experts_per_tok
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    moe_layers = text.num_hidden_layers - (getattr(text, "first_k_dense_replace", None) or 0)
    return moe_layers * experts * 3 * text.hidden_size * width, experts, per_token


@config_cache
def _cost_of(text: PretrainedConfig) -> ModelCost:
    params = param_count(text)
    embedding = text.vocab_size * text.hidden_size
    tied = getattr(text, "tie_word_embeddings", False)
    expert_params, experts, per_token = _routed_experts(text)
    return ModelCost(
        spec=describe(text),
        params=params,
        # A tied table is one tensor, used as the lm_head; an untied input table is only gathered.
        matmul_params=params if tied else params - embedding,
        lm_head_params=embedding,
        input_embedding_params=0 if tied else embedding,
        vocab_size=text.vocab_size,
        expert_params=expert_params,
        num_experts=experts,
        experts_per_token=per_token,
    )


def model_cost(config: Config) -> ModelCost:
    """Params, active params and attention shape of `config` (a config or a registry name), cached."""
    config = resolve(config)
    text = config.get_text_config(decoder=True)  # image-text models: decoding runs the text decoder only
    return _cost_of(text)


def active_params(config: Config) -> int:
    """Weights one token multiplies (MoE: its routed experts only; the input embedding is not counted)."""
    return model_cost(config).active_params


def _hardware(hw: Hardware) -> hardware.Ceilings:
    if isinstance(hw, str):
        return hardware.get(hw)
    if not isinstance(hw, hardware.Ceilings):
        raise TypeError(
            f"hw must be a kvlab.specs.hardware entry, its name, or a measure() result; got {hw!r}"
        )
    return hw


def memory_seconds(
    total_bytes: float, weight_bytes: float, hw: hardware.Ceilings, efficiency: float = 1.0
) -> float:
    """Seconds to move a step's `total_bytes` at `efficiency` × the ceilings: its `weight_bytes` at
    `hardware.weight_read_rate` (the bandwidth, or a measured matrix-vector rate where it differs, as on a
    CPU), the rest (the cache) at the bandwidth."""
    bandwidth = hw.bandwidth_bytes_per_s * efficiency
    weight_rate = hardware.weight_read_rate(hw) * efficiency
    if weight_rate == bandwidth:
        return total_bytes / bandwidth
    return weight_bytes / weight_rate + (total_bytes - weight_bytes) / bandwidth


def _dtypes(config: Config, dtype: DType, kv_dtype: DType) -> tuple[DType, DType]:
    config = resolve(config)
    dtype = config_dtype(config) if dtype is None else dtype
    dtype_bytes(dtype)  # fail early on an unknown name
    return dtype, dtype if kv_dtype is None else kv_dtype


def _weights_read(config: Config, cost: ModelCost, dtype: DType, tokens: float) -> float:
    """Weight bytes a step over `tokens` tokens reads: all of them, less the experts no token routed to and
    the rows of an untied input-embedding table that no token gathers (a tied table is the lm_head: read whole)."""
    config = resolve(config)
    total = float(weight_bytes(config.get_text_config(decoder=True), dtype))
    if cost.input_embedding_params:
        unread_rows = 1 - min(tokens, cost.vocab_size) / cost.vocab_size
        total -= cost.input_embedding_params * dtype_bytes(dtype) * unread_rows
    if cost.num_experts:
        untouched = 1 - cost.experts_touched(tokens) / cost.num_experts
        total -= cost.expert_params * dtype_bytes(dtype) * untouched
    return total


def _decode(
    config: Config, hw: Hardware, batch: float, context_len: int, dtype: DType, kv_dtype: DType
) -> StepEstimate:
    hw = _hardware(hw)
    cost = model_cost(config)
    dtype, kv_dtype = _dtypes(config, dtype, kv_dtype)
    weights = _weights_read(config, cost, dtype, batch)
    kv = batch * kv_read_bytes(config, context_len, kv_dtype)
    flops = batch * (2 * cost.active_params + cost.attention_flops(context_len))
    return StepEstimate(
        compute_s=flops / hw.flops,
        memory_s=memory_seconds(weights + kv, weights, hw),
        flops=flops,
        bytes=weights + kv,
        weight_bytes=weights,
        kv_bytes=kv,
        tokens=int(batch),
    )


# --- The realistic step-cost model (chapter *Capacity planning*, book/14_capacity_planning) ----------------------
#
# The roofline above is a lower bound: real engines run slower. Three things close most of the gap:
# 1. achievable ceilings: a large copy reaches about 83 % of the datasheet HBM bandwidth (gpt-fast's README,
#    pytorch-labs/gpt-fast: "peak bandwidth is about 1700 GB/s" on an A100-80GB rated 2,039 GB/s). Dense bf16
#    matmuls reach 80-87 % of the tensor-core peak at their best shape: Stas Bekman's Maximum Achievable Matmul
#    FLOPS table (github.com/stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul
#    FLOPS comparison table", torch.matmul, mean of 100 iterations) lists 794.5 of 989 TFLOP/s (80.3 %) on an
#    H100 SXM and 271.2 of 312 (86.9 %) on an A100 SXM; Horace He's gist "H100 peak matmul FLOPS"
#    (gist.github.com/Chillee/2ec89696db8b7ed1c24461159e325405) reaches 780 TFLOP/s with a tuned CUTLASS kernel.
#    kvlab takes 0.80, the H100 figure (the lower; a model's own shapes do not beat the best one);
#    `hardware.measure()` on the device replaces both ceilings (a measured ceiling is used as it is);
# 2. a fixed per-step overhead (kernel launches, scheduling, sampling, the host loop). Engines that do this host
#    work serially leave the GPU idle for it: vLLM's multi-step scheduling RFC (vllm-project/vllm#6854, 2024)
#    measured about 4 ms of GPU bubble per decode step, and the vLLM v0.6.0 performance blog
#    (blog.vllm.ai/2024/09/05/perf-update.html) found the API server and the scheduler taking 33 % and 29 % of the
#    time for Llama 3 8B on one H100. Engines since overlap it with the GPU (vLLM's async output processing and
#    V1 engine, SGLang 0.4's "zero-overhead" overlap scheduler, lmsys.org/blog/2024-12-04-sglang-v0-4). What
#    remains in the cited calibration figures (tests/data/published_decode.json: gpt-fast, vLLM 0.21-0.23 on
#    A100 and H100) after the bandwidth term is 1.1-1.7 ms per step; kvlab's default, 1 ms, is the low end of
#    that, an overlapped engine (`timing.measure_step_overhead` measures it on the device);
# 3. the compute peak of the weights' dtype: fp8 weights run at the fp8 peak (`hardware.peak_flops`).
# What it cannot express: speculative decoding (several tokens per step), quantized-weight kernels whose
# dequantisation costs compute (int4/int8 weight-only), tensor parallelism's latency beyond `tp_decode_step`.


@dataclass(frozen=True)
class Realism:
    """How far below the datasheet a real engine runs: shares of the ceilings and a fixed cost per step."""

    bandwidth_efficiency: float = 0.83  # gpt-fast README: ~1700 of 2039 GB/s on an A100-80GB
    flops_efficiency: float = 0.80  # MAMF table: 794.5 of 989 TFLOP/s bf16 on an H100 SXM (see above)
    step_overhead_s: float = 1e-3  # low end of the cited figures' 1.1-1.7 ms residual (see above)

    def __post_init__(self) -> None:
        for name in ("bandwidth_efficiency", "flops_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if self.step_overhead_s < 0:
            raise ValueError(f"step_overhead_s must be >= 0, got {self.step_overhead_s!r}")


REALISM = Realism()


def realistic_time(
    step: StepEstimate, hw: Hardware, dtype: DType = None, realism: Realism | None = None
) -> float:
    """Seconds of a roofline `step` under the realistic model: FLOPs over the achievable peak of `dtype`, bytes
    over the achievable bandwidth, the larger of the two, plus the per-step overhead. With a measured `hw`
    (`hardware.measure()`), its ceilings are already achieved ones and are used whole."""
    realism = REALISM if realism is None else realism
    hw = _hardware(hw)
    measured = isinstance(hw, hardware.Measurement)
    efficiency = 1.0 if measured else realism.bandwidth_efficiency
    memory = memory_seconds(step.bytes, step.weight_bytes, hw, efficiency)
    peak = hardware.peak_flops(hw, None if dtype is None else str(dtype))
    flops = peak * (1.0 if measured else realism.flops_efficiency)
    return max(step.flops / flops, memory) + realism.step_overhead_s


def decode_step(
    config: Config,
    hw: Hardware,
    batch_size: int = 1,
    context_len: int = 1,
    dtype: DType = None,
    kv_dtype: DType = None,
) -> StepEstimate:
    """One decode step of `batch_size` sequences, each attending over a cache of `context_len` tokens.

    `dtype` is the weights' (default: the config's); `kv_dtype` the cache's (default: `dtype`).
    """
    check_count("batch_size", batch_size)
    check_count("context_len", context_len)
    return _decode(config, hw, batch_size, context_len, dtype, kv_dtype)


def decode_step_time(
    config: Config,
    hw: Hardware,
    batch_size: int = 1,
    context_len: int = 1,
    dtype: DType = None,
    kv_dtype: DType = None,
    *,
    realistic: bool = False,
    realism: Realism | None = None,
) -> float:
    """Predicted seconds of one decode step (see `decode_step`): the roofline bound, or with `realistic=True`
    the realistic model (`realistic_time`: achievable ceilings, fp8 peak, per-step overhead)."""
    step = decode_step(config, hw, batch_size, context_len, dtype, kv_dtype)
    return _seconds(step, config, hw, dtype, kv_dtype, realistic, realism)


def _seconds(
    step: StepEstimate,
    config: Config,
    hw: Hardware,
    dtype: DType,
    kv_dtype: DType,
    realistic: bool,
    realism: Realism | None,
) -> float:
    """A step's predicted seconds: its roofline bound, or the realistic model's time."""
    if not realistic:
        return step.time_s
    return realistic_time(step, hw, _dtypes(config, dtype, kv_dtype)[0], realism)


def prefill(
    config: Config,
    hw: Hardware,
    batch_size: int = 1,
    prompt_len: int = 1,
    dtype: DType = None,
    kv_dtype: DType = None,
) -> StepEstimate:
    """Prefill of `batch_size` prompts of `prompt_len` tokens: weights read once, the new cache written once."""
    check_count("batch_size", batch_size)
    check_count("prompt_len", prompt_len)
    hw = _hardware(hw)
    cost = model_cost(config)
    dtype, kv_dtype = _dtypes(config, dtype, kv_dtype)
    tokens = batch_size * prompt_len
    weights = _weights_read(config, cost, dtype, tokens)
    kv = kv_cache_bytes(config, prompt_len, batch_size, kv_dtype)
    # Logits only for each prompt's last token (what generate() and serving engines compute).
    body = cost.active_params - cost.lm_head_params
    flops = 2 * (
        body * tokens + cost.lm_head_params * batch_size
    ) + batch_size * cost.prefill_attention_flops(prompt_len)
    return StepEstimate(
        compute_s=flops / hw.flops,
        memory_s=memory_seconds(weights + kv, weights, hw),
        flops=flops,
        bytes=weights + kv,
        weight_bytes=weights,
        kv_bytes=kv,
        tokens=tokens,
    )


def prefill_time(
    config: Config,
    hw: Hardware,
    batch_size: int = 1,
    prompt_len: int = 1,
    dtype: DType = None,
    kv_dtype: DType = None,
    *,
    realistic: bool = False,
    realism: Realism | None = None,
) -> float:
    """Predicted seconds to prefill (the time to first token, less queueing and sampling): the roofline bound,
    or with `realistic=True` the realistic model (see `decode_step_time`)."""
    step = prefill(config, hw, batch_size, prompt_len, dtype, kv_dtype)
    return _seconds(step, config, hw, dtype, kv_dtype, realistic, realism)


def compute_bound_prompt_len(
    config: Config, hw: Hardware, batch_size: int = 1, dtype: DType = None, longest: int = 2**24
) -> int | None:
    """The shortest prompt whose prefill is compute-bound on `hw` (None if none up to `longest` tokens).

    Below it the prefill costs about its weight read, whatever the prompt's length: the fixed floor of the
    time to first token. The compute term grows with the prompt faster than the memory term, so the bound
    changes once, and a bisection finds the change.
    """
    check_count("longest", longest)

    def compute_bound(prompt_len: int) -> bool:
        return prefill(config, hw, batch_size, prompt_len, dtype).bound == "compute"

    if compute_bound(1):
        return 1
    if not compute_bound(longest):
        return None
    lo, hi = 1, longest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi


def critical_batch_size(
    config: Config, hw: Hardware, context_len: int = 1, dtype: DType = None, kv_dtype: DType = None
) -> float | None:
    """The batch size at which a decode step's compute term reaches its memory term; None if it never does.

    A real number: decode is memory-bound below it and compute-bound above. Each sequence adds FLOPs and KV
    bytes in a fixed ratio (the attention's intensity); when that ratio is below the hardware's ridge point,
    as at long contexts, more sequences never make decode compute-bound.
    """
    check_count("context_len", context_len)

    def gap(batch: float) -> float:
        step = _decode(config, hw, batch, context_len, dtype, kv_dtype)
        return step.compute_s - step.memory_s

    if gap(1.0) >= 0:
        lo = hi = 1.0  # already compute-bound at one sequence: search below it
        while gap(lo) >= 0:
            lo /= 2
            if lo < 1e-9:
                return 0.0
    else:
        lo, hi = 1.0, 2.0
        while gap(hi) < 0:
            lo, hi = hi, hi * 2
            if hi > 2**40:
                return None
    # gap is convex in the batch (linear compute, concave MoE weight reads), so it crosses zero once.
    for _ in range(200):
        mid = (lo + hi) / 2
        if gap(mid) >= 0:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi


# --- Tensor parallelism: the communication term (chapter *Many GPUs*, book/13_many_gpus) -------------------
#
# Megatron-style tensor parallelism (Shoeybi et al., 2019, arXiv:1909.08053, §3) splits attention heads and the
# MLP's width across `tp` ranks; each layer ends its attention and its MLP with an all-reduce of the partial
# outputs: two all-reduces per layer, each of tokens × hidden × bytes. A ring all-reduce of a buffer of B bytes
# makes every rank send (and receive) 2(n-1)/n × B (Patarasuk & Yuan, 2009, "Bandwidth optimal all-reduce
# algorithms for clusters of workstations", JPDC 69(2); NCCL's "bus bandwidth" uses the same factor). Each
# rank's sends run over its own link in one direction, so the time is those bytes over the per-direction link
# bandwidth (`kvlab.specs.hardware.gpu_link_bytes_per_s`). The all-reduces sit on the critical path (a layer cannot
# start before the previous one's sum), so the term is added to the step, not overlapped. A fixed latency per
# all-reduce is not in any datasheet; it is a parameter (default 0), so the default term is a lower bound.


def allreduce_buffer_bytes(config: Config, tokens: int = 1, dtype: DType = None) -> int:
    """Bytes entering the all-reduces of one forward over `tokens` tokens under Megatron TP (any tp > 1):
    2 per layer × tokens × hidden × bytes per element. What each rank hands to the collective."""
    check_count("tokens", tokens)
    config = resolve(config)
    spec = describe(config)
    dtype = config_dtype(config) if dtype is None else dtype
    return 2 * spec.num_layers * tokens * spec.hidden_size * dtype_bytes(dtype)


def ring_allreduce_bytes_sent(buffer_bytes: float, ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of `buffer_bytes` over `ranks` ranks."""
    check_count("ranks", ranks)
    return 2 * (ranks - 1) / ranks * buffer_bytes


@dataclass(frozen=True)
class ParallelStepEstimate:
    """One decode step on one of `tp` tensor-parallel ranks: its own roofline plus the all-reduces."""

    tp: int
    compute_s: float
    memory_s: float
    comm_s: float  # all-reduce time on the link, plus the latency term if one was given
    weight_bytes: float  # this rank's weights read
    kv_bytes: float  # this rank's cache read
    allreduce_bytes: float  # bytes this rank hands to all-reduces in the step
    link_bytes: float  # bytes this rank sends on its link (ring factor applied)
    tokens: int

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s


def tp_decode_step(
    config: Config,
    hw: hardware.Accelerator | str,
    tp: int = 1,
    batch_size: int = 1,
    context_len: int = 1,
    dtype: DType = None,
    kv_dtype: DType = None,
    allreduce_latency_s: float = 0.0,
) -> ParallelStepEstimate:
    """A decode step of `batch_size` sequences split over `tp` GPUs of kind `hw` (modelled, not measured).

    Each rank reads its share of the weights (`kvlab.specs.sizing.weight_bytes_per_gpu`) and its share of the cache
    (`kvlab.specs.sizing.kv_cache_bytes(..., tp=tp)`, copies included), does 1/tp of the FLOPs, then pays two ring
    all-reduces per layer over its link (`kvlab.specs.hardware.gpu_link_bytes_per_s`, per direction), plus
    `allreduce_latency_s` each. `tp=1` is `decode_step` with no communication.
    """
    from kvlab.specs.sizing import weight_bytes_per_gpu

    check_count("tp", tp)
    check_count("batch_size", batch_size)
    check_count("context_len", context_len)
    if allreduce_latency_s < 0:
        raise ValueError(f"allreduce_latency_s must be >= 0, got {allreduce_latency_s!r}")
    acc = hardware.get(hw) if isinstance(hw, str) else hw
    config = resolve(config)
    whole = _decode(config, acc, batch_size, context_len, dtype, kv_dtype)
    dtype, kv_dtype = _dtypes(config, dtype, kv_dtype)
    text = config.get_text_config(decoder=True)
    share = weight_bytes_per_gpu(text, dtype, tp=tp) / weight_bytes(text, dtype)
    weights = whole.weight_bytes * share
    kv = batch_size * kv_read_bytes(config, context_len, kv_dtype, tp=tp)
    buffer = allreduce_buffer_bytes(config, batch_size, dtype) if tp > 1 else 0
    sent = ring_allreduce_bytes_sent(buffer, tp)
    calls = 2 * describe(config).num_layers if tp > 1 else 0
    comm = sent / hardware.gpu_link_bytes_per_s(acc) + calls * allreduce_latency_s if tp > 1 else 0.0
    return ParallelStepEstimate(
        tp=tp,
        compute_s=whole.compute_s / tp,
        memory_s=(weights + kv) / acc.bandwidth_bytes_per_s,
        comm_s=comm,
        weight_bytes=weights,
        kv_bytes=kv,
        allreduce_bytes=buffer,
        link_bytes=sent,
        tokens=batch_size,
    )
