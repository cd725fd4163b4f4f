"""How long one engine step takes on the simulated GPU.

    step_time = step_overhead
              + (prefill_seqs > 0) * (prefill_base + prefill_per_seq * prefill_seqs)
              + prefill_tokens_in_step * prefill_time_per_token
              + loaded_tokens_in_step * load_time_per_token
              + (decode_seqs > 0) * (decode_base + decode_per_seq * decode_seqs)

then, with jitter j > 0, multiplied by (1 + N(0, j)) clamped to [0, 2] (mean unchanged), drawn
from a generator seeded by --seed. Defaults model a mid-size model on one GPU: 2 ms overhead,
0.1 ms per prompt token, 8 ms + 0.08 ms per running sequence for a decode step; so one decoding
sequence sees ~10.1 ms between tokens and 256 see ~30.5 ms, and a 1000-token prompt alone costs
~102 ms of prefill. Tokens loaded back from an offload tier cost 0.01 ms each: the KV of a 32B model (about
256 KiB a token in bf16) over ~25 GB/s of PCIe. The load is counted in the step that admits the request, which
overstates what the step's other sequences pay (vLLM loads asynchronously, beside the computation).

prefill_base and prefill_per_seq (default 0) are what a step pays for computing any prompt at all, and per
request whose prompt it computes, whatever the prompt's length. On a GPU they are small beside the per-token
cost; on vLLM's CPU build beside a tiny model they are most of a first token (a step that starts one 8-token
prompt takes about 10 ms where a decode step takes 3), and the real-engine study fits them from bursts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TimingModel:
    step_overhead_ms: float = 2.0
    prefill_ms_per_token: float = 0.1
    decode_base_ms: float = 8.0
    decode_ms_per_seq: float = 0.08
    load_ms_per_token: float = 0.01
    # Relative standard deviation of the per-step gaussian jitter (0.05 = 5 %).
    jitter: float = 0.0
    prefill_base_ms: float = 0.0
    prefill_ms_per_seq: float = 0.0

    @classmethod
    def zero(cls) -> "TimingModel":
        """All costs 0: steps run back to back, only yielding to the event loop."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    @property
    def is_zero(self) -> bool:
        return not (self.step_overhead_ms or self.prefill_ms_per_token or self.decode_base_ms or self.decode_ms_per_seq
                    or self.load_ms_per_token or self.prefill_base_ms or self.prefill_ms_per_seq)

    def validate(self) -> None:
        for name in ("step_overhead_ms", "prefill_ms_per_token", "decode_base_ms", "decode_ms_per_seq",
                     "load_ms_per_token", "jitter", "prefill_base_ms", "prefill_ms_per_seq"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")

    def predict(self, prefill_tokens: int, decode_seqs: int, loaded_tokens: int = 0, prefill_seqs: int = 0) -> float:
        """Step time in seconds without jitter."""
        ms = (self.step_overhead_ms + prefill_tokens * self.prefill_ms_per_token
              + loaded_tokens * self.load_ms_per_token)
        if prefill_seqs > 0:
            ms += self.prefill_base_ms + self.prefill_ms_per_seq * prefill_seqs
        if decode_seqs > 0:
            ms += self.decode_base_ms + self.decode_ms_per_seq * decode_seqs
        return ms / 1000.0

    def step_time(self, prefill_tokens: int, decode_seqs: int, rng: random.Random | None = None,
                  loaded_tokens: int = 0, prefill_seqs: int = 0) -> float:
        seconds = self.predict(prefill_tokens, decode_seqs, loaded_tokens, prefill_seqs)
        if self.jitter > 0 and rng is not None and seconds > 0:
            seconds *= min(2.0, max(0.0, 1.0 + rng.gauss(0.0, self.jitter)))
        return seconds
