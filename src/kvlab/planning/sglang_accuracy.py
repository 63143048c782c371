"""How close kvlab's SGLang accounting (`kvlab.costs.sglang`) comes to published SGLang start-up logs
(tests/data/sglang_logs), term by term: the bytes per token, the token pool from the printed free memory, the
automatic static fraction, and the pool from the GPU and the model alone.

The SGLang section of the appendix page *How close kvlab's pool comes to vLLM's* (book/appendix_accuracy) is
`block` of these rows, and tests/test_sglang_accuracy.py recomputes it.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from kvlab.costs import sglang
from kvlab.specs import hardware, sizing
from kvlab.units import GiB, MiB

LOGS = Path(__file__).resolve().parents[3] / "tests" / "data" / "sglang_logs"
NAME = "sglang"


@dataclass(frozen=True)
class Printed:
    """What a log prints about the pool: the token count, K and V sizes, and the free memory around loading."""

    tokens: int
    k_gib: float
    v_gib: float
    # "Load weight begin. avail mem", or "Load weight end" avail plus its mem usage; None when not printed
    pre_load_gib: float | None
    post_load_gib: float | None

    @property
    def bytes_per_token(self) -> float:
        return (self.k_gib + self.v_gib) * GiB / self.tokens


def printed(lines: list[str]) -> Printed:
    """The first rank's figures from a log's lines (SGLang takes the smallest free memory over ranks; the logs
    here print the same figure on every rank)."""
    text = "\n".join(lines)
    allocated = sglang.parse_allocated(next(line for line in lines if "KV Cache is allocated" in line))
    begin = re.search(r"Load weight begin\. avail mem=([\d.]+) GB", text)
    end = re.search(r"Load weight end\..*?avail mem=([\d.]+) GB(?:, mem usage=([\d.]+) GB)?", text)
    post = float(end[1]) if end else None
    pre = float(begin[1]) if begin else None
    if pre is None and end is not None and end[2]:
        # "mem usage" is the free memory the weights took: before = after + usage
        pre = float(end[1]) + float(end[2])
    return Printed(allocated.tokens, allocated.k_gib, allocated.v_gib, pre, post)


def _config(entry: dict):
    from transformers import AutoConfig

    fields = dict(entry["config"])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@dataclass(frozen=True)
class Row:
    """One log: what SGLang printed, kvlab's figure for each term, and why a term is not predicted."""

    slug: str
    version: str
    gpu: str
    model: str
    tp: int
    kv_dtype: str
    page_size: int
    tokens: int  # SGLang's max_total_num_tokens
    printed_bytes_per_token: float
    bytes_per_token: int  # kvlab's cell size on one rank
    fraction: str  # the static fraction step 3 uses, and where it comes from
    from_memory: int | None  # step 3: the pool from the printed free memory and the fraction
    memory_why: str
    auto_printed: float | None  # SGLang's own automatic fraction, where the log ran it and it is known
    auto_kvlab: float | None
    whole: int | None  # the pool from the GPU and the model alone (`kvlab size --engine sglang`)
    whole_why: str

    @property
    def memory_error(self) -> float:
        assert self.from_memory is not None
        return self.from_memory / self.tokens - 1

    @property
    def whole_error(self) -> float:
        assert self.whole is not None
        return self.whole / self.tokens - 1


def predict(entry: dict, slug: str) -> Row:
    """kvlab's figures for one record of tests/data/sglang_logs."""
    from kvlab.planning.explain_vllm import registry_name

    seen = printed(entry["sglang_lines"])
    tp, page = entry["tp"], entry.get("page_size", sglang.PAGE_SIZE)
    cell = sizing.kv_bytes_per_token(_config(entry), entry["kv_dtype"], tp=tp)
    spec = hardware.spec_for(entry.get("gpu") or "")
    model = registry_name(entry["model"])
    given = entry.get("mem_fraction_static")
    auto = entry.get("fraction_auto")
    kvlab_auto = None if spec is None else sglang.auto_mem_fraction_static(spec.memory_bytes / MiB, tp)
    if given is not None:
        fraction, source = (
            given,
            ("printed" if entry.get("fraction_printed") else "auto, by its release's rule"),
        )
        if not auto:
            source = "given"
    elif kvlab_auto is not None:
        fraction, source = kvlab_auto, "not printed: kvlab's 0.5.23 choice"
    else:
        fraction, source = None, "not printed"

    from_memory, memory_why = None, ""
    if entry.get("not_stock"):
        memory_why = entry["not_stock"]
    elif seen.pre_load_gib is None or seen.post_load_gib is None:
        memory_why = "no free memory printed around loading"
    elif fraction is None:
        memory_why = "mem_fraction_static not printed and the GPU unknown"
    else:
        pre = int(seen.pre_load_gib * GiB)
        pool = sglang.SGLangPool(
            capacity_bytes=pre,
            mem_fraction_static=fraction,
            runtime_bytes=0,
            weight_bytes=pre - int(seen.post_load_gib * GiB),
            cell_bytes=cell,
            page_size=page,
        )
        from_memory = pool.max_total_num_tokens

    whole, whole_why = None, ""
    if model is None:
        whole_why = f"model {entry['model']} not in kvlab's registry"
    elif spec is None:
        whole_why = "GPU not named: its memory is unknown"
    else:
        try:
            whole = sglang.sglang_pool(
                model,
                spec,
                kv_dtype=entry["kv_dtype"],
                mem_fraction_static=None if auto else given,
                tp=tp,
                page_size=page,
            ).max_total_num_tokens
        except ValueError as err:
            whole_why = str(err).split("\n")[0]
    return Row(
        slug=slug,
        version=entry.get("sglang_version") or "not printed",
        gpu=spec.name if spec is not None else "not named",
        model=entry["model"],
        tp=tp,
        kv_dtype=entry["kv_dtype"],
        page_size=page,
        tokens=seen.tokens,
        printed_bytes_per_token=seen.bytes_per_token,
        bytes_per_token=cell,
        fraction="—" if fraction is None else f"{fraction:g} ({source})",
        from_memory=from_memory,
        memory_why=memory_why,
        auto_printed=given if auto and given is not None else None,
        auto_kvlab=kvlab_auto if auto else None,
        whole=whole,
        whole_why=whole_why,
    )


def records(folder: Path = LOGS) -> list[tuple[str, dict]]:
    """Every record of `folder`, as (slug, record), sorted by slug."""
    return [(path.stem, json.loads(path.read_text())) for path in sorted(folder.glob("*.json"))]


def rows(folder: Path = LOGS) -> list[Row]:
    return [predict(entry, slug) for slug, entry in records(folder)]


@dataclass(frozen=True)
class Summary:
    """The error of one predicted figure over the logs that allow it."""

    n: int
    mean: float
    mae: float
    median_abs: float


def summary(errors: list[float]) -> Summary:
    if not errors:
        raise ValueError("no predicted log")
    return Summary(
        len(errors),
        statistics.fmean(errors),
        statistics.fmean(abs(e) for e in errors),
        statistics.median(abs(e) for e in errors),
    )


def _tokens(value: int | None, error: float | None, why: str) -> str:
    if value is None:
        # ASCII double quotes would read as closing marks beside CJK text in the Chinese twin
        return "— (" + why.replace("|", "/").replace('"', "'") + ")"
    return f"{value:,} ({error:+.2%})"


def page_table(found: list[Row]) -> str:
    """One log a row: each term as SGLang printed it and as kvlab predicts it."""
    out = [
        "| log | SGLang | GPU | model | TP | bytes/token (SGLang / kvlab) | static fraction "
        "| auto fraction (SGLang / kvlab) | SGLang pool | from printed memory | from GPU + model |",
        "|---|---|---|---|--:|--:|---|--:|--:|--:|--:|",
    ]
    for r in found:
        auto = (
            "—" if r.auto_kvlab is None else f"{r.auto_printed if r.auto_printed else '—'} / {r.auto_kvlab:g}"
        )
        memory = _tokens(r.from_memory, r.memory_error if r.from_memory else None, r.memory_why)
        whole = _tokens(r.whole, r.whole_error if r.whole else None, r.whole_why)
        out.append(
            f"| {r.slug} | {r.version} | {r.gpu} | {r.model} | {r.tp} "
            f"| {r.printed_bytes_per_token:,.0f} / {r.bytes_per_token:,} | {r.fraction} | {auto} "
            f"| {r.tokens:,} | {memory} | {whole} |"
        )
    return "\n".join(out)


def summary_lines(found: list[Row]) -> str:
    """The error of each predicted pool, and how many cell sizes match."""
    out = [
        "| figure | n | mean error | mean absolute error | median absolute error |",
        "|---|--:|--:|--:|--:|",
    ]
    memory = summary([r.memory_error for r in found if r.from_memory is not None])
    out.append(
        f"| pool from printed memory | {memory.n} | {memory.mean:+.2%} | {memory.mae:.2%} | {memory.median_abs:.2%} |"
    )
    wholes = [r.whole_error for r in found if r.whole is not None]
    if wholes:
        whole = summary(wholes)
        out.append(
            f"| pool from GPU + model | {whole.n} | {whole.mean:+.2%} | {whole.mae:.2%} | {whole.median_abs:.2%} |"
        )
    return "\n".join(out)


def block(found: list[Row]) -> str:
    return summary_lines(found) + "\n\n" + page_table(found)


_BLOCK = re.compile(rf"<!-- accuracy:{NAME} -->\n.*?\n<!-- /accuracy:{NAME} -->", re.DOTALL)


def render(page: str, found: list[Row]) -> str:
    """`page` with its `<!-- accuracy:sglang -->` block recomputed from `found`."""
    match = _BLOCK.search(page)
    if match is None:
        raise ValueError(f"the page has no <!-- accuracy:{NAME} --> block")
    body = f"<!-- accuracy:{NAME} -->\n{block(found)}\n<!-- /accuracy:{NAME} -->"
    return page[: match.start()] + body + page[match.end() :]


def main(argv: list[str] | None = None) -> int:
    """`python -m kvlab.planning.sglang_accuracy [--write]`: print the SGLang block, or rewrite it on the
    appendix pages (`kvlab.planning.accuracy.PAGES`; rerun that module's --write for the Chinese page's hash)."""
    import sys

    from kvlab.planning.accuracy import PAGES

    args = sys.argv[1:] if argv is None else argv
    found = rows()
    if "--write" in args:
        for path in PAGES:
            path.write_text(render(path.read_text(), found))
    print(block(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
