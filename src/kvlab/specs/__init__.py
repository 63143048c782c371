"""Published facts, read offline: what a model is, what each layer caches, and the hardware and engine defaults.

- `arch`: the registry of published `config.json` files and each layer's attention kind (chapter 2).
- `layers`: layer kinds and what each caches, attends to and computes (chapters 2, 4, 13).
- `shape`: what sizing reads of a config, stored so that `kvlab size` needs neither torch nor transformers.
- `sizing`: exact KV-cache and weight bytes (chapters 2, 5, 6).
- `hardware`: accelerator datasheets, and this device's bandwidth and copies measured (chapter 4).
- `vllm_defaults`: vLLM 0.33.0's defaults in one cited table (chapters 5, 8, 14).

Nothing here imports the engine, the cost models or the book's tooling.
"""
