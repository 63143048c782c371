import torch

from kvlab import env


def test_env_report_identifies_the_machine():
    report = env.env_report("cpu")
    assert report["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["threads"] == str(torch.get_num_threads())
    assert report["cpu"] and report["cpu"] != "unknown"
    float(report["load_average"])


def test_cpu_model_reads_the_kernel_s_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
    )
    assert env.cpu_model(info) == "AMD EPYC 9654 96-Core Processor"
    assert env.cpu_model(tmp_path / "missing")
