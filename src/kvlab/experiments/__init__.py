"""The chapters' measurements on real transformers models: each module times or checks what a chapter claims.

- `timing`: prefill and decode steps timed beside the roofline (chapters 3, 4).
- `decode`: decoding with and without the cache (chapter 1).
- `quant`: quantized KV caches as transformers cache layers, and their accuracy (chapters 10, 11).
- `evict`: caches that keep fewer tokens (uniform, StreamingLLM, SnapKV, H2O) as transformers cache layers.
- `parallel`: tensor and pipeline parallelism on real `torch.distributed` ranks (chapter 13).
- `wallclock`: continuous against static batching on the wall clock (chapter 8).
- `prefix_ttft`: a prefix-cache hit in time to first token (chapter 9).
"""
