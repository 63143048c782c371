"""The serving engine: a small vLLM v1 on unmodified transformers models, one concept per module.

Requests flow `LLMEngine.step` -> `Scheduler.schedule` (with `BlockManager`) -> a runner -> back to
`Scheduler.update_from_output`. The scheduler owns each request's progress; the block manager owns its blocks.

    kvlab                                 vLLM v1 (vllm/v1/...)                          nano-vllm (nanovllm/...)
    llm_engine.LLMEngine                  engine/llm_engine.py LLMEngine                 engine/llm_engine.py LLMEngine
    config.EngineConfig, SchedulerConfig  config/ EngineArgs, SchedulerConfig            config.py Config
    request.Request                       request.py Request                             engine/sequence.py Sequence
    scheduler.Scheduler.schedule          core/sched/scheduler.py schedule               engine/scheduler.py schedule
    Scheduler.update_from_output          update_from_output                             postprocess
    Scheduler._preempt_request            _preempt_request                               preempt
    outputs.ScheduledBatch                core/sched/output.py SchedulerOutput           (seqs, is_prefill)
    outputs.RunnerOutput                  outputs.py ModelRunnerOutput                   token_ids
    block_manager.BlockManager            core/kv_cache_manager.py KVCacheManager        engine/block_manager.py
      .get_computed_blocks                  get_computed_blocks                            (in allocate)
      .allocate_slots                       allocate_slots                                 allocate, may_append
      (its loop over groups)                core/kv_cache_coordinator.py                   -
    single_type_kv_cache_manager          core/single_type_kv_cache_manager.py           -
      FullAttentionManager                  FullAttentionManager                           -
      SlidingWindowManager                  SlidingWindowManager                           -
      (none: no state layers served)        MambaManager                                   -
    block_pool.BlockPool                  core/block_pool.py BlockPool                   (in BlockManager)
    block_pool.hash_block_tokens          core/kv_cache_utils.py hash_block_tokens       compute_hash
    kv_pool.KVPool                        worker/gpu_model_runner.py kv_caches           model_runner.py kv_cache
    context.PagedContext                  attention metadata                             utils/context.py Context
    attention.paged_attention_forward     attention backends                             layers/attention.py
    model_runner.ModelRunner              worker/gpu_model_runner.py GPUModelRunner      engine/model_runner.py
    cost_runner.CostRunner                -                                              -

State layers (Mamba, linear attention) have no manager because nothing here allocates for them: the model
runner refuses a model that has them (`KVShape.from_config`), and the cost runner holds one full-attention group.
kvlab sizes their state (`kvlab.specs.sizing`, `kvlab.costs.hybrid_pages`) but does not serve it.
Also `clock` (wall, CPU-time or virtual time) and `metrics` (serving metrics under vLLM's benchmark names).
`from kvlab.engine import LLMEngine` loads torch only on first use, so that `kvlab --help` stays fast.
Chapters 5-9 and 14.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlab.engine.config import EngineConfig
    from kvlab.engine.llm_engine import LLMEngine, RequestOutput
    from kvlab.engine.request import Request, SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "Request", "RequestOutput", "SamplingParams"]

_OWNERS = {
    "EngineConfig": "kvlab.engine.config",
    "LLMEngine": "kvlab.engine.llm_engine",
    "RequestOutput": "kvlab.engine.llm_engine",
    "Request": "kvlab.engine.request",
    "SamplingParams": "kvlab.engine.request",
}


def __getattr__(name: str) -> Any:
    if name in _OWNERS:
        import importlib

        return getattr(importlib.import_module(_OWNERS[name]), name)
    raise AttributeError(f"module 'kvlab.engine' has no attribute {name!r}")
