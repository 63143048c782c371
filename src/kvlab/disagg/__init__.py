"""Disaggregated prefill and decode (chapter 17): one engine prefills, another decodes, K/V moves between.

- `connector`: the two halves of a KV connector on `LLMEngine`s: `KVCapture` copies a prompt's K/V out of the
  prefill engine's pool, `Request.prefilled` admits it on the decode engine with its prompt counted computed;
  `prefill_all` and `decode_all` run them in one process.
- `pd`: the two engines as two processes over `torch.distributed` (gloo on CPU, NCCL between two GPUs), a link
  probe and its fit (`LinkFit`), and per-request timings (`RequestTrace`).

Import from the module that owns a name (`from kvlab.disagg.pd import run_disaggregated`).
"""
