"""Small pieces on their own: the timing formula, the tokenizer, output lengths, the engine loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from model_sim.config import EngineConfig
from model_sim.engine import EngineCore, RequestRejected
from model_sim.generation import OutputLengthMode, OutputLengthSampler, output_text
from model_sim.request import RequestStatus
from model_sim.timing import TimingModel
from holdback.sim_tokenizer import Tokenizer


def test_step_time_formula_and_defaults():
    t = TimingModel()
    assert t.predict(0, 1) == pytest.approx((2.0 + 8.0 + 0.08) / 1000)
    assert t.predict(0, 256) == pytest.approx((2.0 + 8.0 + 0.08 * 256) / 1000)
    assert t.predict(1000, 0) == pytest.approx((2.0 + 100.0) / 1000)
    assert t.predict(500, 10) == pytest.approx((2.0 + 50.0 + 8.0 + 0.8) / 1000)
    assert TimingModel.zero().predict(4000, 256) == 0.0
    jittered = TimingModel(jitter=0.1)
    a = [jittered.step_time(0, 8, random.Random(3)) for _ in range(3)]
    b = [jittered.step_time(0, 8, random.Random(3)) for _ in range(3)]
    assert a == b and 0 <= a[0] <= 2 * jittered.predict(0, 8)
    with pytest.raises(ValueError, match="decode_base_ms must not be negative"):
        TimingModel(decode_base_ms=-1).validate()


def test_a_step_that_computes_prompts_pays_the_prefill_base_and_per_request_cost():
    t = TimingModel(step_overhead_ms=0, prefill_ms_per_token=0.01, decode_base_ms=3, decode_ms_per_seq=0.1,
                    prefill_base_ms=8, prefill_ms_per_seq=1)
    assert t.predict(0, 4) == pytest.approx((3 + 0.4) / 1000)  # decode only: no prefill base
    assert t.predict(100, 0, prefill_seqs=1) == pytest.approx((8 + 1 + 1) / 1000)
    assert t.predict(100, 4, prefill_seqs=3) == pytest.approx((8 + 3 + 1 + 3 + 0.4) / 1000)
    assert not t.is_zero and not TimingModel(0, 0, 0, 0, 0, prefill_ms_per_seq=1).is_zero
    with pytest.raises(ValueError, match="prefill_base_ms must not be negative"):
        TimingModel(prefill_base_ms=-1).validate()


def test_tokenizer_round_trips_and_counts_words():
    tok = Tokenizer()
    for text in ("", "hello world", "  spaces\tand\nnewlines  ", "supercalifragilistic", "naïve café — ok?!",
                 "emoji 🙂🙂🙂 end", "a\x00b"):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < 2**53 for i in ids)
    assert len(tok.encode(" ".join(["w"] * 37))) == 37
    assert len(tok.encode(output_text(0, 25))) == 25, "each output word is one token"
    assert tok.encode("The cat sat.") == tok.encode("The cat sat.")


def test_tokenizer_count_equals_the_length_of_encode():
    tok = Tokenizer()
    rng = random.Random(3)
    alphabet = "ab Z9_.,!?\t\n  éü東京🙂—"
    texts = ["", " " * 20, "a" * 13 + " " + "b" * 12, "x" * 6 + " " + "y" * 7, "naïve café — 東京タワー 🙂 ¿qué?",
             "supercalifragilistic  x\n\n y"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 80))) for _ in range(300)]
    for text in texts:
        assert tok.count(text) == len(tok.encode(text)), text


def test_output_lengths():
    fixed = OutputLengthSampler(OutputLengthMode.FIXED)
    assert fixed.sample(40) == 40
    rnd = OutputLengthSampler(OutputLengthMode.RANDOM, seed=1)
    draws = [rnd.sample(40, min_tokens=5) for _ in range(200)]
    assert min(draws) >= 5 and max(draws) <= 40 and len(set(draws)) > 10
    assert rnd.sample(40, ignore_eos=True) == 40


def test_engine_refuses_requests_that_can_never_run():
    engine = EngineCore(EngineConfig(num_blocks=4, block_size=16, max_model_len=1000), TimingModel.zero())
    with pytest.raises(RequestRejected, match="could never run"):
        engine.add_request([1] * 10, max_tokens=60)
    engine.add_request([1] * 10, max_tokens=55)  # 64 tokens in KV at most: exactly 4 blocks
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request([], max_tokens=1)


def test_zero_latency_engine_still_yields_to_other_tasks():
    async def scenario() -> tuple[int, int]:
        engine = EngineCore(EngineConfig(num_blocks=1024), TimingModel.zero())
        engine.start()
        stream = engine.add_request([1, 2, 3], max_tokens=2000)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        while not stream.request.status.is_finished:
            await stream.wait()
        task.cancel()
        steps = engine.scheduler.stats.num_steps
        await engine.stop()
        assert stream.request.status is RequestStatus.FINISHED_LENGTH
        return ticks, steps

    ticks, steps = asyncio.run(scenario())
    assert steps >= 2000 and ticks >= steps // 2
