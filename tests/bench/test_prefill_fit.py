"""The real-engine study's fit of the prefill step from bursts of first tokens."""

import pytest

from bench.real_engine.timing import EngineTiming, prefill_steps


def test_the_prefill_step_is_the_line_through_two_bursts_last_first_tokens():
    # A burst of k short prompts at idle has its last first token at 4 + 3 k ms: 7 ms alone, 28 ms for eight.
    base, per_seq = prefill_steps({1: 7.0, 8: 28.0})
    assert base == pytest.approx(4.0) and per_seq == pytest.approx(3.0)
    args = EngineTiming(0.0, 2.7, 0.12, base, per_seq).sim_args()
    assert args[args.index("--prefill-base-ms") + 1] == "4.000"
    assert args[args.index("--prefill-ms-per-seq") + 1] == "3.000"


def test_the_fit_never_goes_negative_and_needs_two_sizes():
    assert prefill_steps({1: 10.0, 8: 9.0}) == (10.0, 0.0)  # a faster burst is noise: no per-request cost
    assert prefill_steps({2: 4.0, 4: 20.0}) == (0.0, 8.0)  # a base below zero is clamped
    with pytest.raises(ValueError, match="two burst sizes"):
        prefill_steps({4: 1.0})
