"""The drills' replay workload: seeded request schedules for realtime phases, bursts, storms and batch jobs.

Everything here is a pure function of the seed (recorded with the results), so a run can be replayed.
Realtime requests come in four kinds: short question answering (the critical class), 32K-token inputs,
long outputs, and prompts that open with a shared prefix (one across every tenant, one per tenant).
Batch jobs mix short answers, long outputs and shared prefixes and go through the Batch API.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import asdict, dataclass

# One-token words of the simulator's tokenizer (a leading space plus at most five letters is one piece), so
# a prompt of N words is N tokens and a "32K-token input" really is one. Three letters plus the space make
# four characters per token, so a gateway that estimates tokens from characters (4 per token) counts the same.
VOCAB = ("ant", "bee", "cat", "dog", "elk", "fox", "gnu", "hen", "owl", "pig", "ram", "yak")
KINDS = ("short_qa", "long_input", "long_output", "shared_prefix")
# The class a kind's latency is judged in: short QA is the critical interactive traffic.
CLASS_OF = {"short_qa": "critical", "long_input": "interactive", "long_output": "interactive",
            "shared_prefix": "interactive", "burst": "interactive", "storm": "interactive"}
OBJECTIVE_OF_CLASS = {"critical": "realtime", "interactive": "standard"}
STREAMED = ("short_qa", "shared_prefix")


@dataclass(frozen=True)
class Shapes:
    """Sizes of each kind of request (token counts; uniform ranges are inclusive)."""

    tenants: int = 12
    short_prompt: tuple[int, int] = (24, 96)
    short_max_tokens: tuple[int, int] = (16, 48)
    long_input_tokens: int = 32768
    long_input_max_tokens: int = 64
    long_output_prompt: tuple[int, int] = (64, 256)
    long_output_max_tokens: tuple[int, int] = (512, 1024)
    shared_prefix_tokens: int = 1024  # the prefix every tenant shares
    tenant_prefix_tokens: int = 2048  # each tenant's own document prefix
    shared_max_tokens: tuple[int, int] = (32, 128)
    # Share of realtime arrivals of each kind, in KINDS order.
    mix: tuple[float, float, float, float] = (0.55, 0.1, 0.15, 0.2)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    at: float  # seconds from the phase start
    phase: str
    kind: str
    tenant: str
    klass: str
    prompt: str
    max_tokens: int
    cancel_after: float | None = None  # the client closes the stream this long after sending

    @property
    def objective(self) -> str:
        return OBJECTIVE_OF_CLASS[self.klass]

    @property
    def stream(self) -> bool:
        """Short answers stream (their TTFT is judged); long ones are read whole, which spares the client
        parsing hundreds of chunks per request, work that would otherwise delay every TTFT it measures."""
        return self.kind in STREAMED

    def body(self, model: str) -> dict:
        body = {"model": model, "stream": self.stream, "max_tokens": self.max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": self.prompt}]}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def describe(self) -> dict:
        """The spec without its prompt text (the prompt is reproducible from the seed)."""
        out = asdict(self)
        out["prompt_words"] = len(out.pop("prompt").split())
        return out


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def tenant_name(i: int) -> str:
    return f"tenant-{i:02d}"


class Workload:
    """Seeded generator; each method draws from its own stream so phases do not shift each other."""

    def __init__(self, seed: int, shapes: Shapes = Shapes()):
        self.seed = seed
        self.shapes = shapes
        prefix_rng = random.Random(seed * 7 + 1)
        self.shared_prefix = words(prefix_rng, shapes.shared_prefix_tokens)
        self.tenant_prefixes = [words(prefix_rng, shapes.tenant_prefix_tokens) for _ in range(shapes.tenants)]
        self._next_index = 0

    def _rng(self, phase: str) -> random.Random:
        return random.Random(f"{self.seed}:{phase}")

    def _spec(self, rng: random.Random, at: float, phase: str, kind: str, tenant: int,
              cancel_after: float | None = None) -> RequestSpec:
        sh = self.shapes
        if kind == "short_qa":
            prompt, max_tokens = words(rng, rng.randint(*sh.short_prompt)), rng.randint(*sh.short_max_tokens)
        elif kind == "long_input":
            prompt, max_tokens = words(rng, sh.long_input_tokens), sh.long_input_max_tokens
        elif kind in ("long_output", "burst", "storm"):
            prompt = words(rng, rng.randint(*sh.long_output_prompt))
            max_tokens = rng.randint(*sh.long_output_max_tokens)
        elif kind == "shared_prefix":
            # Half share the prefix every tenant sees, half their own tenant's document.
            head = self.shared_prefix if rng.random() < 0.5 else self.tenant_prefixes[tenant]
            prompt = head + " " + words(rng, rng.randint(*sh.short_prompt))
            max_tokens = rng.randint(*sh.shared_max_tokens)
        else:
            raise ValueError(f"unknown request kind {kind!r}; choose from {', '.join(KINDS)}, burst, storm")
        self._next_index += 1
        return RequestSpec(self._next_index, at, phase, kind, tenant_name(tenant), CLASS_OF[kind], prompt, max_tokens,
                           cancel_after)

    def realtime(self, phase: str, rate: float, seconds: float, start: float = 0.0) -> list[RequestSpec]:
        """Poisson arrivals at `rate` per second for `seconds`, kinds drawn from the mix, tenants uniform."""
        rng = self._rng(phase)
        out: list[RequestSpec] = []
        t = 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= seconds:
                return out
            kind = rng.choices(KINDS, weights=self.shapes.mix)[0]
            out.append(self._spec(rng, start + t, phase, kind, rng.randrange(self.shapes.tenants)))

    def burst(self, phase: str, tenant: int, n: int, at: float = 0.0) -> list[RequestSpec]:
        """`n` long-output requests from one tenant at once."""
        rng = self._rng(phase)
        return [self._spec(rng, at, phase, "burst", tenant) for _ in range(n)]

    def storm(self, phase: str, n: int, cancel_after: float, at: float = 0.0) -> list[RequestSpec]:
        """`n` long-output requests across tenants, every one cancelled by its client `cancel_after` s in."""
        rng = self._rng(phase)
        return [self._spec(rng, at, phase, "storm", i % self.shapes.tenants, cancel_after) for i in range(n)]

    def long_outputs(self, phase: str, n: int, at: float = 0.0) -> list[RequestSpec]:
        """`n` long-output requests across tenants at once (work in flight when something is killed)."""
        rng = self._rng(phase)
        return [self._spec(rng, at, phase, "long_output", i % self.shapes.tenants) for i in range(n)]

    def batch_file(self, job: int, lines: int, model: str) -> bytes:
        """One Batch API input file: a third short answers, a third long outputs, a third shared-prefix."""
        rng = self._rng(f"batch-{job}")
        sh = self.shapes
        out = io.StringIO()
        for i in range(lines):
            kind = ("short", "long", "prefix")[i % 3]
            if kind == "short":
                prompt, max_tokens = words(rng, rng.randint(*sh.short_prompt)), rng.randint(32, 96)
            elif kind == "long":
                prompt, max_tokens = words(rng, rng.randint(*sh.long_output_prompt)), rng.randint(256, 512)
            else:
                prompt = self.shared_prefix + " " + words(rng, rng.randint(*sh.short_prompt))
                max_tokens = rng.randint(32, 96)
            out.write(json.dumps({
                "custom_id": f"job{job}-{i:05d}-{kind}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                         "messages": [{"role": "user", "content": prompt}]},
            }) + "\n")
        return out.getvalue().encode()
