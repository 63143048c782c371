"""kvlab.offload: tier bandwidths, the offloaded decode loop, its cost model, and recompute vs reload."""

from __future__ import annotations

import dataclasses
import math
import os
import time

import pytest
import torch
from transformers import DynamicCache

from kvlab import hardware, models, offload, roofline, sizing

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
    ram = offload.ram_copy(8 * MiB, repeat=3)
    assert len(ram.samples) == 3 and all(s > 0 for s in ram.samples)
    assert 1e8 < ram.bytes_per_s < 1e12  # 100 MB/s .. 1 TB/s: any machine this runs on
    assert ram.bytes_per_s >= ram.median_bytes_per_s and ram.spread >= 0


def test_disk_read_bypasses_the_page_cache_and_cleans_up(tmp_path):
    disk = offload.disk_read(8 * MiB, tmp_path, repeat=2, chunk_bytes=MiB)
    cached = offload.disk_read(8 * MiB, tmp_path, repeat=2, chunk_bytes=MiB, buffered=True)
    assert 1e6 < disk.bytes_per_s < 1e11  # 1 MB/s .. 100 GB/s
    assert 1e7 < cached.bytes_per_s < 1e12
    assert "O_DIRECT" in disk.method or "DONTNEED" in disk.method
    assert disk.latency_samples and 0 < disk.latency_s < 0.1
    assert disk.spec_bytes_per_s == offload.LINKS["NVMe Gen4 (Samsung 990 PRO)"].bytes_per_s
    assert _leftovers(tmp_path) == []


def test_disk_read_removes_its_file_when_reading_fails(tmp_path, monkeypatch):
    def broken(fd, buf):
        raise OSError("simulated read failure")

    monkeypatch.setattr(offload, "_read_file", broken)
    with pytest.raises(OSError, match="simulated"):
        offload.disk_read(2 * MiB, tmp_path, repeat=1, chunk_bytes=MiB)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(size_bytes=1000), "size_bytes"),
        (dict(size_bytes=4 * MiB, repeat=0), "repeat"),
        (dict(size_bytes=4 * MiB, chunk_bytes=5000), "chunk_bytes"),
        (dict(size_bytes=4 * MiB, directory="/no/such/dir"), "does not exist"),
        (dict(size_bytes=offload.MAX_SCRATCH_BYTES + MiB), "refusing"),
    ],
)
def test_disk_read_rejects_bad_input(kwargs, message, tmp_path):
    kwargs.setdefault("directory", tmp_path)
    with pytest.raises(ValueError, match=message):
        offload.disk_read(**kwargs)
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(CUDA, reason="checks the CPU-only error")
def test_gpu_tiers_need_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        offload.host_link("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        offload.gpu_copy("cpu")


@pytest.mark.parametrize(
    "name, spec",
    [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"),
     ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", None)],
)  # fmt: skip
def test_gpu_names_map_to_spec_entries(name, spec):
    found = offload._match_spec(name)
    assert (found.name if found else None) == spec


def test_measure_tiers_on_this_machine(tmp_path):
    tiers = offload.measure_tiers(size_bytes=4 * MiB, disk_bytes=4 * MiB, directory=tmp_path, repeat=2)
    assert {"RAM copy", "local disk", "local disk, page cache"} <= set(tiers)
    assert all(t.bytes_per_s > 0 for t in tiers.values())
    if CUDA:
        assert "host → device, pinned" in tiers and "GPU memory (copy, read + write)" in tiers
    assert _leftovers(tmp_path) == []


# --- the offloaded decode loop ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", ["all", [1], [0, 2]])
def test_disk_offload_gives_the_same_tokens_and_logits(model, layers, tmp_path):
    ids = _ids(40)
    with offload.OffloadedCache(
        model.config, layers, tier="disk", directory=tmp_path, block_bytes=4096
    ) as cache:
        assert _leftovers(tmp_path)
        ref, run = offload.decode_lockstep(model, ids, 30, [None, cache])
        assert ref.tokens == run.tokens
        assert torch.equal(ref.logits, run.logits)  # bytes round-trip exactly: not close, equal
        offloaded = cache.offload_layers
        per_layer = sizing.kv_cache_bytes(model.config, 40 + 29) // 3
        assert cache.offloaded_bytes() == per_layer * len(offloaded)
        assert cache.get_seq_length() == 40 + 29
        disk_layers = [cache.layers[i] for i in offloaded]
        assert all(layer.direct for layer in disk_layers)  # O_DIRECT on this filesystem
        assert all(layer.disk_tokens % layer.block_tokens == 0 for layer in disk_layers)
        assert all(layer.block_bytes % offload.ALIGN == 0 for layer in disk_layers)
    assert _leftovers(tmp_path) == []  # close() removed the layer files


def test_generate_runs_with_an_offloaded_cache(model, tmp_path):
    ids = _ids(12)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)
    with offload.OffloadedCache(model.config, [0, 1], directory=tmp_path) as cache:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
    assert torch.equal(expected, got)
    assert _leftovers(tmp_path) == []


def test_garbage_collection_removes_the_files(model, tmp_path):
    import gc

    cache = offload.OffloadedCache(model.config, "all", directory=tmp_path)
    offload.decode(model, _ids(8), 3, cache)
    del cache
    gc.collect()
    assert _leftovers(tmp_path) == []


def test_offloaded_cache_rejects_bad_input(model, tmp_path):
    with pytest.raises(ValueError, match="unknown tier"):
        offload.OffloadedCache(model.config, "all", tier="nvram")
    with pytest.raises(ValueError, match="not a layer index"):
        offload.OffloadedCache(model.config, [3], directory=tmp_path)
    with pytest.raises(ValueError, match="'all' or layer indices"):
        offload.OffloadedCache(model.config, "some", directory=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        offload.OffloadedCache(model.config, "all", directory=tmp_path / "missing")
    if not CUDA:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            offload.OffloadedCache(model.config, "all", tier="host")
    gemma = models.tiny_config("gemma2", layers=2, window=8)
    with pytest.raises(ValueError, match="only full_attention"):
        offload.OffloadedCache(gemma, "all", directory=tmp_path)
    with pytest.raises(ValueError, match="block_bytes"):
        offload.DiskLayer(tmp_path / "x.kv", block_bytes=1000)
    assert _leftovers(tmp_path) == []


def test_sliding_layers_stay_resident_next_to_offloaded_ones(tmp_path):
    gemma = models.tiny_model("gemma2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, window=8, seed=0,
                              device="cpu")  # fmt: skip
    full = [i for i, kind in enumerate(gemma.config.layer_types) if kind == "full_attention"]
    ids = _ids(20)
    with offload.OffloadedCache(gemma.config, full, directory=tmp_path) as cache:
        ref, run = offload.decode_lockstep(gemma, ids, 12, [None, cache])
    assert ref.tokens == run.tokens


@pytest.mark.skipif(not CUDA, reason="the host tier streams over the host link: GPU only")
def test_host_offload_matches_in_memory_and_transformers_offloading():
    gpu = models.tiny_model(
        "llama", layers=3, hidden=64, heads=4, kv_heads=2, vocab=128, seed=0, device="cuda"
    )
    ids = _ids(40)
    cache = offload.OffloadedCache(gpu.config, "all", tier="host")
    theirs = DynamicCache(config=gpu.config, offloading=True)
    ref, run, hf = offload.decode_lockstep(gpu, ids, 20, [None, cache, theirs])
    assert ref.tokens == run.tokens == hf.tokens


def test_host_layer_returns_the_history_it_was_given():
    # On CPU the host tier is refused by OffloadedCache (there is no link); the layer itself still round-trips.
    layer = offload.HostLayer()
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
        offload.decode(model, _ids(4), 0)
    with pytest.raises(ValueError, match="at least one cache"):
        offload.decode_lockstep(model, _ids(4), 2, [])


# --- the cost model -----------------------------------------------------------------------------------------------


def test_offload_cost_arithmetic(model):
    # 3 layers, 2 KV heads × 16 dims, fp32: 2 × 2 × 16 × 4 = 256 bytes per token per layer.
    cost = offload.offload_cost(model.config, 100, 2, "disk", {"disk": 1e9, "ram": 4e9}, block_tokens=32,
                                disk_latency_s=1e-4)  # fmt: skip
    assert cost.bytes_per_step == 2 * 100 * 256
    assert cost.disk_bytes_per_step == 2 * 96 * 256  # whole blocks only
    assert cost.terms["disk read"] == pytest.approx(2 * 1e-4 + 2 * 96 * 256 / 1e9)
    assert cost.terms["reorder (RAM copy)"] == pytest.approx(2 * 100 * 256 / 4e9)
    assert cost.seconds == pytest.approx(sum(cost.terms.values()))
    host = offload.offload_cost(model.config, 100, 3, "host", {"h2d": 25e9}, dtype="bf16")
    assert host.terms == {"host → device": pytest.approx(3 * 100 * 128 / 25e9)}
    assert host.disk_bytes_per_step == 0
    host_lat = offload.offload_cost(
        model.config, 100, 3, "host", {"h2d": 25e9}, dtype="bf16", link_latency_s=1e-5
    )
    assert host_lat.terms["copy latency"] == pytest.approx(2 * 3 * 1e-5)  # new K/V out, the layer's K/V in
    none = offload.offload_cost(model.config, 10, 2, "disk", {"disk": 1e9, "ram": 4e9}, block_tokens=32,
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
        offload.offload_cost(model.config, **args)


def test_polled_reader_reads_what_preadv_reads(tmp_path):
    path = tmp_path / "blob"
    data = os.urandom(3 * offload.ALIGN)
    path.write_bytes(data)
    fd, direct = offload._open_direct(path, os.O_RDONLY)
    buf = offload._aligned_buffer(2 * offload.ALIGN)
    reader = offload.PolledReader()
    try:
        view = memoryview(buf)[: 2 * offload.ALIGN]
        assert reader.read(fd, view, offload.ALIGN) == 2 * offload.ALIGN
        view.release()
        assert bytes(buf[: 2 * offload.ALIGN]) == data[offload.ALIGN :]
    finally:
        reader.close()
        os.close(fd)
        buf.close()
    assert not reader.polled  # closed: later reads fall back to preadv


def test_reread_repeats_the_transfer_without_changing_the_cache(model, tmp_path):
    ids = _ids(40)
    with offload.OffloadedCache(
        model.config, [1, 2], tier="disk", directory=tmp_path, block_bytes=4096
    ) as cache:
        assert cache.reread() == (0, 0.0)  # nothing held yet
        ref, run = offload.decode_lockstep(model, ids, 6, [None, cache])
        read, streamed = cache.layers[1].bytes_read_from_disk, cache.bytes_streamed()
        nbytes, seconds = cache.reread(compute_s=1e-4)
        # the whole K/V of both layers, as `update` returns it (the partial block comes from RAM)
        assert nbytes == 2 * sizing.kv_cache_bytes(model.config, 45) // 3 and seconds > 0
        assert cache.layers[1].bytes_read_from_disk == read and cache.bytes_streamed() == streamed
        assert cache.get_seq_length() == 45
        with pytest.raises(ValueError, match="compute_s"):
            cache.reread(compute_s=-1.0)


def test_time_offload_and_fit(model, tmp_path):
    ids = _ids(200)
    with offload.OffloadedCache(
        model.config, [1, 2], tier="disk", directory=tmp_path, block_bytes=4096
    ) as cache:
        timing = offload.time_offload(model, ids, 9, cache, others=[None])
        block_tokens = cache.layers[1].block_tokens
    assert timing.offloaded.tokens == timing.memory.tokens == timing.others[0].tokens
    assert len(timing.transfer_s) == len(timing.transfer_bytes) == len(timing.offloaded.step_s) == 8
    assert all(b > 0 for b in timing.transfer_bytes) and timing.bandwidth.median_bytes_per_s > 0
    fit = offload.fit_offload(timing, model.config, 2, "disk", block_tokens=block_tokens)
    assert fit.predicted_s == pytest.approx(fit.compute_s + fit.transfer_s)
    assert fit.compute_s == timing.memory.median_step_s and fit.measured_s == timing.offloaded.median_step_s
    assert fit.low_s <= fit.predicted_s * 0.97 and fit.high_s >= fit.predicted_s * 1.03  # the 3 % floor
    assert fit.band[0] < 0 < fit.band[1] and 0 < fit.transfer_share < 1
    assert fit.holds == (fit.low_s <= fit.measured_s <= fit.high_s)
    # the transfer term is the bytes at the middle step over the loop's median bandwidth
    middle = offload.offload_cost(model.config, 200 + 8 // 2 + 1, 2, "disk",
                                  {"disk": timing.bandwidth.median_bytes_per_s}, block_tokens=block_tokens)  # fmt: skip
    assert fit.transfer_s == pytest.approx(middle.seconds)
    overlapped = dataclasses.replace(fit, overlap=True)
    assert overlapped.predicted_s == max(fit.compute_s, fit.transfer_s)
    with pytest.raises(ValueError, match="z must be positive"):
        offload.fit_offload(timing, model.config, 2, "disk", z=0)
    with pytest.raises(ValueError, match="floor"):
        offload.fit_offload(timing, model.config, 2, "disk", floor=1.5)


def test_step_clock_counts_cpu_time_only_when_one_thread_does_the_work():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert offload.step_clock(torch.device("cpu")) is time.thread_time
        torch.set_num_threads(2)
        assert offload.step_clock(torch.device("cpu")) is time.perf_counter
    finally:
        torch.set_num_threads(threads)
    assert offload.step_clock(torch.device("cuda")) is time.perf_counter


def test_median_standard_error_and_quartiles():
    assert offload._quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
    assert offload._median_se([1.0]) == 0.0
    assert offload._median_se([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(
        (math.pi / 2) ** 0.5 * 2.0 / 1.349 / 5**0.5
    )


# --- recompute vs reload ------------------------------------------------------------------------------------------


def test_recompute_vs_reload_arithmetic():
    name, gpu = "meta-llama/Llama-3.1-8B", hardware.get("H100-SXM")
    est = offload.recompute_vs_reload(name, gpu, "PCIe Gen5 x16", 8192)
    step = roofline.prefill(name, gpu, 1, 8192)
    assert est.kv_bytes == sizing.kv_cache_bytes(name, 8192)
    assert est.reload_s == pytest.approx(est.kv_bytes / 64e9)
    assert est.recompute_s == pytest.approx(step.time_s)
    assert est.flops_per_kv_byte == pytest.approx(step.flops / est.kv_bytes)
    assert est.flops_per_kv_byte == pytest.approx(offload.prefill_flops_per_kv_byte(name, 8192))
    even = offload.break_even_flops_per_byte(gpu, "PCIe Gen5 x16")
    assert even == pytest.approx(gpu.flops / 64e9)
    # compute-bound prefill: reload wins exactly when the prompt's FLOPs per KV byte exceed the break-even
    assert step.bound == "compute"
    assert (est.speedup > 1) == (est.flops_per_kv_byte > even)


def test_gqa_favours_reload_over_mha():
    gqa = offload.prefill_flops_per_kv_byte("meta-llama/Llama-3.1-8B", 4096)  # 8 KV heads of 32
    mha = offload.prefill_flops_per_kv_byte("meta-llama/Llama-2-7b-hf", 4096)  # 32 of 32
    assert gqa > 3 * mha  # 4× fewer KV bytes for about the same FLOPs


def test_links_and_bad_input():
    assert offload.link("pcie gen4 x16").bytes_per_s == 32e9
    assert all(link.source for link in offload.LINKS.values())
    with pytest.raises(ValueError, match="unknown link"):
        offload.link("carrier pigeon")
    with pytest.raises(ValueError, match="positive"):
        offload.break_even_flops_per_byte("H100-SXM", 0.0)
    assert offload.break_even_flops_per_byte("H100-SXM", 1e9) == pytest.approx(989.4e12 / 1e9)


def test_saved_kv_reloads_to_the_same_continuation(model, tmp_path):
    ids = _ids(30)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)
    saved = offload.save_kv(cache, tmp_path / "prompt.kv")
    assert saved.nbytes == sizing.kv_cache_bytes(model.config, 30)
    assert saved.file_bytes % offload.ALIGN == 0 and saved.file_bytes >= saved.nbytes
    loaded = offload.load_kv(saved, "cpu")
    for a, b in zip(cache.layers, loaded.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    with torch.inference_mode():  # decoding on from the reloaded KV is decoding on from the original
        nxt = torch.tensor([[5]])
        assert torch.equal(model(nxt, cache=cache).logits, model(nxt, cache=loaded).logits)
    with pytest.raises(ValueError, match="run a prefill"):
        offload.save_kv(DynamicCache(config=model.config), tmp_path / "empty.kv")
