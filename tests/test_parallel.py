"""kvlab.experiments.parallel: real 2-rank torch.distributed runs (gloo on CPU) against kvlab.specs.sizing's predictions, the
in-process sharding against real DynamicCache tensors, and bad input failing fast with one line."""

import os

import pytest
import torch
from transformers import DynamicCache

from kvlab import measure, models
from kvlab.costs import roofline
from kvlab.experiments import parallel
from kvlab.specs import sizing


@pytest.mark.parametrize(
    "family, heads, kv_heads, tp",
    [("llama", 4, 4, 2), ("llama", 8, 2, 4), ("llama", 8, 2, 8), ("qwen2", 8, 2, 4)],  # the last three copy
)
def test_sharded_cache_and_weights_equal_prediction_in_process(family, heads, kv_heads, tp):
    """Every rank's real DynamicCache and parameters, the sharding done in one process (sum as all-reduce).

    Qwen2 adds q/k/v biases (sliced with their rows) and a sliding window (the cache keeps window - 1 tokens).
    """
    window = {"window": 8} if family == "qwen2" else {}
    config = models.tiny_config(
        family, layers=2, hidden=64, heads=heads, kv_heads=kv_heads, intermediate=128, **window
    )
    full = models.tiny_model(config=config, device="cpu", attn_implementation="sdpa")
    ids = torch.randint(2, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = full(input_ids=ids).logits
    partial_attn: list[torch.Tensor] = []
    outputs = []
    ranks = []
    for rank in range(tp):
        model = models.tiny_model(config=config, device="cpu", attn_implementation="sdpa")
        parallel.shard_tensor_parallel(model, rank, tp, lambda t: t)  # no reduction: keep the partial sums
        ranks.append(model)
        cache = DynamicCache(config=config)
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        assert measure.cache_tensor_bytes(cache) == sizing.kv_cache_bytes(config, 12, 2, "fp32", tp=tp)
        shapes = {row.shape for row in measure.cache_inventory(cache) if row.is_state}
        assert shapes == {(2, max(1, kv_heads // tp), 7 if window else 12, 64 // heads)}
        assert parallel.param_bytes(model) == sizing.weight_bytes_per_gpu(
            config, "fp32", tp=tp, vocab_parallel=False
        )
    # The partial sums of the ranks add up to the whole model's layer outputs: check one layer's attention.
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    position = torch.arange(5).expand(2, 5)
    rotary = full.model.rotary_emb(x, position)
    with torch.no_grad():
        whole = full.model.layers[0].self_attn(x, position_embeddings=rotary, attention_mask=None)[0]
        for model in ranks:
            partial_attn.append(
                model.model.layers[0].self_attn(x, position_embeddings=rotary, attention_mask=None)[0]
            )
        outputs.append(sum(partial_attn))
    assert torch.allclose(outputs[0], whole, atol=1e-5)
    assert reference.shape == (2, 12, 256)


def test_two_ranks_tensor_parallel_with_kv_head_copies():
    """TP=2 over a model with one KV head: each rank keeps a copy, so the cache on two GPUs is twice one GPU's."""
    ranks = parallel.run_distributed(tp=2, heads=4, kv_heads=1, layers=2, batch=2, prompt_len=12, steps=4)
    assert [r["rank"] for r in ranks] == [0, 1]
    config = models.tiny_config("llama", layers=2, hidden=64, heads=4, kv_heads=1, intermediate=128)
    for r in ranks:
        assert r["backend"] == "gloo" or r["device"].startswith("cuda")
        assert r["cache_bytes"] == r["predicted_cache_bytes"] == sizing.kv_cache_bytes(config, 16, 2, "fp32")
        assert r["param_bytes"] == r["predicted_param_bytes"]
        assert r["allreduce_calls"] == 2 * 2 * (4 + 1)  # two per layer per forward
        assert r["allreduce_bytes"] == r["predicted_allreduce_bytes"] == 2 * 2 * 2 * 16 * 64 * 4
        assert r["allreduce_bytes"] == roofline.allreduce_buffer_bytes(config, 2 * 16, "fp32")
        assert r["max_abs_logit_diff"] <= 1e-5 * max(1.0, r["max_abs_logit"])
        assert all(shape[1] == 1 for shape in r["cache_key_shapes"])


def test_two_ranks_pipeline_parallel():
    ranks = parallel.run_distributed(tp=1, pp=2, layers=3, batch=1, prompt_len=10, steps=3)
    config = models.tiny_config("llama", layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128)
    per_stage = sizing.kv_cache_bytes_per_stage(config, 13, 1, "fp32", pp=2)
    assert [r["cache_bytes"] for r in ranks] == per_stage
    assert sum(per_stage) == sizing.kv_cache_bytes(config, 13, 1, "fp32")
    assert [r["layers_here"] for r in ranks] == [2, 1]  # vLLM gives the extra layer to the first stage
    assert [r["param_bytes"] for r in ranks] == [r["predicted_param_bytes"] for r in ranks]
    assert ranks[0]["send_bytes"] == ranks[0]["predicted_send_bytes"] == 13 * 64 * 4
    assert ranks[1]["max_abs_logit_diff"] <= 1e-5 * max(1.0, ranks[1]["max_abs_logit"])
    assert ranks[0]["allreduce_calls"] == 0


def test_timeout_kills_every_rank():
    with pytest.raises(TimeoutError, match="did not finish"):
        parallel.run_distributed(tp=2, timeout_s=0.5)
    assert len(parallel.LAST_PIDS) == 2
    for pid in parallel.LAST_PIDS:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=3, heads=4, kv_heads=2), "does not divide the 4 query heads"),
        (dict(tp=2, world_size=3), "world size 3 does not match"),
        (dict(tp=2, pp=2), "not both"),
        (dict(tp=4, heads=8, kv_heads=8, intermediate=130), "does not divide the MLP width 130"),
        (dict(tp=2, family="gpt2"), "supports llama"),
    ],
)
def test_bad_input_fails_before_launch(kwargs, message):
    with pytest.raises(ValueError, match=message):
        parallel.run_distributed(**kwargs)


def test_worker_rejects_world_size_mismatch_in_one_line(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--rank", "0", "--world-size", "3", "--tp", "2", "--port", "1", "--out", str(out)]
    assert parallel.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world size 3 does not match tp × pp = 2 × 1 = 2" in err[0]
    assert not out.exists()


def test_kv_head_ranges_follow_vllm():
    assert [list(parallel.kv_head_range(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(parallel.kv_head_range(2, 8, r)) for r in range(8)] == [[0]] * 4 + [[1]] * 4


def test_placement_dp_tp_pp():
    name = "meta-llama/Llama-3.1-70B"
    dp = parallel.placement(name, 8192, batch=16, dp=8)
    tp = parallel.placement(name, 8192, batch=16, tp=8)
    assert dp.weight_bytes == sizing.weight_bytes(name, "bf16")
    assert dp.kv_bytes == sizing.kv_cache_bytes(name, 8192, 2, "bf16")
    assert tp.kv_bytes == sizing.kv_cache_bytes(name, 8192, 16, "bf16") // 8
    assert dp.gpus == tp.gpus == 8
    assert parallel.placement("deepseek-ai/DeepSeek-V3", 1024, tp=8).kv_copies == 8


def test_allreduce_term_and_tp_decode_step():
    name = "meta-llama/Llama-3.1-70B"
    assert roofline.allreduce_buffer_bytes(name, 4, "bf16") == 2 * 80 * 4 * 8192 * 2
    assert roofline.ring_allreduce_bytes_sent(1000, 2) == 1000
    assert roofline.ring_allreduce_bytes_sent(1000, 8) == 1750
    one = roofline.tp_decode_step(name, "H100-SXM", tp=1, batch_size=4, context_len=4096)
    assert one.comm_s == 0 and one.time_s == pytest.approx(
        roofline.decode_step_time(name, "H100-SXM", 4, 4096)
    )
    eight = roofline.tp_decode_step(name, "H100-SXM", tp=8, batch_size=4, context_len=4096)
    assert eight.kv_bytes == one.kv_bytes / 8
    assert eight.link_bytes == roofline.ring_allreduce_bytes_sent(eight.allreduce_bytes, 8)
    assert eight.comm_s == pytest.approx(
        eight.link_bytes / 450e9
    )  # NVLink 900 GB/s total = 450 GB/s each way
    assert one.time_s / 8 < eight.time_s < one.time_s  # faster, but less than 8×
    slow = roofline.tp_decode_step(
        name, "H100-SXM", tp=8, batch_size=4, context_len=4096, allreduce_latency_s=1e-5
    )
    assert slow.comm_s == pytest.approx(eight.comm_s + 160 * 1e-5)


def test_memory_budget_per_gpu():
    from kvlab.costs import budget

    name = "meta-llama/Llama-3.1-70B"
    assert budget.memory_budget(name, "H100-SXM", tp=1) == budget.memory_budget(name, "H100-SXM")
    assert not budget.memory_budget(name, "H100-SXM").fits
    plan = budget.memory_budget(name, "H100-SXM", tp=4)
    assert plan.fits and plan.weight_bytes == sizing.weight_bytes_per_gpu(name, "bf16", tp=4)
    assert plan.kv_bytes_per_token == sizing.kv_bytes_per_token(name, "bf16", tp=4)
