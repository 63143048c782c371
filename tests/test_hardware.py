"""The spec table in the right units, and measured ceilings that make sense on this machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvlab.specs import hardware


@pytest.mark.parametrize("name", hardware.registry())
def test_spec_units_are_plausible(name):
    hw = hardware.get(name)
    # The driver reports more than the datasheet's decimal GB, but never more than the same number of GiB.
    assert hw.datasheet_memory_bytes <= hw.memory_bytes <= hw.datasheet_memory_bytes / 10**9 * 2**30
    assert hw.memory_source and hw.flops_dtype in ("bf16", "fp16")
    assert 1e11 <= hw.bandwidth_bytes_per_s <= 1e13, "bandwidth in bytes/s"
    assert 1e13 <= hw.flops <= 1e16, "dense FLOP/s"
    assert hw.host_link_bytes_per_s < hw.bandwidth_bytes_per_s, "PCIe is slower than device memory"
    if hw.interconnect_bytes_per_s is not None:
        assert hw.host_link_bytes_per_s < hw.interconnect_bytes_per_s <= hw.bandwidth_bytes_per_s
    # Ridge points sit between ~100 and ~500 FLOP/byte, except on parts whose compute was cut (H20, for export)
    # or whose bf16 rate is halved (GeForce, FP32 accumulate): tens of FLOP/byte there.
    assert 30 <= hw.ridge_flops_per_byte <= 500
    if hw.fp8_flops is not None:
        # the dense fp8 rate is twice the dense bf16/fp16 one on every part that has it (the L40S datasheet
        # rounds its two figures differently: 733 against 2 x 362.05)
        assert hw.fp8_flops == pytest.approx(2 * hw.flops, rel=0.02)
    # every figure is cited: a datasheet URL, or a press report said to be one
    assert "https://" in hw.source or "PRESS REPORT" in hw.source
    # the driver's total: nvidia-smi, or rocm-smi on AMD's parts
    assert hw.memory_source.startswith((hardware._SMI, "rocm-smi"))


# The parts readers deploy (issue 21, item 8), each figure as its source states it: driver MiB, datasheet GB,
# bandwidth TB/s, dense bf16 and fp8 TFLOP/s, NVLink GB/s (None: no NVLink on the card alone).
@pytest.mark.parametrize(
    "name, mib, gb, tb_s, tflops, fp8, nvlink",
    [("H800", 81559, 80, 3.35, 989.4, 1978.9, 400), ("A800-80GB", 81920, 80, 2.039, 312, None, 400),
     ("H20", 97871, 96, 4.0, 148, 296, 900), ("L20", 46068, 48, 0.864, 119.5, 239, None),
     ("L40S", 46068, 48, 0.864, 362.05, 733, None), ("RTX-4090", 24564, 24, 1.008, 165.2, 330.3, None),
     ("RTX-3090", 24576, 24, 0.936, 71, None, None), ("MI300X", 196288, 192, 5.3, 1307.4, 2614.9, 896)],
)  # fmt: skip
def test_deployed_gpus(name, mib, gb, tb_s, tflops, fp8, nvlink):
    hw = hardware.get(name)
    assert (hw.memory_bytes, hw.datasheet_memory_bytes) == (mib * 2**20, gb * 10**9)
    assert hw.bandwidth_bytes_per_s == pytest.approx(tb_s * 1e12)
    assert hw.flops == pytest.approx(tflops * 1e12) and hw.flops_dtype == "bf16"
    assert hw.fp8_flops == (None if fp8 is None else pytest.approx(fp8 * 1e12))
    assert hw.interconnect_bytes_per_s == (None if nvlink is None else nvlink * 1e9)


def test_the_h20_trades_compute_for_bandwidth():
    # More bandwidth than an H100 SXM, about 15 % of its compute: a ridge an eighth as high.
    h20, h100 = hardware.get("H20"), hardware.get("H100-SXM")
    assert h20.bandwidth_bytes_per_s > h100.bandwidth_bytes_per_s
    assert h20.flops / h100.flops == pytest.approx(0.15, abs=0.01)
    assert h20.ridge_flops_per_byte == pytest.approx(37, abs=0.5)
    assert h100.ridge_flops_per_byte / h20.ridge_flops_per_byte == pytest.approx(8.0, abs=0.1)
    # the vendor publishes no H20 datasheet, and the entry says so
    assert "PRESS REPORT" in h20.source and "PRESS REPORT" in hardware.get("L20").source


def test_spec_table_known_values():
    h100 = hardware.get("h100-sxm")  # case-insensitive
    assert (h100.bandwidth_bytes_per_s, h100.flops) == (3.35e12, 989.4e12)
    # nvidia-smi totals: 81,559 MiB (H100 80GB), 81,920 MiB (A100 80GB), 143,771 MiB (H200).
    assert h100.memory_bytes == 81559 * 2**20 and h100.datasheet_memory_bytes == 80 * 10**9
    assert hardware.get("A100-80GB").memory_bytes == 80 * 2**30
    assert hardware.get("H200").memory_bytes == 143771 * 2**20
    assert hardware.get("T4").flops_dtype == "fp16"
    assert h100.ridge_flops_per_byte == pytest.approx(295, rel=0.01)
    with pytest.raises(hardware.UnknownAcceleratorError, match="H100-SXM") as err:
        hardware.get("Z100")
    assert str(err.value).startswith("unknown accelerator 'Z100'")  # no KeyError quoting


@pytest.mark.parametrize(
    "name, spec",
    [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"),
     ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "RTX-4090"),
     ("NVIDIA GeForce RTX 3090", "RTX-3090"), ("NVIDIA GeForce RTX 5090", None), ("NVIDIA RTX A6000", None),
     ("NVIDIA H20", "H20"), ("NVIDIA H800", "H800"), ("NVIDIA A800-SXM4-80GB", "A800-80GB"),
     ("NVIDIA L20", "L20"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4")],
)  # fmt: skip
def test_gpu_names_map_to_spec_entries(name, spec):
    found = hardware.spec_for(name)
    assert (found.name if found else None) == spec


def test_pcie_rates_are_the_spec_tables():
    assert hardware.get("H100-SXM").host_link_bytes_per_s == hardware.PCIE_X16_BYTES_PER_S[5] == 64e9
    assert hardware.get("A100-80GB").host_link_bytes_per_s == hardware.PCIE_X16_BYTES_PER_S[4] == 32e9


def test_measure_on_cpu_is_sane():
    m = hardware.measure("cpu", size_bytes=32 * 2**20, matmul_size=256, repeat=3)
    assert m.flops_dtype == "float32" and m.matmul_size == 256 and m.copy_bytes == 32 * 2**20
    assert 1e8 < m.bandwidth_bytes_per_s < 1e13
    assert 1e8 < m.flops < 1e15
    assert isinstance(m, hardware.Ceilings)  # stands in for a spec entry
    assert m.ridge_flops_per_byte == pytest.approx(m.flops / m.bandwidth_bytes_per_s)
    assert m.memory_bytes > 2**30 and m.host_link_bytes_per_s is None
    assert "CPU" in m.name


def test_probes_keep_every_timing_and_report_the_fastest():
    probe = hardware.CopyProbe("cpu", 2**20)
    with pytest.raises(ValueError, match="not been timed"):
        _ = probe.bandwidth_bytes_per_s
    probe.time(repeat=2)
    probe.time()
    assert len(probe.seconds) == 3 and probe.bandwidth_bytes_per_s == 2 * 2**20 / min(probe.seconds)
    m = hardware.measure("cpu", matmul_size=64, repeat=2, probe=probe)
    assert len(probe.seconds) == 5 and m.copy_bytes == 2**20
    assert m.bandwidth_bytes_per_s == probe.bandwidth_bytes_per_s
    mm = hardware.MatmulProbe("cpu", 64, torch.float32)
    mm.time(repeat=2)
    assert mm.flops == 2 * 64**3 / min(mm.seconds)
    with pytest.raises(ValueError):
        hardware.CopyProbe("cpu", 1000)
    with pytest.raises(ValueError):
        hardware.MatmulProbe("cpu", 0, torch.float32)
    with pytest.raises(ValueError, match="not been timed"):
        _ = hardware.MatmulProbe("cpu", 8, torch.float32).flops


def test_linear_weights_take_the_longest_prefix_of_shapes_within_the_bytes():
    shapes = [(64, 32), (32, 64), (128, 32)]
    weights = hardware.linear_weights(shapes, 2 * 64 * 32 * 4, torch.float32, "cpu")
    assert [tuple(w.shape) for w in weights] == shapes[:2]
    # the first shape always, even past the bytes
    assert [tuple(w.shape) for w in hardware.linear_weights(shapes, 4, torch.float32, "cpu")] == shapes[:1]
    assert hardware.linear_weights(shapes, 2**20, torch.bfloat16, "cpu")[2].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="at least one shape"):
        hardware.linear_weights([], 2**20, torch.float32, "cpu")


def test_a_linear_probe_runs_every_weight_at_its_rows_and_reports_the_read_rate():
    weights = hardware.linear_weights([(64, 32), (32, 64)], 2**20, torch.float32, "cpu")
    probe = hardware.LinearProbe(weights, rows=4)
    outputs = probe.run()
    assert [tuple(o.shape) for o in outputs] == [(4, 64), (4, 32)]
    torch.testing.assert_close(outputs[0], torch.full((4, 64), 0.5 * 0.01 * 32))
    with pytest.raises(ValueError, match="not been timed"):
        _ = probe.read_bytes_per_s
    probe.time(repeat=3)
    assert probe.nbytes == 2 * 64 * 32 * 4
    assert probe.read_bytes_per_s == probe.nbytes / min(probe.seconds)
    with pytest.raises(ValueError, match="at least one weight"):
        hardware.LinearProbe([])
    with pytest.raises(ValueError, match="rows"):
        hardware.LinearProbe(weights, rows=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_the_host_link_probe_needs_a_gpu():
    with pytest.raises(ValueError, match="CUDA"):
        hardware.HostLinkProbe("cpu", 2**20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host link exists on a GPU machine only")
def test_the_host_link_probe_times_both_directions():
    for pinned in (True, False):
        for to_device in (True, False):
            probe = hardware.HostLinkProbe("cuda", 2**20, pinned=pinned, to_device=to_device)
            probe.time(repeat=2, warmup=1)
            assert len(probe.seconds) == 2 and probe.bandwidth_bytes_per_s == 2**20 / min(probe.seconds)
            latencies = probe.latency(4)
            assert len(latencies) == 4 and all(t > 0 for t in latencies)


def test_measure_other_dtype():
    m = hardware.measure("cpu", size_bytes=2**20, matmul_size=128, dtype=torch.bfloat16, repeat=1)
    assert m.flops_dtype == "bfloat16" and m.flops > 0


@pytest.mark.parametrize(
    "kwargs", [dict(size_bytes=1000), dict(size_bytes=-(2**20)), dict(matmul_size=0), dict(repeat=0)]
)
def test_measure_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        hardware.measure("cpu", **kwargs)


def test_the_spec_table_imports_without_torch():
    # the CLI reads the spec table alone; the probes import torch when built
    code = "import sys, kvlab.specs.hardware; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compute_dtype():
    from kvlab.env import compute_dtype

    assert compute_dtype("cpu") == torch.float32
    if torch.cuda.is_available():  # pragma: no cover - GPU machines
        major, _ = torch.cuda.get_device_capability()
        assert compute_dtype("cuda") == (torch.bfloat16 if major >= 8 else torch.float16)


def test_spec_for_a_form_factor_the_table_lacks_is_no_spec_not_another_part():
    from kvlab.specs.hardware import spec_for

    # The table holds the H800 SXM5 part only, and no H100 NVL (94 GB): neither may borrow a listed part's spec.
    assert spec_for("NVIDIA H800 PCIe") is None
    assert spec_for("NVIDIA H100 NVL") is None
    assert spec_for("NVIDIA H800").name == "H800"
    assert spec_for("NVIDIA H100 PCIe").name == "H100-PCIe"
