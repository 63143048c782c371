"""GPU profiles: the sizes each lab takes on the device it finds (chapter *Running the labs*, docs/running.md).

A lab's `parameters` cell holds CPU sizes. On a CUDA device, `gpu_sizes` gives it instead the sizes of the largest
profile in `gpu_params.yaml` (shipped in this package: 80, 40, 24 and 16 GB) whose peak, predicted with
`kvlab.specs.sizing` (`peak_bytes`), fits `MEMORY_HEADROOM` of the device's free memory. A value that differs
from the lab's CPU default (`lab_defaults.json`, checked against every lab by a test) is the reader's own choice,
from papermill's `-p` or an edited cell, and is kept; where it makes the predicted peak too large the lab stops
with one line naming the sizes to lower. On a CPU `gpu_sizes` changes nothing and prints nothing.

    python -m kvlab.book.profiles --write-defaults   # after editing a lab's parameters cell
    python -m kvlab.book.profiles --write-table docs/running.md   # after changing a profile or a predictor
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from kvlab.book.report import Table
from kvlab.experiments.decode import EAGER_SCORE_COPIES, MEMORY_HEADROOM
from kvlab.experiments.timing import decode_points
from kvlab.specs.sizing import kv_bytes_per_token, kv_cache_bytes, weight_bytes
from kvlab.units import GiB, cdiv, format_bytes

PARAMS_FILE = Path(__file__).with_name("gpu_params.yaml")
DEFAULTS_FILE = Path(__file__).with_name("lab_defaults.json")
# A chapter's smaller profiles in gpu_params.yaml, and its values for the CPU dry run (`kvlab.book.gpu`)
PROFILES_KEY = "profiles"
STUB_KEY = "cpu_stub"
# Device memory in GB, largest first: the top-level values of a chapter are the first; each smaller profile
# overrides the next larger one.
PROFILES_GB = (80, 40, 24, 16)
# Free memory of a fresh process on the device each profile is named after, for the table of what each lab picks:
# an H100 (about 78 GiB usable), an A100 40GB, an L4 (22.5 GiB in all), a T4 (about 15 GiB usable).
TYPICAL_FREE = {80: 78 * GiB, 40: 39 * GiB, 24: 22 * GiB, 16: 15 * GiB}


class SizesTooLarge(MemoryError):
    """The reader's sizes need more memory than the device has free."""


def read_params(path: Path = PARAMS_FILE) -> dict[str, dict[str, Any]]:
    """gpu_params.yaml as written: chapter folder -> its 80 GB values, `profiles` and `cpu_stub`."""
    from kvlab.book.sweep import _require

    data = _require("yaml").safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must map chapter folders to parameters, got {type(data).__name__}")
    return {str(k): dict(v or {}) for k, v in data.items()}


@cache
def _shipped() -> dict[str, dict[str, Any]]:
    return read_params()


def profile(chapter: str, gb: int, data: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The values of `chapter`'s `gb` profile: its 80 GB values with each smaller profile's overrides down to `gb`."""
    if gb not in PROFILES_GB:
        raise ValueError(f"no {gb} GB profile; the profiles are {', '.join(map(str, PROFILES_GB))} GB")
    entry = dict((data if data is not None else _shipped()).get(chapter) or {})
    smaller = entry.pop(PROFILES_KEY, None) or {}
    entry.pop(STUB_KEY, None)
    unknown = sorted(set(smaller) - set(PROFILES_GB[1:]))
    if unknown:
        raise ValueError(f"{chapter}: no profile {unknown}; smaller profiles are {PROFILES_GB[1:]} (GB)")
    for size in PROFILES_GB[1 : PROFILES_GB.index(gb) + 1]:
        entry |= smaller.get(size) or {}
    return entry


def profile_names(chapter: str, data: Mapping[str, Mapping[str, Any]] | None = None) -> set[str]:
    """Every parameter some profile of `chapter` sets."""
    return set().union(*(profile(chapter, gb, data) for gb in PROFILES_GB))


# Parameters a GPU ignores: torch's CPU thread count
CPU_ONLY = frozenset({"threads"})


def gpu_sized(data: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """The chapters whose profiles set a size a GPU uses: each of their labs calls `gpu_sizes`."""
    data = data if data is not None else _shipped()
    return [chapter for chapter in sorted(data) if profile_names(chapter, data) - CPU_ONLY]


def lab_defaults(
    book: Path, data: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """Chapter -> the CPU defaults (its lab's `parameters` cell, `kvlab.book.sweep.notebook_parameters`) of every
    parameter its profiles set or its peak is predicted from, for each chapter a GPU sizes (`gpu_sized`): the
    values a reader's are told from, and the sizes a peak is predicted at where no lab is at hand."""
    from kvlab.book.sweep import notebook_parameters

    data = data if data is not None else read_params()
    out = {}
    for chapter in gpu_sized(data):
        cell = notebook_parameters(book / chapter / "lab.ipynb")
        names = profile_names(chapter, data)
        predict = PREDICTORS.get(chapter)
        for gb in PROFILES_GB:
            values = _Reads(cell | profile(chapter, gb, data))
            if predict is not None:
                predict(values)
            names |= values.read
        out[chapter] = {name: cell[name] for name in sorted(names) if name in cell}
    return dict(json.loads(json.dumps(out)))


class _Reads(dict[str, Any]):
    """A dict that notes every key read: the parameters a predictor uses."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


@cache
def recorded_defaults() -> dict[str, dict[str, Any]]:
    """`lab_defaults` as shipped in the package (`DEFAULTS_FILE`): the labs are not installed with it."""
    return dict(json.loads(DEFAULTS_FILE.read_text()))


# --- Predicted peak memory of a lab at given sizes ------------------------------------------------------------
#
# Each predictor adds what the lab holds at once on the device at its largest moment: weights, caches (every
# decode point's at once where a sweep keeps them), the activations of its longest forward, probes. They are
# estimates for choosing sizes, not allocator counts; `MEMORY_HEADROOM` leaves a fifth of the free memory for
# what they leave out (the CUDA context's own allocations, the allocator's rounding, kernels' workspaces).


def _tiny(v: Mapping[str, Any], **over: Any) -> PretrainedConfig:
    from kvlab.models import tiny_config

    knobs = dict(layers=v["layers"], hidden=v["hidden"], heads=v["heads"], kv_heads=v["kv_heads"])
    return tiny_config(str(v.get("family", "llama")), vocab=v["vocab"], **(knobs | over))


def _activations(config: PretrainedConfig, tokens: int, nbytes: int) -> int:
    """A forward's largest live activations in one layer: the MLP's gate, up and product (3 × intermediate) and a
    few hidden-state copies (4 × hidden) per token."""
    text = config.get_text_config(decoder=True)
    return tokens * (3 * text.intermediate_size + 4 * text.hidden_size) * nbytes


def _eager_scores(config: PretrainedConfig, tokens: int, batch: int) -> int:
    """`kvlab.experiments.decode.eager_scores_bytes` from a config: fp32 scores and softmax of one layer."""
    heads = config.get_text_config(decoder=True).num_attention_heads
    return EAGER_SCORE_COPIES * batch * heads * tokens * tokens * 4


def _probes(weights: int, nbytes: int) -> int:
    """`kvlab.experiments.timing.sweep_decode`'s probes on a GPU: a copy's source and destination and the linear
    maps' weights (each the model's weights, at most 256 MiB), and an 8,192-square matmul's three matrices."""
    probe = min(max(weights, 2**20), 256 * 2**20)
    return 3 * probe + 3 * 8192 * 8192 * nbytes


def _decode_sweep(config: PretrainedConfig, v: Mapping[str, Any], nbytes: int) -> int:
    """Every point's cache of a decode sweep at once (`_time_in_rounds` keeps them all), plus one layer's K or V
    that `DynamicCache`'s append builds before it frees the old one."""
    points = decode_points(v["contexts"], v["batch_sizes"], v["batch_context"])
    caches = [kv_cache_bytes(config, c, b, _dtype_name(nbytes)) for b, c in points]
    layers = config.get_text_config(decoder=True).num_hidden_layers
    return sum(caches) + max(caches) // (2 * layers)


def _dtype_name(nbytes: int) -> str:
    return {4: "fp32", 2: "bf16"}[nbytes]


# A GPU runs the timing labs (3, 4, 12) in bf16, or fp16 on a T4 (`kvlab.env.compute_dtype`): 2 bytes either way.
_GPU_BYTES = 2


def _peak_01(v: Mapping[str, Any]) -> int:
    config, nbytes = _tiny(v), 4  # fp32, eager attention
    vocab, longest = v["vocab"], max(v["history_lengths"])
    # an uncached step over the longest history beside a cache of it (`decode.step_flops`, the recompute bench)
    recompute = _eager_scores(config, longest + 1, 1) + (longest + 1) * vocab * nbytes
    recompute += _activations(config, longest + 1, nbytes) + kv_cache_bytes(config, longest, 1, "fp32")
    # the uncached greedy decode of the whole batch
    tokens, batch = v["prompt_len"] + v["new_tokens"], v["batch_size"]
    greedy = _eager_scores(config, tokens, batch) + batch * tokens * vocab * nbytes
    greedy += _activations(config, batch * tokens, nbytes)
    return weight_bytes(config, "fp32") + max(recompute, greedy)


def _peak_03(v: Mapping[str, Any]) -> int:
    config = _tiny(v)
    weights = weight_bytes(config, "bf16")
    longest = max(v["prompt_lens"])
    prefill = kv_cache_bytes(config, longest, 1, "bf16") + _activations(config, longest, _GPU_BYTES)
    decode = _decode_sweep(config, v, _GPU_BYTES) + _probes(weights, _GPU_BYTES)
    return weights + max(prefill, decode)


def _peak_04(v: Mapping[str, Any]) -> int:
    config = _tiny(v)
    weights = weight_bytes(config, "bf16")
    return weights + _decode_sweep(config, v, _GPU_BYTES) + _probes(weights, _GPU_BYTES)


def _peak_12(v: Mapping[str, Any]) -> int:
    config = _tiny(v)
    layers, batch, longest = v["layers"], v["batch"], max(v["contexts"])
    full = kv_cache_bytes(config, longest + v["new_tokens"], batch, "bf16")
    per_layer = full // layers
    # the loops run in lockstep: the in-memory reference; the offloaded cache's device layers, plus the layer
    # it brought in and its reordered copy; transformers' offloading cache, its layer in use and the next
    resident = layers - len(v["offloaded"])
    loop = (
        full + (resident + 2) * per_layer + 2 * per_layer + _activations(config, batch * longest, _GPU_BYTES)
    )
    tiers = 2 * v["tier_bytes"]  # the device copy's source and destination
    prompt = batch * v["reload_prompt"]
    reload = 2 * kv_cache_bytes(config, v["reload_prompt"], batch, "bf16") + _activations(config, prompt, 2)
    return weight_bytes(config, "bf16") + max(loop, tiers, reload)


def _pool(config: PretrainedConfig | str, num_blocks: int, block_size: int, dtype: str = "fp32") -> int:
    return num_blocks * block_size * kv_bytes_per_token(config, dtype)


def _engine(config: PretrainedConfig, num_blocks: int, block_size: int) -> int:
    """An engine on a tiny fp32 model: its weights and its preallocated pool (num_blocks × block bytes)."""
    return weight_bytes(config, "fp32") + _pool(config, num_blocks, block_size)


# SmolLM2-135M-Instruct (`kvlab.models.real_model`), the shape of its config.json
# (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct/blob/main/config.json): 30 layers, hidden 576,
# 9 heads, 3 KV heads, intermediate 1,536, vocabulary 49,152. Loaded in fp32.
_SMOLLM2 = dict(family="llama", layers=30, hidden=576, heads=9, kv_heads=3, vocab=49152)


def _real_engine(num_blocks: int, block_size: int) -> int:
    return _engine(_tiny(_SMOLLM2, intermediate=1536), num_blocks, block_size)


def _peak_05(v: Mapping[str, Any]) -> int:
    from kvlab.models import scaled_down

    config = scaled_down(v["full_model"])
    tokens = v["batch"] * cdiv(v["long_context"], v["scale_down"])
    measured = kv_cache_bytes(config, tokens, 1, "fp32") + _activations(config, tokens, 4)
    return _engine(config, v["num_blocks"], v["block_size"]) + measured


def _peak_06(v: Mapping[str, Any]) -> int:
    from kvlab.models import scaled_down

    config = scaled_down(v["heat_model"])
    tokens = max(v["growth_contexts"]) * max(v["growth_batches"])
    growth = kv_cache_bytes(config, tokens, 1, "fp32") + _activations(config, tokens, 4)
    return _engine(config, v["num_blocks"], v["block_size"]) + growth


def _peak_07(v: Mapping[str, Any]) -> int:
    return _engine(_tiny(v), v["num_blocks"], v["block_size"])


def _peak_08(v: Mapping[str, Any]) -> int:
    tiny = _engine(_tiny(v), max(v["num_blocks"], v["small_num_blocks"]), v["block_size"])
    return max(tiny, _real_engine(v["real_num_blocks"], v["block_size"]))


def _peak_09(v: Mapping[str, Any]) -> int:
    tiny = _engine(_tiny(v), max(v["num_blocks"], *v["pool_sizes"]), v["block_size"])
    return max(tiny, _real_engine(v["real_num_blocks"], v["block_size"]))


def _peak_17(v: Mapping[str, Any]) -> int:
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[v["model_dtype"]]
    config = _tiny(v)
    # `router.roomy_num_blocks` over one request per prompt length; three engines hold such a pool on one device
    # (the lab's own and the two processes of `pd.run_disaggregated`), each with the weights
    blocks = sum(cdiv(p + v["max_tokens"], v["block_size"]) for p in v["prompt_lens"])
    one = weight_bytes(config, dtype) + _pool(config, blocks, v["block_size"], dtype)
    return 3 * one + 2 * max(v["probe_sizes"])


# Chapters whose sizes come near a GPU's memory. The others (2, 10, 11, 13-16, the appendix) hold tiny models or
# SmolLM2-135M (0.5 GB in fp32) with short caches at every profile: no peak is predicted for them.
PREDICTORS: dict[str, Callable[[Mapping[str, Any]], int]] = {
    "01_cache_contents": _peak_01,
    "03_prefill_decode": _peak_03,
    "04_bandwidth_bound": _peak_04,
    "05_active_tokens": _peak_05,
    "06_long_context": _peak_06,
    "07_paging": _peak_07,
    "08_continuous_batching": _peak_08,
    "09_prefix_caching": _peak_09,
    "12_beyond_hbm": _peak_12,
    "17_cluster": _peak_17,
}


def peak_bytes(chapter: str, values: Mapping[str, Any]) -> int | None:
    """Predicted peak device memory of `chapter`'s lab at `values` (its parameters), or None where not predicted."""
    predict = PREDICTORS.get(chapter)
    return None if predict is None else int(predict(values))


def fits(peak: int | None, free_bytes: int) -> bool:
    return peak is None or peak <= MEMORY_HEADROOM * free_bytes


# --- Choosing a profile -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The profile a lab takes on a device: the values to set, and the reader's own values it kept."""

    chapter: str
    # None: no profile fits; the lab keeps its CPU sizes
    gb: int | None
    sizes: dict[str, Any]
    peak: int | None
    free_bytes: int
    kept: dict[str, Any] = field(default_factory=dict)

    def line(self, device: str) -> str:
        """What `gpu_sizes` prints: the device, its free memory, the profile and its predicted peak."""
        head = f"{device}, {format_bytes(self.free_bytes)} free: "
        peak = "peak not predicted" if self.peak is None else f"predicted peak {format_bytes(self.peak)}"
        if self.gb is None:
            text = head + f"no GPU profile fits; the CPU sizes ({peak})"
        else:
            text = head + f"the {self.gb} GB profile's sizes ({peak})"
        if self.kept:
            text += "; yours kept: " + ", ".join(f"{k}={v!r}" for k, v in self.kept.items())
        return text


def choose(
    chapter: str,
    values: Mapping[str, Any],
    free_bytes: int,
    *,
    data: Mapping[str, Mapping[str, Any]] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> Choice:
    """The largest profile of `chapter` whose predicted peak, with the reader's own values (those of `values`
    that differ from the CPU defaults) kept, fits `MEMORY_HEADROOM` × `free_bytes`; else the CPU sizes if
    they fit. Raises `SizesTooLarge`, in one line naming the sizes to lower, where nothing fits."""
    cpu = dict((defaults if defaults is not None else recorded_defaults()).get(chapter) or {})
    names = profile_names(chapter, data)
    missing = sorted(names - set(cpu))
    if missing:
        raise ValueError(f"{chapter}: no recorded CPU default for {', '.join(missing)}: run {_REWRITE}")
    mine = {k: values[k] for k in sorted(names) if k in values and values[k] != cpu[k]}
    for gb in PROFILES_GB:
        sizes = profile(chapter, gb, data)
        peak = peak_bytes(chapter, {**values, **sizes, **mine})
        if fits(peak, free_bytes):
            return Choice(
                chapter, gb, {k: v for k, v in sizes.items() if k not in mine}, peak, free_bytes, mine
            )
    peak = peak_bytes(chapter, values)
    if fits(peak, free_bytes):
        return Choice(chapter, None, {}, peak, free_bytes, mine)
    lower = ", ".join(mine) or ", ".join(sorted(names))
    raise SizesTooLarge(
        f"{chapter}: these sizes need about {format_bytes(peak or 0)} at peak and the device has "
        f"{format_bytes(free_bytes)} free ({MEMORY_HEADROOM:.0%} usable): lower {lower}"
    )


_REWRITE = "python -m kvlab.book.profiles --write-defaults"


def gpu_sizes(chapter: str, values: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
    """The sizes `chapter`'s lab takes on `device`, to set over its parameters (`globals().update(...)`).

    On a CPU: nothing, and nothing printed. On a CUDA device: `choose` at the device's free memory
    (`torch.cuda.mem_get_info`), with one line printed saying which profile and why."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    free, _ = torch.cuda.mem_get_info(device)
    choice = choose(chapter, values, int(free))
    print(choice.line(torch.cuda.get_device_name(device)))
    return choice.sizes


def profile_table(
    free: Mapping[int, int] = TYPICAL_FREE, data: Mapping[str, Mapping[str, Any]] | None = None
) -> Table:
    """Per lab, the profile it picks at each device size's typical free memory (`TYPICAL_FREE`), with its
    predicted peak: the table of docs/running.md."""
    data = data if data is not None else _shipped()
    defaults = recorded_defaults()
    rows = []
    for chapter in gpu_sized(data):
        cells: list[str] = []
        for gb in sorted(free):
            choice = choose(chapter, defaults[chapter], free[gb], data=data, defaults=defaults)
            picked = "CPU sizes" if choice.gb is None else f"{choice.gb} GB"
            cells.append(picked + ("" if choice.peak is None else f", {format_bytes(choice.peak)}"))
        rows.append([chapter, *cells])
    columns = ["lab", *(f"{gb} GB ({format_bytes(free[gb])} free)" for gb in sorted(free))]
    caption = (
        "Profile each lab picks, and its predicted peak, by device memory "
        f"(fits: peak <= {MEMORY_HEADROOM:.0%} of free; no peak: not near any GPU's memory)"
    )
    return Table(columns, rows, caption)


def markdown_table(table: Table) -> str:
    """`table` as a Markdown pipe table (docs/running.md)."""
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in table.formatted_rows()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvlab.book.profiles", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--write-defaults", action="store_true", help=f"rewrite {DEFAULTS_FILE.name}")
    parser.add_argument("--book", type=Path, default=Path("book"))
    parser.add_argument("--table", action="store_true", help="print the profile table as Markdown")
    parser.add_argument("--write-table", type=Path, default=None, help="put the table into this page")
    args = parser.parse_args(argv)
    if args.write_defaults:
        DEFAULTS_FILE.write_text(json.dumps(lab_defaults(args.book), indent=1, sort_keys=True) + "\n")
        print(f"wrote {DEFAULTS_FILE}")
    if args.table:
        print(markdown_table(profile_table()))
    if args.write_table:
        write_table(args.write_table)
        print(f"wrote the profile table into {args.write_table}")
    return 0


TABLE_MARKS = ("<!-- profile-table -->\n", "<!-- /profile-table -->")


def write_table(page: Path) -> None:
    """Put `profile_table` between the page's `TABLE_MARKS` (docs/running.md)."""
    text = page.read_text()
    start, end = text.index(TABLE_MARKS[0]) + len(TABLE_MARKS[0]), text.index(TABLE_MARKS[1])
    page.write_text(text[:start] + markdown_table(profile_table()) + "\n" + text[end:])


if __name__ == "__main__":
    sys.exit(main())
