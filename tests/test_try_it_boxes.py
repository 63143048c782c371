"""Every chapter's "Try it on your vLLM" box, and chapter 5's "Start-up errors" section (kvlab issue 21, item 6).

Tests run offline, so the vLLM and SGLang facts the pages rely on are stored here, each with the release and the
file it was read from: the files of the vLLM 0.33.0 wheel the pages link, its metric names
(`vllm/v1/metrics/loggers.py`), the flags of `vllm serve` (`vllm/engine/arg_utils.py`), of `vllm bench serve`
(`vllm/benchmarks/serve.py` and `vllm/benchmarks/datasets/datasets.py`) and of `vllm bench latency`
(`vllm/benchmarks/latency.py`), and the start-up error messages as their source formats them. A page that
misspells a flag, a metric or a message, or links a file the release does not have, fails here.
"""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(
    p for p in (ROOT / "book").glob("*/index.md") if re.match(r"\d\d_|appendix_", p.parent.name)
)
ERRORS_PAGE = ROOT / "book" / "05_active_tokens" / "index.md"

TITLE = "Try it on your vLLM"
BOX = re.compile(r"^:::\{admonition\} " + re.escape(TITLE) + r"\n(?P<body>.*?)^:::$", re.S | re.M)
CLASS_LINE = ":class: tip kvlab-try-it"

VLLM_033 = "https://github.com/vllm-project/vllm/blob/v0.33.0/"
VLLM_034 = "https://github.com/vllm-project/vllm/blob/v0.34.0/"
VLLM_063 = "https://github.com/vllm-project/vllm/blob/v0.6.3.post1/"
SGLANG_0523 = "https://github.com/sgl-project/sglang/blob/v0.5.23/"

# Files present in the vllm-0.33.0 wheel (PyPI, cp38-abi3 manylinux_2_28_x86_64) that the pages link.
VLLM_033_FILES = {
    "vllm/benchmarks/datasets/datasets.py",
    "vllm/benchmarks/latency.py",
    "vllm/benchmarks/serve.py",
    "vllm/config/cache.py",
    "vllm/config/model.py",
    "vllm/engine/arg_utils.py",
    "vllm/entrypoints/llm.py",
    "vllm/sampling_params.py",
    "vllm/utils/mem_utils.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_planning.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/metrics/loggers.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/v1/worker/gpu_worker.py",
    "vllm/v1/worker/utils.py",
}
# Files of the vllm-0.34.0 wheel that the pages link: the extensible KV cache and the configs that resolve it.
VLLM_034_FILES = {"vllm/config/cache.py", "vllm/config/vllm.py", "vllm/v1/worker/extensible_kv_cache.py"}
# vLLM 0.6.3.post1 (the v0 engine) and SGLang 0.5.23 (its wheel's sglang/ is python/sglang/ in the repository).
VLLM_063_FILES = {"vllm/config.py", "vllm/engine/arg_utils.py", "vllm/worker/worker.py"}
SGLANG_0523_FILES = {
    "python/sglang/srt/arg_groups/fields/schedule.py",
    "python/sglang/srt/mem_cache/kv_cache_configurator.py",
    "python/sglang/srt/mem_cache/memory_pool.py",
    "python/sglang/srt/model_executor/pool_configurator.py",
}

# Every `name="vllm:..."` of vllm/v1/metrics/loggers.py in vLLM 0.33.0. `vllm:gpu_cache_usage_perc` is not one:
# 0.33.0 calls the gauge `vllm:kv_cache_usage_perc`.
VLLM_033_METRICS = set(
    """
    num_requests_running num_requests_waiting num_requests_waiting_by_reason num_requests_kv_fetch_by_stage
    engine_sleep_state kv_cache_usage_perc corrupted_requests watermark_requests prefix_cache_queries
    prefix_cache_hits external_prefix_cache_queries external_prefix_cache_hits mm_cache_queries mm_cache_hits
    num_preemptions prompt_tokens prompt_tokens_by_source prompt_tokens_cached prompt_tokens_cached_by_source
    generation_tokens request_success admission_rejections request_prompt_tokens request_generation_tokens
    iteration_tokens_total request_max_num_generation_tokens request_params_n request_params_max_tokens
    time_to_first_token_seconds inter_token_latency_seconds request_time_per_output_token_seconds
    e2e_request_latency_seconds request_queue_time_seconds request_inference_time_seconds
    request_prefill_time_seconds request_decode_time_seconds request_num_preemptions
    request_prefill_kv_computed_tokens kv_block_lifetime_seconds kv_block_idle_before_evict_seconds
    kv_block_reuse_gap_seconds lora_requests_info cache_config_info
    """.split()
)

# The flags the boxes use, each found as an `add_argument("--flag", ...)` in the 0.33.0 file named above. Boolean
# engine fields also get a `--no-` form (argparse.BooleanOptionalAction, vllm/engine/arg_utils.py).
VLLM_033_ENGINE_FLAGS = {
    "--block-size",
    "--disable-sliding-window",
    "--enable-chunked-prefill",
    "--enable-prefix-caching",
    "--gpu-memory-utilization",
    "--kv-cache-dtype",
    "--kv-offloading-backend",
    "--kv-offloading-size",
    "--kv-transfer-config",
    "--max-model-len",
    "--max-num-batched-tokens",
    "--max-num-seqs",
    "--model",
    "--no-enable-chunked-prefill",
    "--no-enable-prefix-caching",
    "--num-gpu-blocks-override",
    "--quantization",
    "--tensor-parallel-size",
}
VLLM_033_BENCH_SERVE_FLAGS = {
    "--burstiness",
    "--dataset-name",
    "--goodput",
    "--ignore-eos",
    "--max-concurrency",
    "--metric-percentiles",
    "--model",
    "--num-prompts",
    "--percentile-metrics",
    "--prefix-repetition-num-prefixes",
    "--prefix-repetition-output-len",
    "--prefix-repetition-prefix-len",
    "--prefix-repetition-suffix-len",
    "--random-input-len",
    "--random-output-len",
    "--request-rate",
}
# `vllm bench latency` adds these to the engine's flags (EngineArgs.add_cli_args in vllm/benchmarks/latency.py).
VLLM_033_BENCH_LATENCY_FLAGS = {"--batch-size", "--input-len", "--output-len"} | VLLM_033_ENGINE_FLAGS

# Start-up memory errors as each source formats them; {name} is a field the message fills in.
STARTUP_ERRORS = [
    ("vLLM 0.33.0", "vllm/v1/core/kv_cache_planning.py", "No available memory for the cache blocks."),
    (
        "vLLM 0.6.3.post1",
        "vllm/worker/worker.py",
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing "
        "the engine.",
    ),
    (
        "vLLM 0.6.3.post1",
        "vllm/worker/worker.py",
        "The model's max seq len ({max_model_len}) is larger than the maximum number of tokens that can be "
        "stored in KV cache ({max_seq_len}). Try increasing `gpu_memory_utilization` or decreasing "
        "`max_model_len` when initializing the engine.",
    ),
    (
        "vLLM 0.33.0",
        "vllm/v1/core/kv_cache_planning.py",
        "To serve at least one request with the model's max seq len ({max_model_len}), ({needed} GiB KV cache "
        "is needed, which is larger than the available KV cache memory ({available} GiB).",
    ),
    (
        "vLLM 0.33.0",
        "vllm/v1/core/kv_cache_planning.py",
        "Based on the available memory, the estimated maximum model length is {estimated_max_len}.",
    ),
    (
        "vLLM 0.33.0",
        "vllm/v1/worker/utils.py",
        "Free memory on device {device} ({free}/{total} GiB) on startup is less than desired GPU memory "
        "utilization ({utilization}, {requested} GiB). Decrease GPU memory utilization or reduce GPU memory "
        "used by other processes.",
    ),
    (
        "SGLang 0.5.23",
        "python/sglang/srt/model_executor/pool_configurator.py",
        "Not enough memory. Please try to increase --mem-fraction-static.",
    ),
    (
        "SGLang 0.5.23",
        "python/sglang/srt/mem_cache/kv_cache_configurator.py",
        "Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static={fraction}.",
    ),
]

# The section's topics (issue 21, item 6), each the start of a paragraph, and the thread each must link.
TOPICS = {
    "**``No available memory for the cache blocks.``**": "vllm-project/vllm/issues/10439",
    "**``The model's max seq len": "vllm-project/vllm/issues/2418",
    "*A longer context can fit where a shorter one fails.*": "vllm-project/vllm/issues/10517",
    "**Two engines on one GPU.**": "vllm-project/vllm/issues/14376",
    "**SGLang's `--mem-fraction-static`, raised or lowered.**": "sgl-project/sglang/issues/4330",
    "**Why vLLM and SGLang report pools about 2× apart.**": "vllm-project/vllm/issues/21348",
}
THREAD = re.compile(r"https://github\.com/(?:vllm-project/vllm|sgl-project/sglang)/(?:issues|pull)/\d+")


def flat(text: str) -> str:
    return " ".join(text.split())


def message_pattern(template: str) -> re.Pattern[str]:
    """A message as its source formats it: the text verbatim, each field any number or placeholder."""
    parts = re.split(r"\{\w+\}", flat(template))
    return re.compile(r"[\w.,]+".join(re.escape(part) for part in parts))


def quotes(template: str, text: str) -> bool:
    return message_pattern(template).search(flat(text)) is not None


def boxes(page: Path) -> list[str]:
    return [m["body"] for m in BOX.finditer(page.read_text())]


def commands(box: str) -> list[str]:
    """The `$ ...` lines of the box's console blocks, continuation lines joined."""
    found = []
    for block in re.findall(r"```console\n(.*?)```", box, re.S):
        for command in re.split(r"\n(?=\$ )", block.replace("\\\n", " ")):
            found.append(flat(command.removeprefix("$ ")))
    return found


def section(page: Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_every_chapter_and_the_appendix_is_checked():
    names = [p.parent.name for p in CHAPTERS]
    assert len([n for n in names if n[:2].isdigit()]) == 17 and "appendix_cheat_sheet" in names


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.parent.name)
def test_one_box_per_chapter(page):
    found = boxes(page)
    assert len(found) == 1, f"{page.parent.name}: {len(found)} '{TITLE}' boxes, expected exactly one"
    assert found[0].startswith(CLASS_LINE + "\n"), (
        "the box's class line comes first, so a reader's CSS finds it"
    )
    assert page.read_text().count(TITLE) == 1, "the title appears once: no second box in another syntax"


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.parent.name)
def test_box_names_a_command_and_a_kvlab_figure(page):
    (box,) = boxes(page)
    # `vllm serve` or `vllm bench`, `vllm.LLM(...)`, or a request to a running server's HTTP port.
    command = re.search(r"^\$ (vllm (serve|bench) |curl .*localhost:8000/)|\bLLM\(", box, re.M)
    assert command, "a command to run against vLLM"
    assert "**Compare**" in box, "the box says what to compare"
    figure = re.search(
        r"Figure \d+\.\d+|\{glue:text\}`lab\.ipynb::\w+|`kvlab (size|plan|diagnose|explain-vllm)\b", box
    )
    assert figure, "the box names the kvlab figure, glued number or CLI command to compare with"
    assert VLLM_033 in box or VLLM_034 in box, "the box links the vLLM source (0.33.0 or 0.34.0) it relies on"


def test_no_chapter_keeps_a_knob_box():
    for page in CHAPTERS:
        assert "knob ↔ signal" not in page.read_text(), page.parent.name


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.parent.name)
def test_metrics_exist_in_vllm_033(page):
    (box,) = boxes(page)
    # A name cut at `_` (`vllm:prefix_cache_(queries|hits)`, a grep pattern) is a prefix of real names.
    for name in re.findall(r"vllm:([a-z_]+)", box):
        known = name in VLLM_033_METRICS or (
            name.endswith("_") and any(m.startswith(name) for m in VLLM_033_METRICS)
        )
        assert known, f"{page.parent.name}: vllm:{name} is not a metric of vLLM 0.33.0"


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.parent.name)
def test_vllm_commands_use_real_flags(page):
    (box,) = boxes(page)
    for command in commands(box):
        words = command.split()
        if words[:2] == ["vllm", "serve"]:
            known = VLLM_033_ENGINE_FLAGS
        elif words[:3] == ["vllm", "bench", "serve"]:
            known = VLLM_033_BENCH_SERVE_FLAGS
        elif words[:3] == ["vllm", "bench", "latency"]:
            known = VLLM_033_BENCH_LATENCY_FLAGS
        else:
            continue
        for flag in re.findall(r"(?<= )--[a-z][a-z0-9-]*", command):
            assert flag in known, (
                f"{page.parent.name}: {flag} is not a flag of `{' '.join(words[:3])}` in 0.33.0"
            )
    # Flags named in the box's prose: engine flags of vLLM (kvlab's own are checked by parsing below).
    prose = re.sub(r"```.*?```", " ", box, flags=re.S)
    for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", prose):
        assert flag in VLLM_033_ENGINE_FLAGS | VLLM_033_BENCH_SERVE_FLAGS, (
            f"{page.parent.name}: {flag} unknown"
        )


@pytest.mark.parametrize("page", CHAPTERS, ids=lambda p: p.parent.name)
def test_kvlab_commands_parse(page):
    from kvlab import cli

    (box,) = boxes(page)
    for command in commands(box):
        argv = shlex.split(command)
        if argv[0] != "kvlab":
            continue
        try:
            cli.build_parser(argv[1]).parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{page.parent.name}: `{command}` does not parse")


def test_links_point_at_files_of_the_pinned_releases():
    for page in CHAPTERS:
        text = page.read_text()
        for base, files in (
            (VLLM_033, VLLM_033_FILES),
            (VLLM_034, VLLM_034_FILES),
            (VLLM_063, VLLM_063_FILES),
            (SGLANG_0523, SGLANG_0523_FILES),
        ):
            for path in re.findall(re.escape(base) + r"([\w/.]+)", text):
                assert path in files, (
                    f"{page.parent.name}: {base}{path} is not a file the release was read from"
                )


def test_startup_errors_section_quotes_each_message():
    text = section(ERRORS_PAGE, "Start-up errors")
    for release, source, template in STARTUP_ERRORS:
        assert quotes(template, text), (
            f"the section does not quote {release}'s {source} verbatim: {template!r}"
        )


def test_each_startup_error_names_its_source_release():
    text = section(ERRORS_PAGE, "Start-up errors")
    for release, source, _ in STARTUP_ERRORS:
        base = {"vLLM 0.33.0": VLLM_033, "vLLM 0.6.3.post1": VLLM_063, "SGLang 0.5.23": SGLANG_0523}[release]
        assert base + source in text, f"the section links {source} of {release}"


def test_every_topic_links_a_thread():
    text = section(ERRORS_PAGE, "Start-up errors")
    paragraphs = [flat(p) for p in text.split("\n\n")]
    for marker, thread in TOPICS.items():
        (paragraph,) = [p for p in paragraphs if p.startswith(marker)]
        assert f"https://github.com/{thread}" in paragraph, f"{marker}: links {thread}"
    for paragraph in paragraphs:
        if paragraph.startswith("*"):
            assert THREAD.search(paragraph), f"each error paragraph cites an issue: {paragraph[:60]!r}"


def test_a_misquoted_message_is_caught():
    template = STARTUP_ERRORS[2][2]
    right = template.format(max_model_len="29000", max_seq_len="23648")
    assert quotes(template, f"It said: ``{right}`` at start-up.")
    assert quotes(template, right.replace(" that can be ", " that can be\n"))
    assert not quotes(template, right.replace("larger", "greater"))
    assert not quotes(template, right.replace("`max_model_len`", "max_model_len"))
    assert not quotes(
        "Free memory on device {device} ({free}/{total} GiB)", "Free memory on device D (F GiB)"
    )


def test_a_page_with_two_boxes_or_none_is_caught(tmp_path):
    one = f":::{{admonition}} {TITLE}\n{CLASS_LINE}\nbody\n:::\n"
    page = tmp_path / "index.md"
    page.write_text("# 1. x\n\n" + one + "\ntext\n\n" + one)
    assert len(boxes(page)) == 2
    page.write_text("# 1. x\n\n```{admonition} vLLM knob ↔ signal (vLLM 0.33.0)\n:class: tip\n- a\n```\n")
    assert boxes(page) == []
