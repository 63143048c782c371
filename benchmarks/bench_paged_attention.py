"""Paged attention vs contiguous SDPA on the same K and V: what reading through block tables costs.

One decode step of `batch` sequences, each with `context` cached tokens, for one layer. Contiguous: K and V
already laid out as `(batch, kv_heads, context, head_dim)`, one SDPA call. Paged: the same K/V scattered over
randomly permuted blocks of a pool; the step writes the new token through the slot mapping and gathers the
sequences' blocks (one `index_select` per run of at most `kv_pool.GATHER_CHUNK_BYTES` of K and V, into a reused
workspace) before an SDPA call per run (`kvlab.engine.kv_pool.paged_attention_forward`).

    .venv/bin/python benchmarks/bench_paged_attention.py
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kvlab.engine.attention import paged_attention_forward
from kvlab.engine.context import PagedContext
from kvlab.engine.kv_pool import KVPool, KVShape, slots_for
from kvlab.env import env_report
from kvlab.measure import percentiles, time_call
from kvlab.units import cdiv


def bench(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, repeat: int):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(batch, kv_heads, context, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, context, head_dim, generator=gen)
    q = torch.randn(batch, heads, 1, head_dim, generator=gen)
    blocks_per_seq = cdiv(context, block_size)
    pool = KVPool(KVShape(1, kv_heads, head_dim), batch * blocks_per_seq, block_size)
    order = torch.randperm(pool.num_blocks, generator=gen).tolist()
    tables = [order[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    for i, table in enumerate(tables):
        pool.write(
            0,
            torch.tensor(slots_for(table, 0, context, block_size)),
            k[i].transpose(0, 1),
            v[i].transpose(0, 1),
        )
    # The step re-writes each sequence's last token (its "new" token) through the slot mapping.
    slots = torch.tensor([slots_for(t, context - 1, context, block_size)[0] for t in tables])
    ctx = PagedContext.build(pool, slots, [1] * batch, [context] * batch, tables)
    module = SimpleNamespace(layer_idx=0)
    query_flat = q.transpose(0, 2)  # (1, heads, batch, head_dim): one token per sequence, flattened
    new_k, new_v = k[:, :, -1:].transpose(0, 2), v[:, :, -1:].transpose(0, 2)

    def contiguous():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    # The query heads of one KV head as its query rows, the way the paged decode calls SDPA
    grouped_q = q.view(batch, kv_heads, heads // kv_heads, head_dim)

    def grouped():
        F.scaled_dot_product_attention(grouped_q, k, v)

    def paged():
        paged_attention_forward(module, query_flat, new_k, new_v, None, paged_context=ctx)

    out_paged = paged_attention_forward(module, query_flat, new_k, new_v, None, paged_context=ctx)[0][0]
    out_contig = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[:, :, 0]
    error = (out_paged - out_contig).abs().max().item()
    times = {}
    for name, fn in (("contiguous", contiguous), ("grouped", grouped), ("paged", paged)):
        times[name] = percentiles(time_call(fn, "cpu", repeat=repeat, warmup=2), (50,))["p50"]
    return times, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(env_report("cpu"))
    print(
        f"decode attention, one layer, {args.heads} heads / {args.kv_heads} KV heads × {args.head_dim}, fp32"
    )
    print("contig: SDPA with enable_gqa; grouped: SDPA with each KV head's query heads as its query rows")
    print(
        f"{'batch':>5} {'context':>7} {'contig ms':>10} {'grouped ms':>10} {'paged ms':>9} "
        f"{'paged/contig':>12} {'paged/grouped':>13} {'max err':>9}"
    )
    ratios = []
    for batch, context in [(1, 512), (8, 512), (8, 2048), (32, 1024)]:
        times, error = bench(
            batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size, args.repeat
        )
        c, g, p = (times[name] * 1e3 for name in ("contiguous", "grouped", "paged"))
        ratios.append((p / c, p / g))
        print(
            f"{batch:>5} {context:>7} {c:>10.3f} {g:>10.3f} {p:>9.3f} {p / c:>12.2f} {p / g:>13.2f}"
            f" {error:>9.1e}"
        )
    print(
        f"median over shapes: paged/contig {statistics.median(r[0] for r in ratios):.2f}, "
        f"paged/grouped {statistics.median(r[1] for r in ratios):.2f}"
    )


if __name__ == "__main__":
    main()
