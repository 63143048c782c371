"""Many GPUs: where the KV cache lives under tensor, pipeline and data parallelism, on real `torch.distributed` ranks.

- **Tensor parallel (TP)**, the Megatron pattern (Shoeybi et al., 2019, arXiv:1909.08053, §3): every rank keeps
  `heads / tp` query heads and `max(1, kv_heads // tp)` KV heads of every layer (vLLM's rule, `QKVParallelLinear`
  and `ModelConfig.get_num_kv_heads`: past the KV-head count each head is copied on `tp // kv_heads` ranks), the
  MLP's gate/up projections by rows (column parallel) and its down projection by columns (row parallel). The
  attention output projection and the down projection each end in an all-reduce: two per layer. Each rank's
  cache holds only its own KV heads. `shard_tensor_parallel` does this in place on a Hugging Face Llama, Mistral,
  Qwen2 or Qwen3 model, with kvlab's own slicing, because transformers 5.24's `tp_plan="auto"` does not copy KV
  heads past their count (huggingface/transformers#48307).
- **Pipeline parallel (PP)**: each stage keeps its own layers (split as vLLM's `get_pp_indices` splits them,
  `kvlab.specs.sizing.pipeline_stages`) and only those layers' cache; it sends its hidden states to the next stage.
- **Data parallel (DP)**: independent replicas, each with the whole model and its own sequences' cache; no
  communication at decode time. Nothing to run: `placement` computes it with the same sizing code.

`run_distributed` launches real ranks (`python -m kvlab.experiments.parallel`, one process each, gloo on CPU, NCCL when
each rank has its own GPU), each of which builds the same seeded tiny model, computes the single-process reference,
shards it, decodes, and writes what it measured to JSON: cache bytes from its real `DynamicCache` tensors,
parameter bytes from its real tensors, and the bytes it handed to every all-reduce or send, counted by wrapping
the collective (not timed: loopback gloo timings are noise at these sizes). Every collective has a timeout
(`init_process_group(timeout=...)`) and the launcher kills the ranks it started when one fails or the deadline
passes. Chapter: *Many GPUs* (book/13_many_gpus).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvlab.checks import check_count
from kvlab.specs import sizing
from kvlab.specs.arch import describe, resolve
from kvlab.units import cdiv

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAST_PIDS: list[int] = []  # the ranks `run_distributed` started last (tests check none outlives it)


class CountingCollective:
    """Wraps `torch.distributed` all-reduce and send so every call's bytes are counted before it runs."""

    def __init__(self) -> None:
        self.allreduce_calls = 0
        self.allreduce_bytes = 0
        self.send_calls = 0
        self.send_bytes = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.allreduce_calls += 1
        self.allreduce_bytes += tensor.numel() * tensor.element_size()
        dist.all_reduce(tensor)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        self.send_calls += 1
        self.send_bytes += tensor.numel() * tensor.element_size()
        dist.send(tensor.contiguous(), dst)


def _rows(linear: nn.Linear, start: int, stop: int) -> None:
    """Keep output features [start, stop) (column parallel)."""
    linear.weight = nn.Parameter(linear.weight.data[start:stop].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:stop].clone())
    linear.out_features = stop - start


def _columns(linear: nn.Linear, start: int, stop: int, tp: int) -> None:
    """Keep input features [start, stop) (row parallel); a bias is kept on every rank, divided by `tp`, so the
    all-reduce sums it back to one copy."""
    linear.weight = nn.Parameter(linear.weight.data[:, start:stop].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data / tp)
    linear.in_features = stop - start


def kv_head_range(kv_heads: int, tp: int, rank: int) -> range:
    """The KV heads rank `rank` of `tp` keeps: its own slice up to `kv_heads` ranks, past that one head each,
    head `rank // (tp // kv_heads)`, so query head h still meets KV head h // (heads // kv_heads)."""
    per_rank = max(1, kv_heads // tp)
    first = rank * per_rank if tp <= kv_heads else rank // (tp // kv_heads)
    return range(first, first + per_rank)


def shard_tensor_parallel(
    model: Any, rank: int, tp: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Shard a Llama/Mistral/Qwen2/Qwen3 causal LM in place for rank `rank` of `tp` (see the module docstring).

    Embedding, lm_head and norms stay whole on every rank; `all_reduce` is called on the output of every
    attention output projection and every MLP down projection.
    """
    config = model.config
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"tensor-parallel sharding supports {', '.join(SUPPORTED_FAMILIES)}, not {config.model_type!r}"
        )
    spec = describe(config)
    sizing.check_parallel(spec, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
    heads, kv_heads, head_dim = spec.num_attention_heads, spec.kv_heads, spec.head_dim
    width = config.intermediate_size
    if width % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the MLP width {width}")
    q_local = heads // tp
    kv = kv_head_range(kv_heads, tp, rank)

    def reduce_hook(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return all_reduce(output)

    for layer in model.model.layers:
        attn = layer.self_attn
        _rows(attn.q_proj, rank * q_local * head_dim, (rank + 1) * q_local * head_dim)
        _rows(attn.k_proj, kv.start * head_dim, kv.stop * head_dim)
        _rows(attn.v_proj, kv.start * head_dim, kv.stop * head_dim)
        _columns(attn.o_proj, rank * q_local * head_dim, (rank + 1) * q_local * head_dim, tp)
        attn.num_key_value_groups = q_local // len(kv)
        attn.o_proj.register_forward_hook(reduce_hook)
        mlp = layer.mlp
        local = width // tp
        _rows(mlp.gate_proj, rank * local, (rank + 1) * local)
        _rows(mlp.up_proj, rank * local, (rank + 1) * local)
        _columns(mlp.down_proj, rank * local, (rank + 1) * local, tp)
        mlp.down_proj.register_forward_hook(reduce_hook)


def keep_stage(model: Any, stage: int, pp: int) -> Any:
    """Cut a Llama-family causal LM down to pipeline stage `stage` of `pp`, in place; returns the stage's config.

    The stage keeps its own layers (renumbered from 0, so its `DynamicCache` has only those), the first stage
    the embedding, the last the final norm and the lm_head.
    """
    config = model.config
    layers = sizing.pipeline_stages(config.num_hidden_layers, pp)[stage]
    stage_config = copy.deepcopy(config)
    stage_config.num_hidden_layers = len(layers)
    if getattr(stage_config, "layer_types", None) is not None:
        stage_config.layer_types = [config.layer_types[i] for i in layers]
    kept = [model.model.layers[i] for i in layers]
    for local, layer in enumerate(kept):
        layer.self_attn.layer_idx = local
    model.model.layers = nn.ModuleList(kept)
    model.model.config = stage_config
    if stage > 0:
        model.model.embed_tokens = None
    if stage < pp - 1:
        model.model.norm = nn.Identity()
        model.lm_head = None
    return stage_config


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a module holds (a tied tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- data-parallel and per-GPU placement (computed) ---------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """What one GPU holds under a plan of `tp` × `pp` × `dp` GPUs serving `batch` sequences of `context` tokens."""

    tp: int
    pp: int
    dp: int
    weight_bytes: int  # one GPU's weights (largest stage)
    kv_bytes: int  # one GPU's cache (largest stage), for its replica's share of the sequences
    kv_copies: int  # how many GPUs hold a copy of each cached head (1 = split, not copied)
    sequences_per_replica: int

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def placement(
    config: Any,
    context: int,
    batch: int = 1,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    kv_dtype: sizing.DType = "bf16",
    weight_dtype: sizing.DType | int = "bf16",
) -> Placement:
    """Per-GPU weights and KV of a plan (modelled with `kvlab.specs.sizing`; DP replicas split the `batch` sequences
    between them, rounding up, and each holds the whole model)."""
    check_count("dp", dp)
    check_count("batch", batch)
    config = resolve(config)
    spec = describe(config)
    per_replica = cdiv(batch, dp)
    return Placement(
        tp=tp,
        pp=pp,
        dp=dp,
        weight_bytes=sizing.weight_bytes_per_gpu(config, weight_dtype, tp=tp, pp=pp),
        kv_bytes=sizing.kv_cache_bytes(config, context, per_replica, kv_dtype, tp=tp, pp=pp),
        kv_copies=max(layer.replicas(tp) for layer in spec.layers),
        sequences_per_replica=per_replica,
    )


# --- the worker: one rank of a real distributed run ---------------------------------------------------------

_MODEL_KNOBS = ("family", "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")


def _tiny(args: argparse.Namespace, device: torch.device) -> Any:
    from kvlab.models import tiny_model

    knobs = {name: getattr(args, name) for name in _MODEL_KNOBS if name != "family"}
    return tiny_model(args.family, seed=args.seed, device=device, attn_implementation="sdpa", **knobs)


def _prompt(args: argparse.Namespace, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(2, args.vocab, (args.batch, args.prompt_len), generator=generator).to(device)


@torch.no_grad()
def _reference(model: Any, prompt: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Greedy decoding on the whole model in this one process: the inputs of every forward and its last logits."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    inputs, logits = [prompt], []
    for step in range(steps + 1):
        out = model(input_ids=inputs[-1], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].float().cpu())
        if step < steps:
            inputs.append(out.logits[:, -1:].argmax(-1))
    return inputs, logits


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from transformers import DynamicCache

    from kvlab.measure import cache_inventory, cache_tensor_bytes

    world = args.tp * args.pp
    if args.world_size != world:
        raise ValueError(
            f"world size {args.world_size} does not match tp × pp = {args.tp} × {args.pp} = {world}"
        )
    if args.tp > 1 and args.pp > 1:
        raise ValueError("the demo runs tensor or pipeline parallelism, not both at once")
    if not 0 <= args.rank < world:
        raise ValueError(f"rank {args.rank} is outside 0..{world - 1}")
    use_cuda = args.backend == "nccl"
    device = torch.device(f"cuda:{args.rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, args.threads))

    model = _tiny(args, device)
    config: Any = copy.deepcopy(model.config)
    dtype_name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[model.dtype]
    prompt = _prompt(args, device)
    inputs, ref_logits = _reference(model, prompt, args.steps)

    dist.init_process_group(
        args.backend,
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=world,
        timeout=timedelta(seconds=args.timeout),
    )
    try:
        comm = CountingCollective()
        started = time.perf_counter()
        logits: list[torch.Tensor] = []
        with torch.no_grad():
            if args.pp == 1:
                shard_tensor_parallel(model, args.rank, args.tp, comm.all_reduce)
                cache = DynamicCache(config=config)
                for ids in inputs:
                    out = model(input_ids=ids, cache=cache, use_cache=True)
                    logits.append(out.logits[:, -1].float().cpu())
            else:
                stage_config = keep_stage(model, args.rank, args.pp)
                cache = DynamicCache(config=stage_config)
                for ids in inputs:
                    shape = (*ids.shape, config.hidden_size)
                    if args.rank == 0:
                        hidden = model.model(input_ids=ids, cache=cache, use_cache=True)
                    else:
                        received = torch.empty(shape, dtype=model.dtype, device=device)
                        dist.recv(received, args.rank - 1)
                        hidden = model.model(inputs_embeds=received, cache=cache, use_cache=True)
                    if args.rank < args.pp - 1:
                        comm.send(hidden.last_hidden_state, args.rank + 1)
                    else:
                        logits.append(model.lm_head(hidden.last_hidden_state[:, -1]).float().cpu())
        if use_cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
        dist.barrier()
    finally:
        dist.destroy_process_group()

    tokens = args.prompt_len + args.steps
    layers_here = len(model.model.layers)
    kv_per_rank = [tuple(row.shape) for row in cache_inventory(cache) if row.name == "keys"]
    compared = len(logits) > 0
    max_diff = (
        max((float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True)), default=0.0)
        if compared
        else None
    )
    scale = max(float(t.abs().max()) for t in ref_logits)
    result: dict[str, Any] = {
        "rank": args.rank,
        "world_size": world,
        "tp": args.tp,
        "pp": args.pp,
        "backend": args.backend,
        "device": str(device),
        "model": {name: getattr(args, name) for name in _MODEL_KNOBS},
        "dtype": dtype_name,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "tokens_cached": tokens,
        "layers_here": layers_here,
        "cache_key_shapes": kv_per_rank,
        "cache_bytes": cache_tensor_bytes(cache),
        "predicted_cache_bytes": _stage_cache_bytes(config, tokens, args, dtype_name),
        "param_bytes": param_bytes(model),
        "predicted_param_bytes": _stage_weight_bytes(config, args, dtype_name),
        "allreduce_calls": comm.allreduce_calls,
        "allreduce_bytes": comm.allreduce_bytes,
        "predicted_allreduce_bytes": (
            2 * config.num_hidden_layers * args.batch * tokens * config.hidden_size * model.dtype.itemsize
            if args.tp > 1
            else 0
        ),
        "send_calls": comm.send_calls,
        "send_bytes": comm.send_bytes,
        "predicted_send_bytes": (
            args.batch * tokens * config.hidden_size * model.dtype.itemsize if args.rank < args.pp - 1 else 0
        ),
        "logits_compared": compared,
        "max_abs_logit_diff": max_diff,
        "max_abs_logit": scale,
        "wall_s": wall,
    }
    return result


def _stage_cache_bytes(config: Any, tokens: int, args: argparse.Namespace, dtype: str) -> int:
    """kvlab.specs.sizing's prediction of this rank's cache (for PP: its own stage's)."""
    stages = sizing.kv_cache_bytes_per_stage(config, tokens, args.batch, dtype, tp=args.tp, pp=args.pp)
    return stages[args.rank if args.pp > 1 else 0]


def _stage_weight_bytes(config: Any, args: argparse.Namespace, dtype: str) -> int:
    """kvlab.specs.sizing's prediction of this rank's weights, with the embedding and lm_head whole, as the demo keeps
    them (vLLM would split them by vocabulary rows)."""
    stages = sizing.weight_bytes_per_stage(config, dtype, tp=args.tp, pp=args.pp, vocab_parallel=False)
    return stages[args.rank if args.pp > 1 else 0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvlab.experiments.parallel", description="one rank of a TP/PP demo"
    )
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds any collective may wait")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        result = _worker(args)
    except (ValueError, RuntimeError) as err:  # one line on stderr, for the launcher to report
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"kvlab.experiments.parallel rank {args.rank}: error: {message}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(result, indent=1))
    return 0


# --- the launcher ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the process groups of the ranks this launcher started (each rank leads its own group)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_distributed(
    tp: int = 2,
    pp: int = 1,
    *,
    world_size: int | None = None,
    family: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    batch: int = 2,
    prompt_len: int = 16,
    steps: int = 8,
    seed: int = 0,
    backend: str | None = None,
    timeout_s: float = 60.0,
    threads: int = 1,
) -> list[dict[str, Any]]:
    """Launch `tp × pp` ranks of `python -m kvlab.experiments.parallel` and return each rank's measurements, rank order.

    `backend=None` picks NCCL when there is one CUDA GPU per rank, else gloo on CPU. `world_size` (default
    `tp × pp`) is checked against the plan before anything starts. Bad input is a one-line ValueError; a rank
    that fails is a RuntimeError carrying its one-line error; a run past `timeout_s` is a TimeoutError. Either
    way every rank this call started is killed before it returns.
    """
    for name, value in (
        ("tp", tp),
        ("pp", pp),
        ("steps", steps),
        ("prompt_len", prompt_len),
        ("batch", batch),
    ):
        check_count(name, value)
    world = tp * pp
    if world_size is not None and world_size != world:
        raise ValueError(f"world size {world_size} does not match tp × pp = {tp} × {pp} = {world}")
    if tp > 1 and pp > 1:
        raise ValueError("the demo runs tensor or pipeline parallelism, not both at once")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"the demo supports {', '.join(SUPPORTED_FAMILIES)}, not {family!r}")
    from kvlab.models import tiny_config

    config = tiny_config(
        family,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
    )
    sizing.check_parallel(describe(config), tp, pp)
    if intermediate % tp:
        raise ValueError(f"tensor-parallel size {tp} does not divide the MLP width {intermediate}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="kvlab-parallel-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        errs = []
        try:
            for rank in range(world):
                err = open(Path(tmp) / f"rank{rank}.err", "wb")  # noqa: SIM115 - closed below
                errs.append(err)
                argv = [
                    sys.executable, "-m", "kvlab.experiments.parallel", "--rank", str(rank), "--world-size", str(world),
                    "--tp", str(tp), "--pp", str(pp), "--port", str(port), "--backend", backend,
                    "--timeout", str(max(1.0, timeout_s / 2)), "--out", str(Path(tmp) / f"rank{rank}.json"),
                    "--threads", str(threads), "--seed", str(seed), "--family", family, "--layers", str(layers),
                    "--hidden", str(hidden), "--heads", str(heads), "--kv-heads", str(kv_heads),
                    "--intermediate", str(intermediate), "--vocab", str(vocab), "--batch", str(batch),
                    "--prompt-len", str(prompt_len), "--steps", str(steps),
                ]  # fmt: skip
                procs.append(
                    subprocess.Popen(
                        argv, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True
                    )
                )
            LAST_PIDS[:] = [proc.pid for proc in procs]
            deadline = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            timed_out = not failed and any(p.poll() is None for p in procs)
        finally:
            _kill(procs)
            for err in errs:
                err.close()
        if failed:
            rank = failed[0]
            text = (Path(tmp) / f"rank{rank}.err").read_text(errors="replace").strip().splitlines()
            last = text[-1] if text else f"exit status {procs[rank].returncode}"
            raise RuntimeError(f"rank {rank} of {world} failed: {last}")
        if timed_out:
            raise TimeoutError(
                f"the {world}-rank run did not finish within {timeout_s:g} s; every rank was killed"
            )
        return [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(world)]


if __name__ == "__main__":
    raise SystemExit(main())
