"""Image tokens (kvlab.specs.images) against transformers' own processor and decoder, and vLLM 0.33.0's budget."""

import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen3VLTextConfig, Qwen3VLTextModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from kvlab.costs import budget
from kvlab.measure import cache_tensor_bytes
from kvlab.specs import images, sizing
from kvlab.specs.arch import UnsupportedConfigError

QWEN3_VL = "Qwen/Qwen3-VL-8B-Instruct"
SIZES = [(1280, 720), (640, 480), (100, 100), (4000, 3000), (8192, 8192), (3000, 40), (33, 1999)]


@pytest.fixture(scope="module")
def rule():
    return images.image_rule(QWEN3_VL)


def test_the_registry_gives_qwen3_vl_its_processor_limits(rule):
    assert (rule.kind, rule.patch_size, rule.merge_size) == ("dynamic", 16, 2)
    assert (rule.min_pixels, rule.max_pixels) == (256**2, 4096**2)
    # DeepStack hands 3 intermediate feature levels beside the last: 4 × the decoder's 4096.
    assert rule.embed_elements == 4 * 4096


@pytest.mark.parametrize("size", SIZES)
def test_tokens_equal_the_processors_grid(rule, size):
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": rule.min_pixels, "longest_edge": rule.max_pixels},
        patch_size=rule.patch_size,
        merge_size=rule.merge_size,
    )
    grid = processor(images=Image.new("RGB", size), return_tensors="pt")["image_grid_thw"][0]
    assert rule.tokens(*size) == int(grid.prod()) // rule.merge_size**2


def test_the_largest_image_reaches_the_maximum_and_no_image_passes_it(rule):
    side = rule.factor * int(rule.max_pixels**0.5 // rule.factor)
    assert rule.tokens(side, side) == rule.max_tokens() == 16384
    assert all(rule.tokens(*size) <= rule.max_tokens() for size in SIZES)


def test_qwen2_5_vl_reserves_16384_tokens_an_image():
    # vllm-project/vllm#20123: Qwen2.5-VL's profiling reserves 16,384 tokens per image; its processor allows
    # max_pixels = 16384 × 28² (transformers' Qwen2.5-VL vision config: patch 14, merge 2).
    rule = images.image_rule(Qwen2_5_VLConfig(), min_pixels=56 * 56, max_pixels=16384 * 28 * 28)
    assert rule.factor == 28
    assert rule.max_tokens() == 16384


def test_gemma_3_images_are_a_fixed_256_tokens():
    rule = images.image_rule("google/gemma-3-27b-it")
    assert rule.kind == "fixed"
    assert {rule.tokens(w, h) for w, h in SIZES} == {256}
    assert rule.prompt_tokens(896, 896) == 258


def test_the_decoders_cache_holds_image_tokens_like_text():
    # Qwen3-VL's own decoder class, tiny: its cache after a forward equals kvlab's sizing of its config.
    config = Qwen3VLTextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    model = Qwen3VLTextModel(config).eval()
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    assert cache_tensor_bytes(cache) == sizing.kv_cache_bytes(config, 37, 2, torch.float32)


def test_the_encoder_cache_follows_vllm_0_33s_budget():
    per_token = sizing.kv_bytes_per_token(QWEN3_VL, "bfloat16")
    cost = images.image_cost(
        QWEN3_VL, 4, 1280, 720, kv_bytes_per_token=per_token, max_num_batched_tokens=8192
    )
    assert cost.tokens_per_image == 880 + 2
    assert cost.kv_bytes == 4 * 882 * 147_456
    # compute_mm_encoder_budget: max(max_num_batched_tokens, the largest image's tokens).
    assert cost.encoder_cache_tokens == 16384
    assert cost.encoder_cache_bytes == 16384 * 16384 * 2
    assert cost.profiled_images == 1
    wide = images.image_cost(QWEN3_VL, 1, 64, 64, kv_bytes_per_token=per_token, max_num_batched_tokens=40000)
    assert (wide.encoder_cache_tokens, wide.profiled_images) == (40000, 2)


def test_mm_processor_kwargs_lower_the_reservation():
    rule = images.image_rule(QWEN3_VL, max_pixels=1024 * 32 * 32)
    assert rule.max_tokens() == 1024
    assert rule.tokens(4000, 3000) <= 1024


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: images.image_rule("meta-llama/Llama-3.1-8B"),
            "cannot count image tokens for model_type 'llama'",
        ),
        (lambda: images.image_rule(Qwen2_5_VLConfig()), "pass both"),
        (lambda: images.image_rule(QWEN3_VL, min_pixels=10**8), "exceeds max_pixels"),
        (lambda: images.image_rule(QWEN3_VL).tokens(0, 10), "width"),
        (lambda: images.image_rule(QWEN3_VL).tokens(10_000, 20), "aspect ratio"),
        (lambda: images.parse_image_size("1280*720"), "WIDTHxHEIGHT"),
        (lambda: images.parse_image_size("0x720"), "WIDTHxHEIGHT"),
    ],
)
def test_bad_input_gets_one_line_naming_the_problem(call, message):
    with pytest.raises((ValueError, UnsupportedConfigError), match=message):
        call()


def test_a_size_parses():
    assert images.parse_image_size("1280x720") == (1280, 720)
    assert images.parse_image_size("64X48") == (64, 48)


def test_kvlab_size_adds_the_images_and_charges_the_encoder_cache():
    from kvlab import cli

    request = cli.ImageRequest(4, 1280, 720)
    text = cli.size_report(QWEN3_VL, 4096, 1, gpu="H100-SXM", images=request)
    assert "4 × 1280x720: 882 tokens each (880 image + 2 boundary" in text
    assert "+ 3,528 image tokens beside 4k of text" in text
    assert "at 7624 tokens" in text
    # vLLM reserves 16,384 tokens × 16,384 × 2 B = 512 MiB of encoder cache from the model and the token budget
    # alone, so the same context as text holds the same pool; a text-only server (--limit-images 0) has more.
    assert "- encoder cache           512 MiB" in text
    plain = cli.size_report(QWEN3_VL, 4096 + 3528, 1, gpu="H100-SXM")
    text_only = cli.size_report(
        QWEN3_VL, 4096 + 3528, 1, gpu="H100-SXM", settings=budget.BudgetSettings(limit_images=0)
    )
    assert _pool(text) == _pool(plain) < _pool(text_only)
    assert "encoder cache" not in text_only


def _pool(report: str) -> int:
    (line,) = [line for line in report.splitlines() if "= KV pool" in line]
    return int(line.rsplit("= ", 1)[1].split()[0].replace(",", ""))


def test_the_budget_charges_the_encoder_cache_without_images():
    # vLLM 0.33's estimate rule subtracts the encoder cache once
    charged = budget.memory_budget(QWEN3_VL, "H100-SXM", vllm_version="0.33.0")
    text_only = budget.memory_budget(QWEN3_VL, "H100-SXM", limit_images=0, vllm_version="0.33.0")
    assert charged.encoder_cache_bytes == 16_384 * 4 * 4096 * 2
    assert text_only.encoder_cache_bytes == 0
    assert text_only.kv_headroom_bytes - charged.kv_headroom_bytes == charged.encoder_cache_bytes
    # 0.34 keeps it free inside the transient peak, and the margin grows by 0.75 of it as well
    measured = budget.memory_budget(QWEN3_VL, "H100-SXM")
    free = budget.memory_budget(QWEN3_VL, "H100-SXM", limit_images=0)
    assert measured.transient_bytes - free.transient_bytes == measured.encoder_cache_bytes
    assert free.kv_headroom_bytes - measured.kv_headroom_bytes == measured.encoder_cache_bytes + (
        measured.margin_bytes - free.margin_bytes
    )
    # A text model has no encoder cache, whatever the limit.
    llama = budget.memory_budget("meta-llama/Llama-3.1-8B", "H100-SXM")
    assert (llama.encoder_cache_bytes, llama.encoder_cache_missing) == (0, "")


def test_an_image_model_without_a_rule_says_its_pool_is_not_a_bound():
    from transformers import LlavaConfig

    config = LlavaConfig()
    plan = budget.memory_budget(config, "H100-SXM")
    assert plan.encoder_cache_bytes == 0
    assert "llava" in plan.encoder_cache_missing
    (line,) = [line for line in plan.lines(4096) if "not counted" in line]
    assert "not a lower bound" in line
    assert budget.memory_budget(config, "H100-SXM", limit_images=0).encoder_cache_missing == ""


def test_more_images_than_the_limit_is_a_one_line_error(capsys):
    from kvlab import cli

    assert cli.main(["size", QWEN3_VL, "--images", "3", "--limit-images", "2", "--gpu", "H100-SXM"]) == 2
    assert "--images 3 is more than --limit-images 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["size", QWEN3_VL, "--limit-images", "-1"])
    assert "--limit-images: expected an integer >= 0, got '-1'" in capsys.readouterr().err


def test_kvlab_size_images_on_a_text_model_is_a_one_line_error(capsys):
    from kvlab import cli

    assert cli.main(["size", "meta-llama/Llama-3.1-8B", "--images", "1"]) == 2
    assert "cannot count image tokens for model_type 'llama'" in capsys.readouterr().err
    assert cli.main(["size", QWEN3_VL, "--max-pixels", "1000"]) == 2
    assert "give --images" in capsys.readouterr().err
    assert cli.main(["size", QWEN3_VL, "--images", "2", "--image-size", "big"]) == 2
    assert "WIDTHxHEIGHT" in capsys.readouterr().err
