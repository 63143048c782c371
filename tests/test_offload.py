"""kvlab.offload's modules: tier bandwidths and direct I/O, the offloaded cache and decode loop, its cost model,
and recompute vs reload."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from kvlab import models
from kvlab.costs import roofline
from kvlab.offload.cache import DiskLayer, HostLayer, OffloadedCache
from kvlab.offload.cost import (
    TRANSFER_TOLERANCE,
    check_offload,
    fit_offload,
    measure_offload,
    median_interval,
    offload_cost,
)
from kvlab.offload.direct_io import ALIGN, PolledReader, aligned_buffer, open_direct
from kvlab.offload.loop import (
    decode_lockstep,
    layer_weights,
    memory_reference,
    random_prompt,
    time_offload,
    timed_decode,
)
from kvlab.offload.reload import (
    RELOAD_BAND,
    break_even_flops_per_byte,
    check_reload,
    predict_reload,
    prefill_cache,
    prefill_flops_per_kv_byte,
    recompute_vs_reload,
    time_reload,
)
from kvlab.offload.saved_kv import load_kv, read_saved, save_kv, staging_buffer
from kvlab.offload.tiers import (
    CLUSTER_LINKS,
    LINKS,
    MAX_SCRATCH_BYTES,
    compute_for,
    disk_read,
    gpu_copy,
    host_link,
    link,
    measure_tiers,
    ram_copy,
)
from kvlab.specs import hardware, sizing

MiB = 2**20
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def model():
    return models.tiny_model(
        "llama", layers=3, hidden=64, heads=4, kv_heads=2, vocab=128, seed=0, device="cpu"
    )


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _leftovers(directory) -> list[str]:
    return [p for p in os.listdir(directory) if p.startswith("kvlab-")]


# --- bandwidths -------------------------------------------------------------------------------------------------


def test_ram_copy_is_positive_and_plausible():
    ram = ram_copy(8 * MiB, repeat=3)
    assert len(ram.samples) == 3 and all(s > 0 for s in ram.samples)
    assert 1e8 < ram.bytes_per_s < 1e12  # 100 MB/s .. 1 TB/s: any machine this runs on
    assert ram.bytes_per_s >= ram.median_bytes_per_s and ram.spread >= 0


def test_disk_read_bypasses_the_page_cache_and_cleans_up(tmp_path):
    disk = disk_read(8 * MiB, tmp_path, repeat=2, chunk_bytes=MiB)
    cached = disk_read(8 * MiB, tmp_path, repeat=2, chunk_bytes=MiB, buffered=True)
    assert 1e6 < disk.bytes_per_s < 1e11  # 1 MB/s .. 100 GB/s
    assert 1e7 < cached.bytes_per_s < 1e12
    assert "O_DIRECT" in disk.method or "DONTNEED" in disk.method
    assert disk.latency_samples and 0 < disk.latency_s < 0.1
    assert disk.spec_bytes_per_s == LINKS["NVMe Gen4 (Samsung 990 PRO)"].bytes_per_s
    assert _leftovers(tmp_path) == []


def test_disk_read_removes_its_file_when_reading_fails(tmp_path, monkeypatch):
    def broken(fd, buf):
        raise OSError("simulated read failure")

    monkeypatch.setattr("kvlab.offload.tiers._read_file", broken)
    with pytest.raises(OSError, match="simulated"):
        disk_read(2 * MiB, tmp_path, repeat=1, chunk_bytes=MiB)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(size_bytes=1000), "size_bytes"),
        (dict(size_bytes=4 * MiB, repeat=0), "repeat"),
        (dict(size_bytes=4 * MiB, chunk_bytes=5000), "chunk_bytes"),
        (dict(size_bytes=4 * MiB, directory="/no/such/dir"), "does not exist"),
        (dict(size_bytes=MAX_SCRATCH_BYTES + MiB), "refusing"),
    ],
)
def test_disk_read_rejects_bad_input(kwargs, message, tmp_path):
    kwargs.setdefault("directory", tmp_path)
    with pytest.raises(ValueError, match=message):
        disk_read(**kwargs)
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(CUDA, reason="checks the CPU-only error")
def test_gpu_tiers_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        host_link("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        gpu_copy("cpu")


def test_measure_tiers_on_this_machine(tmp_path):
    tiers = measure_tiers(size_bytes=4 * MiB, disk_bytes=4 * MiB, directory=tmp_path, repeat=2)
    assert {"RAM copy", "local disk", "local disk, page cache"} <= set(tiers)
    assert all(t.bytes_per_s > 0 for t in tiers.values())
    if CUDA:
        assert "host → device, pinned" in tiers and "GPU memory (copy, read + write)" in tiers
    assert _leftovers(tmp_path) == []


# --- the offloaded decode loop ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", ["all", [1], [0, 2]])
def test_disk_offload_gives_the_same_tokens_and_logits(model, layers, tmp_path):
    ids = _ids(40)
    with OffloadedCache(model.config, layers, tier="disk", directory=tmp_path, block_bytes=4096) as cache:
        assert _leftovers(tmp_path)
        ref, run = decode_lockstep(model, ids, 30, [None, cache])
        assert ref.tokens == run.tokens
        assert torch.equal(ref.logits, run.logits)  # bytes round-trip exactly: not close, equal
        offloaded = cache.offload_layers
        per_layer = sizing.kv_cache_bytes(model.config, 40 + 29) // 3
        assert cache.offloaded_bytes() == per_layer * len(offloaded)
        assert cache.get_seq_length() == 40 + 29
        disk_layers = [cache.layers[i] for i in offloaded]
        assert all(layer.direct for layer in disk_layers)  # O_DIRECT on this filesystem
        assert all(layer.disk_tokens % layer.block_tokens == 0 for layer in disk_layers)
        assert all(layer.block_bytes % ALIGN == 0 for layer in disk_layers)
        assert all(
            layer.disk_bytes == layer.disk_tokens // layer.block_tokens * layer.block_bytes
            for layer in disk_layers
        )
    assert _leftovers(tmp_path) == []  # close() removed the layer files


def test_generate_runs_with_an_offloaded_cache(model, tmp_path):
    ids = _ids(12)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    with OffloadedCache(model.config, [0, 1], directory=tmp_path) as cache:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
    assert torch.equal(expected, got)
    assert _leftovers(tmp_path) == []


def test_garbage_collection_removes_the_files(model, tmp_path):
    import gc

    cache = OffloadedCache(model.config, "all", directory=tmp_path)
    timed_decode(model, _ids(8), 3, cache)
    del cache
    gc.collect()
    assert _leftovers(tmp_path) == []


def test_offloaded_cache_rejects_bad_input(model, tmp_path):
    with pytest.raises(ValueError, match="unknown tier"):
        OffloadedCache(model.config, "all", tier="nvram")
    with pytest.raises(ValueError, match="not a layer index"):
        OffloadedCache(model.config, [3], directory=tmp_path)
    with pytest.raises(ValueError, match="'all' or layer indices"):
        OffloadedCache(model.config, "some", directory=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        OffloadedCache(model.config, "all", directory=tmp_path / "missing")
    if not CUDA:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            OffloadedCache(model.config, "all", tier="host")
    gemma = models.tiny_config("gemma2", layers=2, window=8)
    with pytest.raises(ValueError, match="only full_attention"):
        OffloadedCache(gemma, "all", directory=tmp_path)
    with pytest.raises(ValueError, match="block_bytes"):
        DiskLayer(tmp_path / "x.kv", block_bytes=1000)
    assert _leftovers(tmp_path) == []


def test_sliding_layers_stay_resident_next_to_offloaded_ones(tmp_path):
    gemma = models.tiny_model("gemma2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, window=8, seed=0,
                              device="cpu")  # fmt: skip
    full = [i for i, kind in enumerate(gemma.config.layer_types) if kind == "full_attention"]
    ids = _ids(20)
    with OffloadedCache(gemma.config, full, directory=tmp_path) as cache:
        ref, run = decode_lockstep(gemma, ids, 12, [None, cache])
    assert ref.tokens == run.tokens


@pytest.mark.skipif(not CUDA, reason="the host tier streams over the host link: GPU only")
def test_host_offload_matches_in_memory_and_transformers_offloading():
    gpu = models.tiny_model(
        "llama", layers=3, hidden=64, heads=4, kv_heads=2, vocab=128, seed=0, device="cuda"
    )
    ids = _ids(40)
    cache = OffloadedCache(gpu.config, "all", tier="host")
    theirs = DynamicCache(config=gpu.config, offloading=True)
    ref, run, hf = decode_lockstep(gpu, ids, 20, [None, cache, theirs])
    assert ref.tokens == run.tokens == hf.tokens


def test_host_layer_returns_the_history_it_was_given():
    # On CPU the host tier is refused by OffloadedCache (there is no link); the layer itself still round-trips.
    layer = HostLayer()
    keys = torch.randn(2, 3, 70, 8)
    values = torch.randn(2, 3, 70, 8)
    k, v = layer.update(keys[:, :, :65], values[:, :, :65])
    for t in range(65, 70):  # one token at a time, past the first capacity (64)
        k, v = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert layer.get_seq_length() == 70 and layer.stored_bytes() == 2 * keys.nbytes
    assert layer.bytes_streamed == sum(2 * keys[:, :, :n].nbytes for n in range(65, 71))
    assert layer.reread()[0] == 2 * keys.nbytes and layer.bytes_streamed == sum(
        2 * keys[:, :, :n].nbytes for n in range(65, 71)
    )  # the repeated transfer moves the whole layer and leaves the count alone


def test_decode_rejects_bad_input(model):
    with pytest.raises(ValueError, match="new_tokens"):
        timed_decode(model, _ids(4), 0)
    with pytest.raises(ValueError, match="at least one cache"):
        decode_lockstep(model, _ids(4), 2, [])


# --- the cost model -----------------------------------------------------------------------------------------------


def test_offload_cost_arithmetic(model):
    # 3 layers, 2 KV heads × 16 dims, fp32: 2 × 2 × 16 × 4 = 256 bytes per token per layer.
    cost = offload_cost(model.config, 100, 2, "disk", {"disk": 1e9, "ram": 4e9}, block_tokens=32,
                                disk_latency_s=1e-4)  # fmt: skip
    assert cost.bytes_per_step == 2 * 100 * 256
    assert cost.disk_bytes_per_step == 2 * 96 * 256  # whole blocks only
    assert cost.terms["disk read"] == pytest.approx(2 * 1e-4 + 2 * 96 * 256 / 1e9)
    assert cost.terms["reorder (RAM copy)"] == pytest.approx(2 * 100 * 256 / 4e9)
    assert cost.seconds == pytest.approx(sum(cost.terms.values()))
    host = offload_cost(model.config, 100, 3, "host", {"h2d": 25e9}, dtype="bf16")
    assert host.terms == {"host → device": pytest.approx(3 * 100 * 128 / 25e9)}
    assert host.disk_bytes_per_step == 0
    host_lat = offload_cost(model.config, 100, 3, "host", {"h2d": 25e9}, dtype="bf16", link_latency_s=1e-5)
    assert host_lat.terms["copy latency"] == pytest.approx(2 * 3 * 1e-5)  # new K/V out, the layer's K/V in
    none = offload_cost(model.config, 10, 2, "disk", {"disk": 1e9, "ram": 4e9}, block_tokens=32,
                                disk_latency_s=1e-3)  # fmt: skip
    assert none.terms["disk read"] == 0  # nothing on disk yet: no request, no latency


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tier="tape"), "unknown tier"),
        (dict(bandwidths={"disk": 0}), "positive"),
        (dict(bandwidths={"ram": 1e9}), "needs a 'disk'"),
        (dict(bandwidths={"disk": 1e9, "nvlink": 1e9}), "unknown hop"),
        (dict(offloaded_layers=4), "exceeds"),
        (dict(context=0), "context"),
        (dict(disk_latency_s=-1.0), "disk_latency_s"),
        (dict(link_latency_s=True), "link_latency_s"),
    ],
)
def test_offload_cost_rejects_bad_input(model, kwargs, message):
    args = dict(context=10, offloaded_layers=1, tier="disk", bandwidths={"disk": 1e9}) | kwargs
    with pytest.raises(ValueError, match=message):
        offload_cost(model.config, **args)


def test_polled_reader_reads_what_preadv_reads(tmp_path):
    path = tmp_path / "blob"
    data = os.urandom(3 * ALIGN)
    path.write_bytes(data)
    fd, direct = open_direct(path, os.O_RDONLY)
    buf = aligned_buffer(2 * ALIGN)
    reader = PolledReader()
    try:
        view = memoryview(buf)[: 2 * ALIGN]
        assert reader.read(fd, view, ALIGN) == 2 * ALIGN
        view.release()
        assert bytes(buf[: 2 * ALIGN]) == data[ALIGN:]
    finally:
        reader.close()
        os.close(fd)
        buf.close()
    assert not reader.polled  # closed: later reads fall back to preadv


def test_reread_repeats_the_transfer_without_changing_the_cache(model, tmp_path):
    ids = _ids(40)
    with OffloadedCache(model.config, [1, 2], tier="disk", directory=tmp_path, block_bytes=4096) as cache:
        assert cache.reread() == (0, 0.0)  # nothing held yet
        ref, run = decode_lockstep(model, ids, 6, [None, cache])
        read, streamed = cache.layers[1].bytes_read_from_disk, cache.bytes_streamed()
        nbytes, seconds = cache.reread(compute_s=1e-4)
        # the whole K/V of both layers, as `update` returns it (the partial block comes from RAM)
        assert nbytes == 2 * sizing.kv_cache_bytes(model.config, 45) // 3 and seconds > 0
        assert cache.layers[1].bytes_read_from_disk == read and cache.bytes_streamed() == streamed
        assert cache.get_seq_length() == 45
        with pytest.raises(ValueError, match="compute_s"):
            cache.reread(compute_s=-1.0)
        # the computing before each access reads the weights it is given, one list per offloaded layer
        weights = layer_weights(model)
        assert cache.reread(1e-4, reads=[weights[0], weights[1]])[0] == nbytes
        with pytest.raises(ValueError, match="reads has 1 entries for 2 offloaded layers"):
            cache.reread(1e-4, reads=[weights[0]])


def test_time_offload_and_fit(model, tmp_path):
    ids = _ids(200)
    with OffloadedCache(model.config, [1, 2], tier="disk", directory=tmp_path, block_bytes=4096) as cache:
        timing = time_offload(model, ids, 9, cache, others=[None])
        block_tokens = cache.layers[1].block_tokens
    assert timing.offloaded.tokens == timing.memory.tokens == timing.others[0].tokens
    steps = len(timing.offloaded.step_s)
    assert steps == len(timing.transfer_s) == len(timing.transfer_bytes) == len(timing.append_s) == 8
    assert all(b > 0 for b in timing.transfer_bytes) and timing.bandwidth.median_bytes_per_s > 0
    assert all(a > 0 for a in timing.append_s)
    assert timing.compute_s == [m - a for m, a in zip(timing.memory.step_s, timing.append_s, strict=True)]
    fit = fit_offload(timing, model.config, 2, "disk", block_tokens=block_tokens)
    assert fit.predicted_s == pytest.approx(fit.compute_s + fit.transfer_s)
    assert fit.compute_s == pytest.approx(statistics.median(timing.compute_s))
    assert fit.measured_s == timing.offloaded.median_step_s
    assert fit.memory_s == timing.memory.median_step_s and fit.confidence == 0.99
    # the band: the prediction's interval widened by the measured median's, both from `median_interval`
    per_step = [c + t for c, t in zip(timing.compute_s, timing.transfer_s, strict=True)]
    p_low, p_high = median_interval(per_step, 0.99)
    m_low, m_high = median_interval(timing.offloaded.step_s, 0.99)
    centre = statistics.median(per_step)
    # widened on each side by the model's tolerance, a tenth of the transfer term
    allowance = TRANSFER_TOLERANCE * fit.transfer_s
    assert TRANSFER_TOLERANCE == 0.1
    low = fit.predicted_s - allowance - (centre - p_low) - (m_high - fit.measured_s)
    assert fit.low_s == pytest.approx(low)
    high = fit.predicted_s + allowance + (p_high - centre) + (fit.measured_s - m_low)
    assert fit.high_s == pytest.approx(high)
    exact = fit_offload(timing, model.config, 2, "disk", block_tokens=block_tokens, tolerance=0.0)
    assert exact.high_s - exact.low_s == pytest.approx(fit.high_s - fit.low_s - 2 * allowance)
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="tolerance"):
            fit_offload(timing, model.config, 2, "disk", tolerance=bad)
    assert fit.band[0] <= 0 <= fit.band[1] and 0 < fit.transfer_share < 1
    assert fit.holds == (fit.low_s <= fit.measured_s <= fit.high_s)
    # the transfer term is the bytes at the middle step over the loop's median bandwidth
    middle = offload_cost(model.config, 200 + 8 // 2 + 1, 2, "disk",
                                  {"disk": timing.bandwidth.median_bytes_per_s}, block_tokens=block_tokens)  # fmt: skip
    assert fit.transfer_s == pytest.approx(middle.seconds)
    overlapped = dataclasses.replace(fit, overlap=True)
    assert overlapped.predicted_s == max(fit.compute_s, fit.transfer_s)
    short = dataclasses.replace(timing, offloaded=dataclasses.replace(timing.offloaded, step_s=[1.0] * 7))
    with pytest.raises(ValueError, match="at least 8 decode steps"):
        fit_offload(short, model.config, 2, "disk")


def test_the_in_memory_reference_waits_where_the_tier_does_and_repeats_its_appends(model):
    cache = memory_reference(model.config, [0, 2])
    assert [type(layer).__name__ for layer in cache.layers] == ["SyncedLayer", "DynamicLayer", "SyncedLayer"]
    assert cache.layers[0].reappend() == 0.0  # nothing appended yet
    ref, run = decode_lockstep(model, _ids(20), 5, [None, cache])
    assert ref.tokens == run.tokens and torch.equal(ref.logits, run.logits)
    layer = cache.layers[0]
    keys = layer.keys.clone()
    assert layer.reappend() > 0 and torch.equal(layer.keys, keys)  # timed again, the history unchanged
    with pytest.raises(ValueError, match="not a layer index"):
        memory_reference(model.config, [3])


def test_median_interval_is_a_distribution_free_interval_for_the_median():
    values = list(range(1, 41))
    # n = 40 at 99 %: P(Binomial(40, 1/2) <= 11) = 0.0032 <= 0.005 < P(<= 12) = 0.0083, so k = 12
    assert median_interval(values, 0.99) == (12, 29)
    assert median_interval(list(range(8)), 0.99) == (0, 7)  # 2 / 2**8 <= 0.01: the extremes
    with pytest.raises(ValueError, match="too few"):
        median_interval([1.0] * 7, 0.99)
    with pytest.raises(ValueError, match="confidence"):
        median_interval(values, 1.0)
    # coverage: over many samples of a skewed distribution the interval holds the true median >= 99 % of the time
    samples = np.random.default_rng(0).exponential(1.0, (4000, 40))
    true_median = math.log(2)
    intervals = [median_interval(row.tolist()) for row in samples]
    covered = sum(lo <= true_median <= hi for lo, hi in intervals)
    assert covered / 4000 >= 0.99 - 0.005


# --- recompute vs reload ------------------------------------------------------------------------------------------


def test_recompute_vs_reload_arithmetic():
    name, gpu = "meta-llama/Llama-3.1-8B", hardware.get("H100-SXM")
    est = recompute_vs_reload(name, gpu, "PCIe Gen5 x16", 8192)
    step = roofline.prefill(name, gpu, 1, 8192)
    assert est.kv_bytes == sizing.kv_cache_bytes(name, 8192)
    assert est.reload_s == pytest.approx(est.kv_bytes / 64e9)
    assert est.recompute_s == pytest.approx(step.time_s)
    assert est.flops_per_kv_byte == pytest.approx(step.flops / est.kv_bytes)
    assert est.flops_per_kv_byte == pytest.approx(prefill_flops_per_kv_byte(name, 8192))
    even = break_even_flops_per_byte(gpu, "PCIe Gen5 x16")
    assert even == pytest.approx(gpu.flops / 64e9)
    # compute-bound prefill: reload wins exactly when the prompt's FLOPs per KV byte exceed the break-even
    assert step.bound == "compute"
    assert (est.speedup > 1) == (est.flops_per_kv_byte > even)


def test_gqa_favours_reload_over_mha():
    gqa = prefill_flops_per_kv_byte("meta-llama/Llama-3.1-8B", 4096)  # 8 KV heads of 32
    mha = prefill_flops_per_kv_byte("meta-llama/Llama-2-7b-hf", 4096)  # 32 of 32
    assert gqa > 3 * mha  # 4× fewer KV bytes for about the same FLOPs


def test_links_and_bad_input():
    assert link("pcie gen4 x16").bytes_per_s == 32e9
    # the PCIe rates are the spec table's, written once
    assert link("PCIe Gen5 x16").bytes_per_s == hardware.PCIE_X16_BYTES_PER_S[5]
    assert all(link.source for link in LINKS.values())
    assert all(link.source for link in CLUSTER_LINKS.values())
    # chapter 12's tables list the offload tiers only
    assert not set(LINKS) & set(CLUSTER_LINKS)
    # Cluster links, one direction: NVLink is half the datasheets' both-ways total, from the one spec table
    assert link("NVLink 4 (H100 SXM)").bytes_per_s == 450e9
    assert link("NVLink 5 (B200)").bytes_per_s == hardware.get("B200").interconnect_bytes_per_s / 2 == 900e9
    assert link("800 Gb InfiniBand XDR").bytes_per_s == 2 * link("400 Gb InfiniBand NDR").bytes_per_s == 100e9
    assert link("400 Gb RoCE").bytes_per_s == 400e9 / 8
    with pytest.raises(ValueError, match="unknown link"):
        link("carrier pigeon")
    with pytest.raises(ValueError, match="positive"):
        break_even_flops_per_byte("H100-SXM", 0.0)
    assert break_even_flops_per_byte("H100-SXM", 1e9) == pytest.approx(989.4e12 / 1e9)


def test_saved_kv_reloads_to_the_same_continuation(model, tmp_path):
    ids = _ids(30)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    saved = save_kv(cache, tmp_path / "prompt.kv")
    assert saved.nbytes == sizing.kv_cache_bytes(model.config, 30)
    assert saved.file_bytes % ALIGN == 0 and saved.file_bytes >= saved.nbytes
    loaded = load_kv(saved, "cpu")
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    with torch.inference_mode():  # decoding on from the reloaded KV is decoding on from the original
        nxt = torch.tensor([[5]])
        assert torch.equal(model(nxt, cache=cache).logits, model(nxt, cache=loaded).logits)
    with pytest.raises(ValueError, match="run a prefill"):
        save_kv(DynamicCache(config=model.config), tmp_path / "empty.kv")


def cap_each_call(monkeypatch, cap: int) -> list[int]:
    """os.pwritev and os.preadv that move at most `cap` bytes a call, as Linux moves at most 2 GiB - 4 KiB
    (MAX_RW_COUNT); returns the sizes each call asked for."""
    asked: list[int] = []
    write, read = os.pwritev, os.preadv

    def capped(call):
        def move(fd, buffers, offset):
            (view,) = buffers
            asked.append(len(view))
            return call(fd, [memoryview(view)[:cap]], offset)

        return move

    monkeypatch.setattr(os, "pwritev", capped(write))
    monkeypatch.setattr(os, "preadv", capped(read))
    return asked


def test_saved_kv_round_trips_through_calls_that_move_less_than_asked(model, tmp_path, monkeypatch):
    """Chapter 12 at GPU sizes saves exactly 2 GiB, more than one call moves: save and load loop in aligned
    chunks (here 5 pages) and again after each short transfer (here 3 pages), and the bytes come back exact."""
    from kvlab.offload import direct_io

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(_ids(30), cache=cache, use_cache=True)
    monkeypatch.setattr(direct_io, "CHUNK", 5 * ALIGN)
    asked = cap_each_call(monkeypatch, 3 * ALIGN)
    saved = save_kv(cache, tmp_path / "prompt.kv")
    assert saved.file_bytes > 5 * ALIGN and max(asked) == 5 * ALIGN and all(n % ALIGN == 0 for n in asked)
    loaded = load_kv(saved, "cpu")
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert len(asked) >= 2 * saved.file_bytes // (3 * ALIGN)


def test_disk_tier_and_polled_reads_loop_on_short_transfers(model, tmp_path, monkeypatch):
    """The disk tier's writes and its reads, polled (native AIO) or not, in chunks and past short transfers."""
    from kvlab.offload import direct_io

    monkeypatch.setattr(direct_io, "CHUNK", 2 * ALIGN)
    asked = cap_each_call(monkeypatch, ALIGN)
    once = PolledReader._read_once
    polled: list[int] = []

    def short_aio(self, fd, view, offset):
        polled.append(len(view))
        return once(self, fd, view[:ALIGN], offset)

    monkeypatch.setattr(PolledReader, "_read_once", short_aio)
    ids = _ids(40)
    with OffloadedCache(model.config, "all", tier="disk", directory=tmp_path, block_bytes=4096) as cache:
        ref, run = decode_lockstep(model, ids, 6, [None, cache])
        assert ref.tokens == run.tokens and torch.equal(ref.logits, run.logits)
    assert max(asked) <= 2 * ALIGN and len(asked) > 1
    assert max(polled, default=0) <= 2 * ALIGN and (polled or not PolledReader().polled)


# --- the claims, as the lab measures and checks them --------------------------------------------------------------


def test_random_prompt_is_the_same_at_a_length_and_differs_between_lengths():
    a, b = random_prompt(128, 2, 16, seed=3), random_prompt(128, 2, 16, seed=3)
    assert torch.equal(a, b) and a.shape == (2, 16) and int(a.min()) >= 2 and int(a.max()) < 128
    assert not torch.equal(random_prompt(128, 2, 17, seed=3)[:, :16], a)


def test_measure_and_check_offload(model, tmp_path):
    sweep = measure_offload(model, [64, 96], [1, 2], "disk", 9)
    assert sorted(sweep.fits) == [64, 96] and sweep.tier == "disk" and sweep.offloaded == (1, 2)
    assert sweep.tokens == 2 * 9
    checks = check_offload(sweep, min_share=0.0)
    names = [c.name for c in checks]
    assert names[0] == "96 tokens: transfer at least 0% of the predicted step" and checks[0].holds
    assert "64 tokens: offloaded step (ms) in the band around compute + transfer" in names
    assert "96 tokens: band above the compute-only step (ms)" in names
    assert len(checks) == 2 + 2 * 2
    # at a share no step reaches, only the longest context's two conditions remain, and the first misses
    strict = check_offload(sweep, min_share=1.0)
    assert len(strict) == 2 and not strict[0].holds


def test_measure_offload_refuses_a_cache_that_changes_the_tokens(model):
    class Corrupt(DiskLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            k, v = super().update(key_states, value_states, *args, **kwargs)
            return k, torch.randn_like(v) * 10

    def corrupt(config, layers, tier):
        cache = OffloadedCache(config, layers, tier=tier)
        cache.layers[layers[0]] = Corrupt(cache.layers[layers[0]].path.with_suffix(".bad"))
        return cache

    with pytest.raises(AssertionError, match="tokens differ"):
        measure_offload(model, [64], [1], "disk", 9, make_cache=corrupt)


def test_host_layer_reread_copies_the_new_token_out_and_the_layer_in():
    layer = HostLayer()
    assert layer.reread() == (0, 0.0)
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.update(keys[:, :, :4], values[:, :, :4])
    layer.update(keys[:, :, 4:], values[:, :, 4:])
    nbytes, seconds = layer.reread()
    assert nbytes == 2 * keys.nbytes and seconds >= 0
    assert layer._scratch is not None and torch.equal(layer._scratch, layer._host[4:5])


def test_time_and_check_reload(model, tmp_path):
    ids = _ids(64)
    timing = time_reload(model, ids, repeat=2, directory=tmp_path)
    assert timing.saved.nbytes == sizing.kv_cache_bytes(model.config, 64)
    assert timing.same_next_token and timing.recompute_s > 0 and timing.reload_s > 0
    assert timing.prompt_len == 64 and timing.half_prefill_s > 0 and timing.read_s > 0
    assert timing.copy_bytes_per_s > 0 and timing.fresh_reload_s > 0
    assert timing.speedup == timing.recompute_s / timing.reload_s
    assert _leftovers(tmp_path) == []
    predicted = predict_reload(timing, model.config)
    flops = [roofline.prefill(model.config, "H100-SXM", 1, n).flops for n in (64, 32)]
    assert predicted.recompute_s == pytest.approx(timing.half_prefill_s * flops[0] / flops[1])
    assert predicted.reload_s == pytest.approx(timing.read_s + timing.saved.nbytes / timing.copy_bytes_per_s)
    # a measurement exactly as predicted holds; one off by the band's factor or more, either way, misses
    exact = dataclasses.replace(timing, recompute_s=predicted.recompute_s, reload_s=predicted.reload_s)
    checks = check_reload(exact, predicted)
    assert [c.name for c in checks] == [
        "recompute: measured / predicted",
        "reload: measured / predicted",
        "the model picks the same winner as the stopwatch",
    ] and all(c.holds for c in checks)
    for field in ("recompute_s", "reload_s"):
        for factor in (RELOAD_BAND * 1.01, 1 / RELOAD_BAND / 1.01):
            off = dataclasses.replace(exact, **{field: getattr(exact, field) * factor})
            assert [c.holds for c in check_reload(off, predicted)][:2].count(False) == 1
    flipped = dataclasses.replace(exact, reload_s=exact.recompute_s * (0.5 if predicted.speedup < 1 else 2.0))
    assert not check_reload(flipped, predicted)[2].holds
    with pytest.raises(ValueError, match="band"):
        check_reload(timing, predicted, band=1.0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        time_reload(model, ids[:, :1], repeat=1, directory=tmp_path)


def test_load_kv_reads_into_a_kept_staging_buffer(model, tmp_path):
    saved = save_kv(prefill_cache(model, _ids(40)), tmp_path / "p.kv")
    staging = staging_buffer(saved)
    try:
        first, again = load_kv(saved, "cpu", staging), load_kv(saved, "cpu", staging)
        plain = load_kv(saved, "cpu")
        for a, b, c in zip(first.layers, again.layers, plain.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, c.values)
            # the cache owns its tensors: the next read into the staging buffer cannot change them
            assert a.keys.data_ptr() != b.keys.data_ptr()
        with pytest.raises(ValueError, match="the buffer holds"):
            read_saved(saved, aligned_buffer(4096))
    finally:
        staging.close()


def test_prefill_cache_holds_the_prompt(model):
    cache = prefill_cache(model, _ids(12))
    assert cache.get_seq_length() == 12


def test_layer_weights_are_each_decoder_layers_parameters(model):
    weights = layer_weights(model)
    layers = model.config.num_hidden_layers
    assert sorted(weights) == list(range(layers))
    named = dict(model.named_parameters())
    for index, tensors in weights.items():
        mine = [p for name, p in named.items() if f".layers.{index}." in name]
        assert [t.data_ptr() for t in tensors] == [p.data_ptr() for p in mine]
    # the embedding and the final norm belong to no layer
    total = sum(t.numel() for ts in weights.values() for t in ts)
    assert total < sum(p.numel() for p in model.parameters())
    assert layer_weights(torch.nn.Linear(2, 2)) == {}


def test_compute_for_reads_each_tensor_once_and_spends_its_time():
    reads = [torch.ones(4), torch.ones(8)]
    seen = []
    for tensor in reads:
        tensor.sum = lambda t=tensor: seen.append(t.numel()) or torch.zeros(())
    start = time.perf_counter()
    compute_for(0.002, reads=reads)
    assert time.perf_counter() - start >= 0.002 and seen == [4, 8]
