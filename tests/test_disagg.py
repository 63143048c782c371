"""kvlab.disagg: a prompt's K/V moved from a prefill engine to a decode engine gives one engine's greedy tokens,
and the bytes moved per request are `kvlab.specs.sizing`'s for the prompt, in one process and across two."""

import dataclasses
import functools
import statistics

import pytest
import torch

from kvlab.disagg import connector, pd
from kvlab.engine import EngineConfig, LLMEngine, SamplingParams
from kvlab.engine.request import Request
from kvlab.models import tiny_model
from kvlab.specs import sizing

KNOBS = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
LENGTHS = (5, 17, 33, 64, 9, 120)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", **KNOBS)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]
    # the 64-token prompt again, extended: the decode engine's prefix cache serves its first blocks
    return [*prompts, prompts[3] + [7, 8, 9]]


@pytest.fixture(scope="module")
def reference(llama, prompts):
    engine = LLMEngine(llama, block_size=4, num_blocks=400, max_num_batched_tokens=64)
    return [out.token_ids for out in engine.generate(prompts, PARAMS)]


def engines(llama, decode_blocks=400):
    # chunked prefill on the prefill side; prefix caching on the decode side
    prefill = LLMEngine(llama, block_size=4, num_blocks=80, max_num_batched_tokens=16)
    decode = LLMEngine(llama, block_size=4, num_blocks=decode_blocks, enable_prefix_caching=True)
    return prefill, decode


def test_split_equals_one_engine(llama, prompts, reference):
    prefill, decode = engines(llama)
    items = connector.prefill_all(prefill, prompts, PARAMS)
    assert [item.kv_bytes for item in items] == [
        sizing.kv_cache_bytes(llama.config, len(p), 1, "fp32") for p in prompts
    ]
    assert connector.decode_all(decode, items, PARAMS) == reference
    # The repeated prompt's 16 whole blocks came from the decode engine's cache, the rest from the transfer.
    assert decode.block_manager.prefix_cache_stats.hits == 64


def test_the_loaded_kv_is_what_decode_reads(llama, prompts, reference):
    """Zeroed K/V in place of the prefill's changes the tokens: the decode engine attends to what it loaded."""
    prefill, decode = engines(llama)
    items = connector.prefill_all(prefill, prompts[:4], PARAMS)
    for item in items:
        assert item.kv is not None
        item.kv = torch.zeros_like(item.kv)
    assert connector.decode_all(decode, items, PARAMS) != reference[:4]


def test_preempted_decode_recomputes(llama, prompts, reference):
    """A decode pool too small for every request at once preempts; the victim recomputes and still agrees."""
    prefill, decode = engines(llama, decode_blocks=40)
    items = connector.prefill_all(prefill, prompts, PARAMS)
    assert connector.decode_all(decode, items, PARAMS) == reference
    assert decode.scheduler.num_preemptions > 0


def test_one_token_requests_finish_at_prefill(llama, prompts, reference):
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    prefill, decode = engines(llama)
    items = connector.prefill_all(prefill, prompts, params)
    assert all(item.finish_reason == "length" and item.kv is None for item in items)
    assert connector.decode_all(decode, items, params) == [r[:1] for r in reference]


def test_bad_input(llama, prompts):
    prefill, _ = engines(llama)
    with pytest.raises(ValueError, match="greedy"):
        connector.prefill_all(prefill, prompts, SamplingParams(temperature=0.7))
    kv = torch.zeros(2, 2, 5, 2, 16)
    contiguous = LLMEngine(llama, block_size=4, num_blocks=400, kv_layout="contiguous")
    contiguous.enqueue(Request.prefilled(prompts[0], 3, kv, PARAMS))
    with pytest.raises(ValueError, match="contiguous baseline"):
        contiguous.step()
    decode = LLMEngine(llama, block_size=4, num_blocks=400)
    decode.enqueue(Request.prefilled(prompts[0], 3, kv.half(), PARAMS))
    with pytest.raises(ValueError, match="does not fit this pool"):
        decode.step()
    gemma = tiny_model("gemma3_text", layers=6, hidden=64, heads=4, kv_heads=2, vocab=256, window=8)
    hybrid = LLMEngine(gemma, block_size=4, num_blocks=400)
    hybrid.enqueue(Request.prefilled(prompts[0], 3, torch.zeros(6, 2, 5, 2, 16), PARAMS))
    with pytest.raises(ValueError, match="one KV-cache group"):
        hybrid.step()


def test_link_fit():
    # the median of each size: one slow sample of three does not move the fit
    samples = [(1000, 1e-5 + 1e-6), (1000, 5e-5), (1000, 1e-5 + 1e-6), (9000, 1e-5 + 9e-6)]
    fit = pd.LinkFit.fit(samples)
    assert fit.bytes_per_s == pytest.approx(1e9) and fit.latency_s == pytest.approx(1e-5)
    assert fit.predict(4000) == pytest.approx(1.4e-5)
    with pytest.raises(ValueError, match="two sizes"):
        pd.LinkFit.fit([(1000, 1e-5), (1000, 2e-5)])
    with pytest.raises(ValueError, match="does not grow"):
        pd.LinkFit.fit([(1000, 2e-5), (9000, 1e-5)])


@pytest.mark.slow
@pytest.mark.timed
@pytest.mark.parametrize("overlap", [True, False])
def test_two_processes(llama, prompts, reference, overlap):
    """The prefill and decode engines as two processes over gloo (or NCCL between two GPUs), with the transfers
    overlapping the engines' steps or after every prefill, one at a time."""
    factory = functools.partial(tiny_model, "llama", **KNOBS)
    result = pd.run_disaggregated(
        factory,
        prompts,
        dataclasses.replace(PARAMS, logprobs=2),
        EngineConfig(block_size=4, num_blocks=80, max_num_batched_tokens=16),
        EngineConfig(block_size=4, num_blocks=400, enable_prefix_caching=True),
        overlap=overlap,
    )
    assert result.token_ids == reference
    # every token's two best ids, the first token's from the prefill process, each led by the greedy token
    for tokens, top in zip(result.token_ids, result.top_token_ids, strict=True):
        assert top is not None and [t[0] for t in top] == tokens and all(len(t) == 2 for t in top)
    assert result.kv_bytes == [sizing.kv_cache_bytes(llama.config, len(p), 1, "fp32") for p in prompts]
    assert result.backend == pd.placement()[0]
    assert result.link.bytes_per_s > 0
    for trace in result.traces:
        assert trace.arrival <= trace.first_token <= trace.sent < trace.received <= trace.finished
        # The first transfer is timed inside [sent, received]. With the transfers overlapping the engines'
        # steps, a step may hold either side's thread past its stamp (4.7 ms on a 2-core CI machine), so only the
        # acknowledged transfers, with both sides waiting on the link, span the whole interval.
        first = trace.transfer_samples[0]
        assert first <= trace.received - trace.sent + 1e-4
        if overlap:
            assert trace.transfer_samples == [trace.transfer_s]
        else:
            assert first == pytest.approx(trace.received - trace.sent, abs=1e-3)
            # one time per round; the trace's is their median, as the probe's fit takes each size's
            assert len(trace.transfer_samples) == 5
            assert trace.transfer_s == pytest.approx(statistics.median(trace.transfer_samples))
    if not overlap:
        # the probe's payloads went in the same five rounds: five samples of each size
        assert sorted(size for size, _ in result.link.samples) == sorted(5 * list(pd.DEFAULT_PROBE_SIZES))


def test_run_disaggregated_bad_input():
    factory = functools.partial(tiny_model, "llama", **KNOBS)
    with pytest.raises(ValueError, match="no prompts"):
        pd.run_disaggregated(factory, [], PARAMS)
    with pytest.raises(ValueError, match="greedy"):
        pd.run_disaggregated(factory, [[1, 2]], SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="probe_sizes"):
        pd.run_disaggregated(factory, [[1, 2]], PARAMS, probe_sizes=(100, 100))


def test_transfer_checks():
    """The lab's claim on a result built by hand: requests 1.2× their prediction hold [0.67, 1.5], 3× miss both
    ratios; a link with its bandwidth doubled misses the seconds per byte even where the latency hides it from
    the median, a link 2× slow misses both, a latency too long the median alone."""
    fit = pd.LinkFit(1e-4, 1e9, ((1 << 20, 1e-4 + (1 << 20) / 1e9), (1 << 24, 1e-4 + (1 << 24) / 1e9)))

    def result(factor, link=fit):
        traces = [
            pd.RequestTrace(f"req-{i}", 8, n, [1], 0, 0) for i, n in enumerate((1 << 20, 1 << 22, 1 << 23))
        ]
        for t in traces:
            t.transfer_s = factor * link.predict(t.kv_bytes)
        return pd.DisaggResult([[1]] * 3, traces, "gloo", ("cpu", "cpu"), link)

    band = [0.67, 1.5]
    assert all(c.holds for c in result(1.2).transfer_checks(band))
    assert [c.holds for c in result(3.0).transfer_checks(band)] == [False, False]
    # a 20 ms latency (a busy machine's wake-ups) dwarfs the bytes' 1-8 ms: doubling the bandwidth moves the
    # median ratio less than the band allows, and the seconds per byte by exactly 2
    slow = pd.LinkFit(2e-2, 1e9, fit.samples)
    doubled = dataclasses.replace(slow, bytes_per_s=2e9)
    level, growth = result(1.0, slow).transfer_checks(band, doubled)
    assert level.holds and not growth.holds and "2 in" in growth.detail
    twice = pd.LinkFit(2 * fit.latency_s, fit.bytes_per_s / 2, fit.samples)
    assert [c.holds for c in result(1.0).transfer_checks(band, twice)] == [False, False]
    # a latency 5 ms too long leaves the seconds per byte right and the median wrong
    late = dataclasses.replace(fit, latency_s=fit.latency_s + 5e-3)
    assert [c.holds for c in result(1.0).transfer_checks(band, late)] == [False, True]
    assert min(result(1.0).transfer_ratios(dataclasses.replace(fit, bytes_per_s=4e9))) > 2.0
    lone = pd.DisaggResult([[1]], result(1.0).traces[:1], "gloo", ("cpu", "cpu"), fit)
    with pytest.raises(ValueError, match="two sizes"):
        lone.transfer_checks(band)
