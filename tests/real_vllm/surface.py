"""The surface a vLLM-compatible server shows, as one request suite and records two servers can be compared by.

`probe(base_url, model, api_key)` sends SUITE to a server and returns `{case name: record}`. A record keeps what
model_sim and vLLM must agree on and nothing they may not (ids, timestamps, token text, floats): the status, the
body's key sets and value types (recursively), an error's type and param and the type of its code, a stream's
framing (chunk / error / usage / done, repeats collapsed) and the shapes of its events, the key sets of /tokenize
and /v1/models, the `vllm:` metric names with their label names, and the facts a case checks (booleans: "chat
without max_tokens used the rest of the context"). `diff(a, b)` lists where two probes disagree, leaving out the
paths DELIBERATE names; keys starting with `_` (how the prompts were sized) are informational and never compared.

Prompts are sized on each server: a word that its tokenizer cuts into many tokens is measured with /tokenize and
repeated until the prompt has the length a case needs. Length-sensitive cases send `ignore_eos`, so a real model's
end-of-sequence cannot cut them short.

Compare the simulator as the real-engine tier starts vLLM (tests/real_vllm/conftest.py: `--max-model-len 512`,
served as `tiny`, vLLM's defaults otherwise), e.g.
    holdback sim --port P --model tiny --max-model-len 512 --runner generate --enable-prefix-caching \\
        --block-size 128 --num-blocks 16384
Nothing here starts a process or sends a request at import.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.vllm_metrics import FILTERED_METRICS, METRICS_QUERY

# Deliberate differences of model_sim from vLLM 0.32 (model_sim/README.md, "Known differences from vLLM", lists the
# same). A key is a record path `diff` skips (a case, or `case.field...`), or a name for what the probe cannot see.
DELIBERATE: dict[str, str] = {
    "runner_default": "the simulator's default `--runner both` serves generation and embeddings from one replica "
                      "(the demo and the batch tests use both); the `embeddings_on_generation_server` case matches "
                      "vLLM under `--runner generate`, as the command above starts it",
    "version": "/version answers {\"version\": \"model_sim\"}: the gateway tells a simulator from vLLM by it and "
               "counts prompts with the simulator's own tokenizer",
    "tokens": "token ids, token text and the chat template are the simulator's own (deterministic words, a "
              "reversible byte tokenizer), so counts differ from the model's; only shapes and facts are compared",
    "prefix_caching_default": "prefix caching is off unless --enable-prefix-caching (vLLM: on); "
                              "vllm:cache_config_info says which",
    "kv_smaller_than_context": "the KV cache may hold fewer tokens than max_model_len (vLLM refuses to start); a "
                               "request that could never fit is refused with 400 naming max_tokens",
    "validation_messages": "a malformed body (wrong types, missing fields) gets the simulator's own message and "
                           "param; vLLM's pydantic errors read `N validation errors: ...` with param `body.<field>`",
    "stream_chunking": "one chunk per token; vLLM merges the tokens of several steps into one delta when the client "
                       "reads slower than it generates",
    "choices_text": "the n choices of one request carry the same text (output is a fixed word sequence)",
    "request_id_header": "x-request-id is echoed on every answer (vLLM: only with --enable-request-id-headers), "
                         "and x-sim-replica names the replica",
    "abort_timing": "an aborted request's KV blocks are freed at once, not at the next engine step",
    "shutdown_abort": "a non-streamed request aborted by the server's shutdown answers 503; a streamed one ends "
                      "with finish_reason \"abort\" and [DONE]",
    "not_modelled": "stop strings, logprobs, tools, LoRA, speculative decoding, multi-modal input and several "
                    "prompts in one completions request are not modelled; embeddings are answered at once, not "
                    "scheduled",
    "metric_values": "metric values are the simulator's (its scheduler, its timing model); cache_config_info's "
                     "labels beyond the KV geometry and prefix caching carry vLLM's defaults",
    "system_fingerprint": "system_fingerprint is `model_sim-<hash of the settings>`, not `vllm-<version>-<hash>`",
    "model_root": "/v1/models gives the served name as `root` (vLLM: the model's path)",
}

# Words likely to cost several tokens each on any tokenizer: long, rare letter runs and non-ASCII letters.
CANDIDATE_WORDS = ("zqxjvkwpfyzqxj", "qwxzvjkbpmfghq", "xylophonequartzjumbo", "ßüñçøåéîõ", "0x7f3a9c2e81d4")
PROMPT_PREFIX = "hello world"


@dataclass(frozen=True)
class Text:
    """A prompt sized on the server: `tokens` tokens, or the context length plus `tokens` when `of_context`."""

    tokens: int
    of_context: bool = False


@dataclass(frozen=True)
class ContextPlus:
    """An integer field set to the server's context length plus `delta`."""

    delta: int


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: dict | None = None
    # A fact to record (see _FACTS).
    fact: str | None = None
    # False: sent without the API key (a probe of the auth answer; skipped when the server has no key).
    authorized: bool = True


def _chat(content: Any = PROMPT_PREFIX, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], **fields}


SMALL = {"max_tokens": 4, "ignore_eos": True}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}

SUITE: tuple[Case, ...] = (
    Case("chat", "POST", "/v1/chat/completions", _chat(**SMALL), fact="prompt_tokens_match_tokenize"),
    Case("chat_stream", "POST", "/v1/chat/completions",
         _chat(**SMALL, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})),
    Case("chat_stream_plain", "POST", "/v1/chat/completions", _chat(**SMALL, stream=True)),
    Case("completion", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL},
         fact="prompt_tokens_match_tokenize"),
    Case("completion_stream", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL, **USAGE}),
    Case("completion_stream_plain", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL, "stream": True}),
    Case("unknown_model", "POST", "/v1/chat/completions", {**_chat(**SMALL), "model": "no-such-model"}),
    Case("prompt_over_context", "POST", "/v1/completions", {"prompt": Text(40, of_context=True), **SMALL}),
    Case("chat_prompt_over_context", "POST", "/v1/chat/completions", _chat(Text(40, of_context=True), **SMALL)),
    Case("max_tokens_over_context", "POST", "/v1/completions",
         {"prompt": PROMPT_PREFIX, "max_tokens": ContextPlus(88), "ignore_eos": True}),
    Case("max_completion_tokens_over_context", "POST", "/v1/chat/completions",
         _chat(max_completion_tokens=ContextPlus(88), ignore_eos=True)),
    Case("prompt_plus_max_tokens_over_context", "POST", "/v1/completions",
         {"prompt": Text(-40, of_context=True), "max_tokens": 100, "ignore_eos": True}, fact="clamped_to_context"),
    # A prompt over the context that asks to be truncated is served: its last N tokens, or the context less one.
    Case("truncated_prompt", "POST", "/v1/completions",
         {"prompt": Text(40, of_context=True), "truncate_prompt_tokens": 100, **SMALL}, fact="hundred_prompt_tokens"),
    Case("chat_truncated_prompt", "POST", "/v1/chat/completions",
         _chat(Text(40, of_context=True), truncate_prompt_tokens=100, **SMALL), fact="hundred_prompt_tokens"),
    Case("prompt_truncated_to_context", "POST", "/v1/completions",
         {"prompt": Text(40, of_context=True), "truncate_prompt_tokens": -1, **SMALL}, fact="context_less_one"),
    Case("truncation_over_context", "POST", "/v1/completions",
         {"prompt": PROMPT_PREFIX, "truncate_prompt_tokens": ContextPlus(88), **SMALL}),
    Case("chat_without_max_tokens", "POST", "/v1/chat/completions",
         _chat(Text(-24, of_context=True), ignore_eos=True), fact="rest_of_context"),
    Case("completion_without_max_tokens", "POST", "/v1/completions",
         {"prompt": PROMPT_PREFIX, "ignore_eos": True}, fact="sixteen_tokens"),
    Case("completion_max_tokens_null", "POST", "/v1/completions",
         {"prompt": PROMPT_PREFIX, "max_tokens": None, "ignore_eos": True}, fact="sixteen_tokens"),
    # Sampling fields the simulator does not model are typed as vLLM types them: a word is refused, a number
    # written as a string is read.
    Case("sampling_field_not_a_number", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL,
                                                                    "temperature": "hot"}),
    Case("sampling_fields_as_strings", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL,
                                                                   "temperature": "0.5", "top_k": "3"}),
    # return_token_ids (what the workers' resume by token ids reads): the output's ids on each choice or chunk,
    # the prompt's on the chat head or each completion choice's first chunk.
    Case("completion_token_ids", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL,
                                                             "return_token_ids": True}),
    Case("completion_stream_token_ids", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL, **USAGE,
                                                                    "return_token_ids": True}),
    Case("chat_token_ids", "POST", "/v1/chat/completions", _chat(**SMALL, return_token_ids=True)),
    Case("chat_stream_token_ids", "POST", "/v1/chat/completions", _chat(**SMALL, **USAGE, return_token_ids=True)),
    Case("chat_n2", "POST", "/v1/chat/completions", _chat(**SMALL, n=2), fact="two_choices"),
    Case("chat_n2_stream", "POST", "/v1/chat/completions", _chat(**SMALL, **USAGE, n=2), fact="two_choices"),
    Case("completion_n2", "POST", "/v1/completions", {"prompt": PROMPT_PREFIX, **SMALL, "n": 2},
         fact="two_choices"),
    Case("embeddings_on_generation_server", "POST", "/v1/embeddings", {"input": PROMPT_PREFIX}),
    Case("no_route", "GET", "/v1/no-such-route"),
    Case("tokenize_prompt", "POST", "/tokenize", {"prompt": PROMPT_PREFIX}),
    Case("tokenize_messages", "POST", "/tokenize", _chat()),
    Case("models", "GET", "/v1/models"),
    Case("no_api_key", "GET", "/v1/models", authorized=False),
    Case("metrics", "GET", "/metrics"),
    # vLLM's /metrics route ignores a `name[]` filter; its /metrics/ mount answers it, as the gateway's scrape asks.
    Case("metrics_filter_ignored", "GET", "/metrics" + METRICS_QUERY),
    Case("metrics_gateway_scrape", "GET", FILTERED_METRICS),
)


# -- normalising ----------------------------------------------------------------------------------------------------


def shape(value: Any) -> Any:
    """Key sets and value types, recursively: a dict's keys with their shapes, a list as its distinct item shapes."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        out: list = []
        for item in value:
            s = shape(item)
            if s not in out:
                out.append(s)
        return out
    if value is None:
        return "null"
    return type(value).__name__  # bool, int, float, str


def _event_kind(event: Any) -> str:
    if event == "[DONE]":
        return "done"
    if isinstance(event, dict) and "error" in event and "choices" not in event:
        return "error"
    if isinstance(event, dict) and not event.get("choices") and event.get("usage") is not None:
        return "usage"
    return "chunk"


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        data = "".join(line[5:].strip() for line in block.splitlines() if line.startswith("data:"))
        if data:
            out.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return out


def stream_record(text: str) -> dict:
    events = sse_events(text)
    framing: list[str] = []
    shapes: dict[str, list] = {}
    for event in events:
        kind = _event_kind(event)
        if not framing or framing[-1] != kind:
            framing.append(kind)
        if kind != "done":
            s = shape(event)
            if s not in shapes.setdefault(kind, []):
                shapes[kind].append(s)
    error = next((e["error"] for e in events if _event_kind(e) == "error"), None)
    out = {"framing": framing, "shapes": shapes}
    if isinstance(error, dict):
        out["error"] = _error_record(error)
    return out


def _error_record(error: dict) -> dict:
    return {"type": error.get("type"), "param": error.get("param"), "code": shape(error.get("code"))}


_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


def metrics_record(text: str) -> dict[str, list[str]]:
    """Every `vllm:` series name with the names of its labels (the union over its samples)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and m.group(1).startswith("vllm:"):
            out.setdefault(m.group(1), set()).update(_LABEL.findall(m.group(2) or ""))
    return {name: sorted(labels) for name, labels in sorted(out.items())}


def response_record(resp: httpx.Response) -> dict:
    out: dict[str, Any] = {"status": resp.status_code}
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        out["stream"] = stream_record(resp.text)
        return out
    try:
        body = resp.json()
    except ValueError:
        out["body"] = "not json" if resp.content else "empty"
        return out
    out["body"] = shape(body)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        out["error"] = _error_record(body["error"])
    elif isinstance(body, dict) and isinstance(body.get("error"), str):
        out["error"] = {"message": body["error"]}  # vLLM's auth middleware: {"error": "Unauthorized"}
    if isinstance(body, dict) and "detail" in body:
        out["detail"] = body["detail"]  # FastAPI's own answers ({"detail": "Not Found"})
    return out


# -- sizing prompts -------------------------------------------------------------------------------------------------


@dataclass
class Sizer:
    """Measures the server's tokenizer with /tokenize and sizes prompts from the costliest candidate word."""

    client: httpx.Client
    model: str
    word: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    def count(self, text: str, chat: bool = False) -> int:
        body = {"model": self.model, **(_chat(text) if chat else {"prompt": text})}
        r = self.client.post("/tokenize", json=body)
        r.raise_for_status()
        return int(r.json()["count"])

    def _text(self, reps: int) -> str:
        return " ".join([PROMPT_PREFIX, *[self.word] * reps])

    def choose_word(self) -> None:
        best: tuple[float, str] | None = None
        for word in CANDIDATE_WORDS:
            self.word = word
            c4, c8, c12 = (self.count(self._text(k)) for k in (4, 8, 12))
            per = (c8 - c4) / 4
            if per > 0 and c12 - c8 == c8 - c4 and (best is None or per > best[0]):
                best = (per, word)
        if best is None:
            raise RuntimeError("no candidate word tokenizes linearly on this server; extend CANDIDATE_WORDS")
        self.word = best[1]
        self.measured = {"word": self.word, "tokens_per_word": best[0]}

    def sized(self, tokens: int, chat: bool) -> str:
        """The shortest prompt (chat: message content) of at least `tokens` tokens."""
        c4, c8 = self.count(self._text(4), chat), self.count(self._text(8), chat)
        per = (c8 - c4) / 4
        reps = max(0, math.ceil(4 + (tokens - c4) / per))
        while reps > 0 and self.count(self._text(reps - 1), chat) >= tokens:
            reps -= 1
        while self.count(self._text(reps), chat) < tokens:
            reps += 1
        return self._text(reps)


def _resolve(value: Any, sizer: Sizer, context: int, chat: bool) -> Any:
    if isinstance(value, Text):
        return sizer.sized(value.tokens + (context if value.of_context else 0), chat)
    if isinstance(value, ContextPlus):
        return context + value.delta
    if isinstance(value, dict):
        return {k: _resolve(v, sizer, context, chat) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, sizer, context, chat) for v in value]
    return value


def _needs_sizing(value: Any) -> bool:
    if isinstance(value, Text):
        return True
    if isinstance(value, dict):
        return any(_needs_sizing(v) for v in value.values())
    if isinstance(value, list):
        return any(_needs_sizing(v) for v in value)
    return False


# -- facts ----------------------------------------------------------------------------------------------------------


def _usage(resp: httpx.Response) -> dict:
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        usage = [e["usage"] for e in sse_events(resp.text) if isinstance(e, dict) and e.get("usage")]
        return usage[-1] if usage else {}
    return resp.json().get("usage") or {} if resp.status_code == 200 else {}


def _choice_indices(resp: httpx.Response) -> list[int]:
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return sorted({c["index"] for e in sse_events(resp.text) if isinstance(e, dict)
                       for c in e.get("choices") or ()})
    return [c["index"] for c in resp.json().get("choices") or ()] if resp.status_code == 200 else []


def _fact(name: str, resp: httpx.Response, body: dict, sizer: Sizer, context: int) -> bool:
    usage = _usage(resp)
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if name == "prompt_tokens_match_tokenize":
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        return prompt == sizer.count(text, chat="messages" in body)
    if name in ("clamped_to_context", "rest_of_context"):
        return resp.status_code == 200 and prompt is not None and completion == context - prompt
    if name == "sixteen_tokens":
        return completion == 16
    if name == "hundred_prompt_tokens":
        return resp.status_code == 200 and prompt == 100
    if name == "context_less_one":
        return resp.status_code == 200 and prompt == context - 1 and completion == 1
    if name == "two_choices":
        return _choice_indices(resp) == [0, 1]
    raise ValueError(f"unknown fact {name!r}")


# -- the probe ------------------------------------------------------------------------------------------------------


def probe(base_url: str, model: str, api_key: str | None = None, timeout: float = 120.0) -> dict:
    """Send SUITE to the server at `base_url` serving `model`; one record per case (see the module docstring)."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    records: dict[str, Any] = {}
    with httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=auth) as client:
        context = int(client.get("/v1/models").raise_for_status().json()["data"][0]["max_model_len"])
        sizer = Sizer(client, model)
        sizer.choose_word()
        records["_sizing"] = {**sizer.measured, "context": context}
        for case in SUITE:
            if not case.authorized and not api_key:
                continue
            chat = case.path.endswith("/chat/completions") or (case.body or {}).get("messages") is not None
            body = None
            if case.body is not None:
                body = _resolve({"model": model, **case.body}, sizer, context, chat)
            if case.authorized:
                resp = client.request(case.method, case.path, json=body)
            else:
                resp = httpx.request(case.method, base_url.rstrip("/") + case.path, json=body, timeout=timeout)
            if case.path.startswith("/metrics"):
                records[case.name] = {"status": resp.status_code, "series": metrics_record(resp.text)}
                continue
            record = response_record(resp)
            if case.fact is not None:
                record["fact"] = {case.fact: _fact(case.fact, resp, body or {}, sizer, context)}
            if body is not None and _needs_sizing(case.body):
                record["_prompt_tokens"] = _usage(resp).get("prompt_tokens")
            records[case.name] = record
    return records


def diff(a: dict, b: dict, deliberate: dict[str, str] = DELIBERATE) -> list[str]:
    """Where two probes disagree, as `path: a != b` lines; DELIBERATE paths and `_` keys are left out."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if path in deliberate:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for key in sorted(set(x) | set(y), key=str):
                if str(key).startswith("_"):
                    continue
                sub = f"{path}.{key}" if path else str(key)
                if key not in x or key not in y:
                    if sub not in deliberate:
                        out.append(f"{sub}: {'missing' if key not in x else x[key]!r} != "
                                   f"{'missing' if key not in y else y[key]!r}")
                    continue
                walk(x[key], y[key], sub)
        elif x != y:
            out.append(f"{path}: {x!r} != {y!r}")

    walk(a, b, "")
    return out
