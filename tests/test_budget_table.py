"""kvlab.book.report.budget_table: chapter 5's budget table is the budget's own terms, for each vLLM rule."""

from kvlab.book.report import budget_table
from kvlab.costs.budget import memory_budget
from kvlab.units import format_bytes

LLAMA = "meta-llama/Llama-3.1-8B"


def test_each_rule_shows_its_own_terms_and_the_pool():
    for version, own, absent in (
        ("0.34.0", "− margin", "− engine cap"),
        ("0.33.0", "− engine cap", "− margin"),
    ):
        plan = memory_budget(LLAMA, "H100-SXM", vllm_version=version)
        table = budget_table(plan)
        rows = {row[0]: row[1] for row in table.rows}
        assert own in rows and absent not in rows, version
        assert rows["capacity"] == format_bytes(plan.capacity_bytes)
        assert rows["− weights"] == format_bytes(plan.weight_bytes)
        assert rows["= KV pool (expected)"] == format_bytes(plan.kv_pool_bytes)
        assert rows["KV pool floor"] == format_bytes(plan.kv_pool_floor_bytes)
        # every nonzero term of the rule is a row, in the rule's order
        names = [name for name, value, _ in plan.stack() if value]
        assert [row[0][2:] for row in table.rows[1 : 1 + len(names)]] == names


def test_a_budget_without_a_pool_says_so():
    table = budget_table(memory_budget("meta-llama/Llama-3.1-70B", "H100-SXM"))
    assert table.rows[-1] == ("= KV pool", "none", "the terms above exceed the capacity")
