"""Cost models built on the published facts: memory, time per step, and the traces they are run on.

- `budget`: the memory budget as vLLM 0.33.0 computes it, term by term (chapters 5, 6, 13, 14).
- `hybrid_pages`: how vLLM pages a hybrid model's state beside its KV blocks (chapter 7).
- `roofline`: prefill and decode time as max(compute, memory), critical batch (chapters 3, 4).
- `sglang`: SGLang's static KV pool (chapter 5).
- `workloads`: seeded synthetic request traces (chapters 5-9, 14).
"""
