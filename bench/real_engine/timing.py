"""The simulator fitted to the real engine: the engine's step times measured from streams at idle (decode steps
from inter-token gaps, prefill from first tokens of short and long prompts and of bursts), and `holdback sim`
started with them and the engine's slots, context, policy, prefix cache and block size."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.lib.engines import CPU_BLOCK_TOKENS, ENGINE_CPU, start_sim
from bench.lib.processes import Children
from bench.real_engine.traffic import prompt, stream


@dataclass(frozen=True)
class EngineTiming:
    """The engine's step times as the simulator models them (ms), fitted from streams measured on it."""

    prefill_ms_per_token: float
    decode_base_ms: float
    decode_ms_per_seq: float
    prefill_base_ms: float = 0.0
    prefill_ms_per_seq: float = 0.0

    def sim_args(self) -> list[str]:
        return ["--step-overhead-ms", "0", "--prefill-ms-per-token", f"{self.prefill_ms_per_token:.4f}",
                "--prefill-base-ms", f"{self.prefill_base_ms:.3f}",
                "--prefill-ms-per-seq", f"{self.prefill_ms_per_seq:.3f}",
                "--decode-base-ms", f"{self.decode_base_ms:.3f}",
                "--decode-ms-per-seq", f"{self.decode_ms_per_seq:.3f}"]


def prefill_steps(bursts: dict[int, float]) -> tuple[float, float]:
    """The prefill step's base and per-request cost (ms) from the last first token of bursts of short prompts at
    idle, one time per burst size (a median over repeats; a burst of one is a lone prompt's first token): the
    line through two sizes, as the simulator, which starts a burst in one step, would reproduce them. On the
    engine the first request of a burst starts a step of its own while vLLM's API server, on the same core, takes
    in the rest; the last first token is what both cost together, and what a realtime burst's tail waits."""
    sizes = sorted(bursts)
    if len(sizes) < 2 or sizes[0] < 1:
        raise ValueError(f"needs two burst sizes of at least 1, got {sizes}")
    a, b = sizes[0], sizes[1]
    per_seq = max(0.0, (bursts[b] - bursts[a]) / (b - a))
    return max(0.0, bursts[a] - a * per_seq), per_seq


async def fit_timing(url: str, slots: int) -> EngineTiming:
    """Inter-token gaps of 1 and of `slots` concurrent streams give the decode step (base + per sequence); the
    first-token times of a short and a long prompt at idle give prefill per token, and of bursts of short prompts
    the prefill step's base and per-request cost (`prefill_steps`)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def gaps(n: int) -> float:
            async def one() -> list[float]:
                stamps: list[float] = []
                async with session.post(url + "/v1/completions", json={
                        "model": "tiny", "prompt": "count", "max_tokens": 200, "ignore_eos": True,
                        "stream": True}) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: ") and b'"text"' in line:
                            stamps.append(time.monotonic())
                return [b - a for a, b in zip(stamps[1:], stamps[2:])]
            runs = await asyncio.gather(*(one() for _ in range(n)))
            return statistics.median([g for run in runs for g in run]) * 1000

        async def first_token(words: int) -> float:
            times = []
            for i in range(5):
                # A prompt of its own each time: a repeated one is a prefix-cache hit, whose prefill costs nothing.
                got = await stream(session, url, {
                    "model": "tiny", "prompt": prompt(random.Random(words * 10 + i), words), "max_tokens": 1}, {})
                times.append((got.first or 0.0) * 1000)
            return statistics.median(times)

        async def burst(n: int) -> float:
            lasts = []
            for k in range(11):
                got = await asyncio.gather(*(stream(session, url, {
                    "model": "tiny", "prompt": prompt(random.Random(n * 1000 + k * 10 + i), 8), "max_tokens": 1},
                    {}) for i in range(n)))
                lasts.append(max((g.first or 0.0) * 1000 for g in got))
            return statistics.median(lasts)

        one_seq, full = await gaps(1), await gaps(slots)
        short, long = await first_token(8), await first_token(300)
        # A lone short prompt's first token is the burst of one.
        base, per_request = prefill_steps({1: short, max(2, slots): await burst(max(2, slots))})
    per_seq = max(0.0, (full - one_seq) / (slots - 1))
    # A word here is about one token of the tiny model's tokenizer (its prompt count is in vLLM's usage).
    return EngineTiming(max(0.0, (long - short) / 292), max(0.1, one_seq - per_seq), per_seq, base, per_request)


def start_fitted_sim(children: Children, tmp: Path, timing: EngineTiming, slots: int, pin: bool = True,
                     block_size: int = CPU_BLOCK_TOKENS, cpu: int = ENGINE_CPU) -> str:
    """The simulator configured like the engine: its slots, context, policy, prefix cache and block size."""
    return start_sim(children, tmp, [
        "--model", "tiny", "--max-model-len", "512", "--max-num-seqs", str(slots), "--block-size", str(block_size),
        "--scheduling-policy", "priority", "--enable-prefix-caching", "--runner", "generate", "--log-level",
        "WARNING", *timing.sim_args()], log=f"sim-{cpu}.log", cpu=cpu, pin=pin, favoured=True)
