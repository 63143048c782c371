"""kvlab.book.profiles: each lab's GPU sizes by device memory, chosen with torch.cuda's readings faked on CPU."""

import json
from pathlib import Path

import pytest
import torch

from kvlab.book import profiles
from kvlab.book.sweep import notebook_parameters
from kvlab.experiments.decode import MEMORY_HEADROOM, eager_scores_bytes
from kvlab.models import tiny_model
from kvlab.units import GiB

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def test_the_packaged_cpu_defaults_are_each_labs_parameters_cell():
    """The labs are not installed with kvlab: the package's record of their defaults must be theirs."""
    assert profiles.recorded_defaults() == profiles.lab_defaults(BOOK), (
        "run python -m kvlab.book.profiles --write-defaults"
    )


def test_the_parameters_file_and_its_record_ship_in_the_package():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"kvlab.book" = ["gpu_params.yaml", "lab_defaults.json"]' in text
    assert profiles.PARAMS_FILE.parent == Path(profiles.__file__).parent
    assert not (BOOK / "gpu_params.yaml").exists()


def fake_cuda(monkeypatch, free_bytes, name="NVIDIA T4"):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 16 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def lab(chapter):
    return notebook_parameters(BOOK / chapter / "lab.ipynb")


def test_on_a_cpu_nothing_changes_and_nothing_is_printed(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU run read the GPU's memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", refuse)
    for chapter in profiles.gpu_sized():
        assert profiles.gpu_sizes(chapter, lab(chapter), torch.device("cpu")) == {}
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("free", "gb", "hidden", "longest"),
    [(78 * GiB, 80, 8192, 65536), (39 * GiB, 40, 8192, 32768), (22 * GiB, 24, 4096, 65536)],
)
def test_a_cuda_device_gets_the_largest_profile_that_fits(monkeypatch, capsys, free, gb, hidden, longest):
    fake_cuda(monkeypatch, free)
    sizes = profiles.gpu_sizes("03_prefill_decode", lab("03_prefill_decode"), torch.device("cuda"))
    assert sizes == profiles.profile("03_prefill_decode", gb)
    assert (sizes["hidden"], max(sizes["contexts"])) == (hidden, longest)
    line = capsys.readouterr().out.strip()
    assert line.startswith(
        f"NVIDIA T4, {free / GiB:.3g} GiB free: the {gb} GB profile's sizes (predicted peak"
    )
    assert "\n" not in line
    # the next larger profile would not have fitted
    larger = profiles.PROFILES_GB[profiles.PROFILES_GB.index(gb) - 1] if gb != 80 else None
    if larger:
        values = lab("03_prefill_decode") | profiles.profile("03_prefill_decode", larger)
        assert profiles.peak_bytes("03_prefill_decode", values) > MEMORY_HEADROOM * free


def test_the_readers_own_sizes_are_kept_and_too_large_ones_stop_the_lab(monkeypatch):
    values = lab("04_bandwidth_bound") | {"contexts": [64, 128]}  # papermill -p contexts "[64, 128]"
    choice = profiles.choose("04_bandwidth_bound", values, 78 * GiB)
    assert choice.gb == 80 and choice.kept == {"contexts": [64, 128]} and "contexts" not in choice.sizes
    assert choice.sizes["hidden"] == 16384
    # hidden 32,768: 80 GB of bf16 weights on a T4
    values = lab("04_bandwidth_bound") | {"hidden": 32768, "heads": 256}
    fake_cuda(monkeypatch, 15 * GiB)
    with pytest.raises(profiles.SizesTooLarge) as err:
        profiles.gpu_sizes("04_bandwidth_bound", values, torch.device("cuda"))
    message = str(err.value)
    assert "\n" not in message and message.endswith("lower heads, hidden")
    assert "04_bandwidth_bound: these sizes need about" in message and "15 GiB free" in message


def test_a_device_too_small_for_every_profile_keeps_the_cpu_sizes():
    choice = profiles.choose("03_prefill_decode", lab("03_prefill_decode"), 2 * GiB)
    assert choice.gb is None and choice.sizes == {} and choice.peak < MEMORY_HEADROOM * 2 * GiB
    assert "no GPU profile fits; the CPU sizes" in choice.line("NVIDIA T4")


def test_chapter_1_s_peak_covers_the_eager_scores_its_own_check_refuses():
    """Where the profile fits, decode.check_uncached_step_fits (the same headroom) must not refuse it."""
    values = lab("01_cache_contents") | profiles.profile("01_cache_contents", 16)
    longest = max(values["history_lengths"])
    model = tiny_model(layers=1, hidden=64, heads=values["heads"], kv_heads=values["kv_heads"], vocab=32)
    assert profiles.peak_bytes("01_cache_contents", values) > eager_scores_bytes(model, longest + 1)


def test_chapter_3_s_decode_sweep_counts_every_points_cache():
    values = lab("03_prefill_decode") | profiles.profile("03_prefill_decode", 80)
    fewer = values | {"batch_sizes": [1, 8]}
    # 32 and 128 sequences of 1,024 tokens at 128 KiB a token: 20 GiB less
    saved = profiles.peak_bytes("03_prefill_decode", values) - profiles.peak_bytes("03_prefill_decode", fewer)
    assert saved >= (32 + 128) * 1024 * 128 * 2**10


def test_every_gpu_sized_lab_calls_gpu_sizes_after_its_imports_with_no_output():
    for chapter in profiles.gpu_sized():
        cells = json.loads((BOOK / chapter / "lab.ipynb").read_text())["cells"]
        calls = [i for i, c in enumerate(cells) if "gpu_sizes(" in "".join(c["source"])]
        assert len(calls) == 1, chapter
        cell = cells[calls[0]]
        assert f'gpu_sizes("{chapter}", globals(), kvlab.pick_device())' in "".join(cell["source"])
        assert cell["outputs"] == [], f"{chapter}: on a CPU the profile cell prints nothing"
        imports = next(i for i, c in enumerate(cells) if "import kvlab\n" in "".join(c["source"]))
        assert calls[0] == imports + 2 and cells[imports + 1]["cell_type"] == "markdown", chapter


def test_the_docs_table_is_the_profile_table():
    text = (ROOT / "docs" / "running.md").read_text()
    start, end = (text.index(m) for m in profiles.TABLE_MARKS)
    assert text[start + len(profiles.TABLE_MARKS[0]) : end].strip() == profiles.markdown_table(
        profiles.profile_table()
    ), "run python -m kvlab.book.profiles --write-table docs/running.md"


def test_a_bad_profile_is_a_one_line_error(tmp_path):
    data = {"03_prefill_decode": {"hidden": 1024, "profiles": {32: {"hidden": 512}}}}
    with pytest.raises(ValueError, match=r"03_prefill_decode: no profile \[32\]"):
        profiles.profile("03_prefill_decode", 16, data)
    data = {"03_prefill_decode": {"hidden": 1024, "profiles": {40: {"hidden": 512}, 16: {"layers": 2}}}}
    assert profiles.profile("03_prefill_decode", 24, data) == {"hidden": 512}
    assert profiles.profile("03_prefill_decode", 16, data) == {"hidden": 512, "layers": 2}


# The device each profile is named after, from kvlab.specs.hardware's datasheet table
DEVICES = {16: "T4", 24: "L4", 40: "A100-40GB", 80: "H100-SXM"}
# A generous fixed cost of a step or forward of these 4- and 8-layer models on a GPU (launches, dispatch)
LAUNCHES_S = 2e-3


@pytest.mark.parametrize("gb", sorted(DEVICES))
def test_chapter_12_s_transfer_outweighs_the_step_at_every_profile(gb):
    """The claim 'transfer >= 20 % of the step' at the profile each device picks: predicted from its datasheet's
    host link and HBM bandwidth, with a step of 2 ms of launches on top, the transfer is at least twice that."""
    from kvlab.costs import roofline
    from kvlab.models import tiny_config
    from kvlab.offload.cost import offload_cost
    from kvlab.specs import hardware

    chapter = "12_beyond_hbm"
    values = lab(chapter) | profiles.choose(chapter, lab(chapter), profiles.TYPICAL_FREE[gb]).sizes
    config = tiny_config(
        "llama", **{k: values[k] for k in ("layers", "hidden", "heads", "kv_heads", "vocab")}
    )
    spec = hardware.get(DEVICES[gb])
    context, batch = max(values["contexts"]) + values["new_tokens"] // 2, values["batch"]
    link = {"h2d": spec.host_link_bytes_per_s}
    transfer = offload_cost(config, context, len(values["offloaded"]), "host", link, batch, "bf16").seconds
    step = roofline.decode_step(config, spec, batch, context, dtype="bf16").time_s + LAUNCHES_S
    assert transfer / (transfer + step) >= 2 * 0.2, (gb, transfer, step)


@pytest.mark.parametrize("gb", sorted(DEVICES))
def test_chapter_3_s_prefill_long_end_is_work_at_every_profile(gb):
    """At the profile each device picks, the second-longest prompt's prefill is predicted (datasheet FLOP/s and
    bandwidth) to be at least timing.PREFILL_DOMINANCE x a generous fixed cost: the growth claims are held."""
    from kvlab.costs import roofline
    from kvlab.experiments.timing import PREFILL_DOMINANCE
    from kvlab.models import tiny_config
    from kvlab.specs import hardware

    chapter = "03_prefill_decode"
    values = lab(chapter) | profiles.choose(chapter, lab(chapter), profiles.TYPICAL_FREE[gb]).sizes
    config = tiny_config(
        "llama", **{k: values[k] for k in ("layers", "hidden", "heads", "kv_heads", "vocab")}
    )
    second = sorted(values["prompt_lens"])[-2]
    work = roofline.prefill(config, hardware.get(DEVICES[gb]), 1, second, dtype="bf16").time_s
    assert work >= PREFILL_DOMINANCE * LAUNCHES_S, (gb, work)
    # at the CPU sizes a GPU is launch-bound: the lab then says so instead of missing every attempt
    cpu = lab(chapter)
    small = tiny_config("llama", **{k: cpu[k] for k in ("layers", "hidden", "heads", "kv_heads", "vocab")})
    second = sorted(cpu["prompt_lens"])[-2]
    assert roofline.prefill(small, hardware.get(DEVICES[gb]), 1, second, dtype="bf16").time_s < LAUNCHES_S


@pytest.mark.parametrize("gb", sorted(DEVICES))
def test_chapter_3_s_batch_shares_its_weight_reads_at_every_profile(gb):
    """timing.batch_cost's bound, sqrt(batch) batch-1 steps, against the datasheet's memory-bound step: the
    weights read once, the batch's cache read and copied by DynamicCache's append (3 x its bytes), with a fifth
    to spare. At 24 GB a 1,024-token batch context would not (hence its 256)."""
    from kvlab.models import tiny_config
    from kvlab.specs.sizing import kv_cache_bytes, weight_bytes

    chapter = "03_prefill_decode"
    values = lab(chapter) | profiles.choose(chapter, lab(chapter), profiles.TYPICAL_FREE[gb]).sizes
    config = tiny_config(
        "llama", **{k: values[k] for k in ("layers", "hidden", "heads", "kv_heads", "vocab")}
    )
    weights, largest = weight_bytes(config, "bf16"), max(values["batch_sizes"])

    def step(batch, context=values["batch_context"]):
        # a memory-bound step's time is its bytes over the device's one bandwidth
        return weights + 3 * kv_cache_bytes(config, context, batch, "bf16")

    assert step(largest) / step(1) < largest**0.5 / 1.2, gb
    if gb == 24:
        assert step(largest, 1024) / step(1, 1024) > largest**0.5 / 1.2
