"""Planning a deployment: the engine run on a cost model, capacity plans, the first lever, and vLLM's own log.

- `simulate`: the engine's loop on a `CostRunner` and a virtual clock (chapter 14).
- `plan`: capacity plans against latency targets, `kvlab plan` (chapter 14).
- `diagnose`: from a workload to the first KV-cache lever that applies, `kvlab diagnose` (chapter 15).
- `vllm_log`, `explain_vllm`: a vLLM start-up log read, and its budget explained, `kvlab explain-vllm` (chapter 5).
- `router`: requests routed over engine replicas by four policies, and the prefix-cache hits each gets, predicted
  exactly (chapter 17).
- `cluster`: many engines on one simulated time axis: colocated replicas against prefill and decode pools with a
  transfer stage between them (chapter 17).
"""
