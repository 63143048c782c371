"""One request as the engine tracks it: its tokens, its sampling parameters, and how many tokens are computed.

`Request` is vLLM's `Request` and nano-vllm's `Sequence`: the prompt then the output in one list,
`num_computed_tokens` of them with K/V in the pool (the scheduler's to advance), its metrics and the chained
hashes of its full blocks. Its blocks are not here: the block manager keeps them by request id.
`SamplingParams` holds vLLM's knobs kvlab uses; `ExternalKV` is K/V computed by a prefill instance elsewhere.
Chapters 8 and 17.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import count
from typing import Any

from kvlab.engine.block_pool import hash_block_tokens
from kvlab.engine.metrics import RequestMetrics


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 is greedy
    ignore_eos: bool = False
    seed: int | None = None  # for temperature > 0
    # vLLM's name: keep the ids of the `logprobs` most likely tokens at every generated position
    # (`RequestOutput.top_token_ids`), for comparing two schedules under `kvlab.agreement`'s top-k rule.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.temperature < 0:
            raise ValueError(
                f"need max_tokens >= 1 and temperature >= 0, got {self.max_tokens}, {self.temperature}"
            )
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or self.logprobs < 1):
            raise ValueError(f"logprobs must be None or an int >= 1, got {self.logprobs!r}")


Prompt = Sequence[int] | Mapping[str, Any]  # token ids, or {"prompt_token_ids": [...], "cache_salt": "..."}


def parse_prompt(prompt: Prompt) -> tuple[list[int], str | None]:
    """Token ids and cache salt of a prompt in either form; a one-line error for anything else."""
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - {"prompt_token_ids", "cache_salt"}
        if "prompt_token_ids" not in prompt or unknown:
            raise ValueError(
                f"a prompt dict needs 'prompt_token_ids' and may have 'cache_salt', got keys {sorted(prompt)}"
            )
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        return list(prompt["prompt_token_ids"]), salt
    if isinstance(prompt, (str, bytes)):
        raise ValueError("prompts are token ids (or a dict with 'prompt_token_ids'), not text")
    return list(prompt), None


@dataclass(eq=False)
class ExternalKV:
    """K and V of a request's first `num_tokens` tokens, computed by another engine (a prefill instance) and
    loaded into this one's pool instead of being computed: vLLM's KV connector on the decode side.

    `kv` is `(layers, 2, num_tokens, kv_heads, head_dim)` in the model's dtype. At admission the scheduler counts
    these tokens computed and sets `start` to the tokens the prefix cache served already (those blocks are
    shared and keep their own values); the runner writes tokens `start..num_tokens` into the pool before the
    step's forward, then drops `kv`.
    """

    num_tokens: int
    kv: Any
    start: int = 0


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = count()


@dataclass(eq=False, slots=True)
class Request:
    """Tokens so far (prompt then output) and how many of them have K/V in the pool.

    The scheduler alone advances `num_computed_tokens`; the rest are fed at the next steps. Preemption by
    recompute sets it back to 0, keeping the tokens, so the request re-enters as one longer prompt. Its blocks are
    the KV-cache manager's (`BlockManager.get_block_ids`), not the request's.
    """

    token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    request_id: str | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # The most tokens it has had computed: recomputation after a preemption stays below it.
    max_computed_tokens: int = 0
    num_preemptions: int = 0
    # Mixed into the first block's hash: no sharing across salts (vLLM's)
    cache_salt: str | None = None
    # Chained hashes of its full blocks, filled on demand (`update_block_hashes`)
    block_hashes: list[int] = field(default_factory=list)
    # Where, at its last admission, full-attention groups had a longer prefix cached than sliding ones (0: none);
    # sliding groups keep their window there for the next request (vLLM's `shared_prefix_boundary`).
    shared_prefix_boundary: int = 0
    finish_reason: str | None = None  # "stop" (eos), "length" (max_tokens / max_model_len), "error"
    error: str | None = None
    # Per generated token, the `params.logprobs` best token ids at that position (empty when logprobs is None).
    # Kept across preemption: recomputing the prefill does not sample the tokens already generated again.
    top_token_ids: list[list[int]] = field(default_factory=list)
    # K/V of a prefix computed elsewhere, waiting to be loaded (None once loaded, or when there is none).
    external: ExternalKV | None = None
    num_prompt_tokens: int = field(init=False)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a prompt needs at least one token")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {self.cache_salt!r}")
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.request_id = str(self.seq_id) if self.request_id is None else self.request_id
        self.metrics = RequestMetrics(self.arrival_time, self.num_prompt_tokens)

    @classmethod
    def prefilled(
        cls, prompt: Sequence[int], first_token: int, kv: Any, params: SamplingParams, **fields: Any
    ) -> Request:
        """A request whose prompt another engine has prefilled: it holds the prompt's K/V (`kv`, as
        `ExternalKV` takes it) and the token that prefill sampled, so its first step here computes that token."""
        seq = cls(list(prompt), params, **fields)
        seq.token_ids.append(first_token)
        seq.external = ExternalKV(len(prompt), kv)
        return seq

    def update_block_hashes(self, block_size: int) -> list[int]:
        """The chained hashes of its full blocks of `block_size` tokens, computed once (a full block never changes)."""
        hashes, tokens = self.block_hashes, self.token_ids
        for i in range(len(hashes), len(tokens) // block_size):
            parent = hashes[i - 1] if i else None
            extra = self.cache_salt if i == 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra))
        return hashes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
