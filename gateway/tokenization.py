"""Prompt token counts for KV admission: the model's own tokenizer, in the gateway when it can be, else through
a replica's POST /tokenize.

Counts are cached by a hash of (model, prompt), so a repeated prompt costs one dictionary lookup. Token-id
prompts are counted locally. `tokenizer: auto` (the default) counts in process with a tokenizer that has
agreed with the replica: for each replica identity (URL, model, runtime) the candidates are the configured
`tokenizerFile`, the model's `tokenizer.json` found on this host (the model path or the Hugging Face hub cache),
and, for a `holdback sim` replica, the simulator's own tokenizer and chat template. A candidate is used once its
counts equal the replica's /tokenize on every probe text (chat too for the chat path); until then, and when none
agrees, prompts go to /tokenize. Every `tokenizerCheckEvery`-th in-process count is re-checked against /tokenize
in the background, and a disagreement sends that replica's prompts back to /tokenize. `tokenizer: replica`
always asks the replica, `simulator` and `local` count in process without the check, `estimate` uses
characters ÷ `charsPerToken`, which is also the fallback (counted in a metric) when nothing else answers.
The output limit is read from the body as vLLM reads it (`output_limit`), with vLLM's defaults.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import aiohttp

from gateway.log import log_event
from gateway.replicas import Replica
from gateway.request_size import output_limit, truncated_prompt
from gateway.settings import Admission, ConfigError
from holdback.sim_tokenizer import ChatTemplateError, Tokenizer, chat_switches, render_chat

logger = logging.getLogger("gateway.tokens")

# Texts a candidate tokenizer must count exactly as the replica does: words, numbers, punctuation, runs of
# spaces and newlines, accents, CJK, an emoji and a word longer than any piece.
PROBE_PROMPTS = (
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "  leading spaces,\ttabs\n\nand blank lines   \n",
    "naïve café — 東京タワー 🙂 ¿qué? 3.14159e-10",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
)
# A check the replica did not answer (busy, restarting) is tried again after this long.
CHECK_RETRY_SECONDS = 5.0
CHAT_OPTIONS = ("add_generation_prompt", "continue_final_message")
# Body fields that change the prompt vLLM renders and that only the replica's renderer applies (tools, another
# template or its arguments, media, 0.34's response_format, special tokens): a body with any of them is counted by
# the replica's /tokenize, which takes them all (vLLM 0.32-0.34 TokenizeChatRequest; a completion's only
# add_special_tokens), never by an in-process tokenizer under `auto`.
REPLICA_OPTIONS = ("add_special_tokens", "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs",
                   "media_io_kwargs", "response_format")
COMPLETION_OPTIONS = ("add_special_tokens",)
PROBE_CHAT = ({"role": "system", "content": "Answer briefly."},
              {"role": "user", "content": "How many tokens is this chat? Count them, please."})


@dataclass(frozen=True)
class TokenCount:
    prompt_tokens: int
    # Per sequence: the output limit the request gives, else the one vLLM applies (see output_limit).
    max_new_tokens: int
    exact: bool
    # The body field max_new_tokens came from (None: a default), and the sequences generated (n, best_of).
    limit_param: str | None = None
    sequences: int = 1


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    if isinstance(value, dict):
        return _chars(value.get("content")) + _chars(value.get("text"))
    return 0


def _token_ids(value: Any) -> int | None:
    """Token count of a prompt given as ids ([1, 2] or [[1, 2], [3]]), else None."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return len(value)
    if isinstance(value, list) and value and all(isinstance(v, list) and v and all(isinstance(i, int) for i in v)
                                                 for v in value):
        return sum(len(v) for v in value)
    return None


def has_media(messages: Any) -> bool:
    """Whether a chat carries content parts other than text (images, audio): only the replica counts those."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") not in ("text", None) for p in m["content"])
        for m in messages)


# -- in-process tokenizers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InProcess:
    """A tokenizer the gateway runs itself: `source` names it in metrics and /admin/state."""

    source: str
    # (prompt, chat, chat options: add_generation_prompt / continue_final_message) -> tokens, None: cannot count
    count: Callable[[Any, bool, Mapping[str, Any]], int | None]
    chat: bool
    path: str | None = None


def simulator_tokenizer() -> InProcess:
    return InProcess("simulator", _simulator_count, chat=True)


def file_tokenizer(path: str) -> InProcess:
    load_local_tokenizer(path)  # a bad file is a ConfigError now, not at the first request
    return InProcess("tokenizer.json", functools.partial(_file_count, path), chat=False, path=path)


def _simulator_count(prompt: Any, chat: bool, options: Mapping[str, Any]) -> int | None:
    """The simulator's own count (its chat template, its tokenizer: holdback.sim_tokenizer, the code the simulator
    runs); None for a prompt it would refuse."""
    tokenizer = Tokenizer()
    try:
        if chat:
            return tokenizer.count(render_chat(prompt, *chat_switches(options)))
    except ChatTemplateError:
        return None
    return _count_texts(prompt, lambda texts: [tokenizer.count(t) for t in texts])


def _count_texts(prompt: Any, count: Callable[[list[str]], list[int]]) -> int | None:
    """A completion prompt (a string or a list of strings) counted by `count`; None for any other shape."""
    if isinstance(prompt, str):
        return count([prompt])[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(count(prompt))
    return None


@functools.lru_cache(maxsize=4)
def load_local_tokenizer(path: str):
    """A Hugging Face tokenizer from its tokenizer.json; ConfigError when it cannot be used."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("admission.tokenizerFile needs the `tokenizers` package: pip install "
                          "'holdback[local-tokenizer]'") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the library raises its own exception types for unreadable files
        raise ConfigError(f"admission.tokenizerFile {path!r} is not a readable tokenizer.json: {exc}") from None


def _file_count(path: str, prompt: Any, chat: bool, options: Mapping[str, Any]) -> int | None:
    if chat:
        return None  # the chat template is the replica's
    tokenizer = load_local_tokenizer(path)
    return _count_texts(prompt, lambda texts: [len(e.ids) for e in tokenizer.encode_batch(texts)])


def find_tokenizer_json(model: str | None) -> str | None:
    """The model's tokenizer.json on this host: in the model's own directory when the model is a path, else in
    the Hugging Face hub cache ($HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub) at the snapshot
    refs/main names, else the newest snapshot that has one."""
    if not model:
        return None
    direct = Path(model) / "tokenizer.json"
    if direct.is_file():
        return str(direct)
    if "/" not in model or model.startswith("/"):
        return None
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub")
    repo = Path(hub) / ("models--" + model.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = repo / "snapshots" / ref.read_text().strip() / "tokenizer.json"
        if pinned.is_file():
            return str(pinned)
    found = sorted((p for p in (repo / "snapshots").glob("*/tokenizer.json") if p.is_file()),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    return str(found[0]) if found else None


def candidates(cfg: Admission, replica: Replica) -> list[InProcess]:
    """In-process tokenizers that may count this replica's prompts, to be checked against its /tokenize."""
    out: list[InProcess] = []
    # The model's root (a path or a hub name) is where its tokenizer is; `model` may be a served alias.
    paths = [cfg.tokenizerFile, find_tokenizer_json(replica.model_root or replica.model)]
    for path in dict.fromkeys(p for p in paths if p):
        try:
            out.append(file_tokenizer(path))
        except ConfigError as exc:
            log_event(logger, "tokenizer_file_unusable", level=logging.WARNING, replica=replica.url, error=str(exc))
    if replica.runtime_version == "model_sim":
        out.append(simulator_tokenizer())
    return out


# -- the counter ----------------------------------------------------------------------------------------------
class PromptCounter:
    def __init__(self, cfg: Admission, on_fallback=lambda: None,
                 on_count: Callable[[str], None] = lambda source: None):
        self.cfg = cfg
        self.on_fallback = on_fallback
        self.on_count = on_count
        self.fallbacks = 0
        self.sources: Counter[str] = Counter()
        self.disagreements = 0
        self._cache: OrderedDict[str, int] = OrderedDict()
        # tokenizer: auto — per replica identity, the in-process tokenizer that agreed with it (None: none did).
        self._verified: dict[tuple, InProcess | None] = {}
        self._verifying: dict[tuple, asyncio.Task] = {}
        self._retry_at: dict[tuple, float] = {}
        self._checks: set[asyncio.Task] = set()
        self._since_check = 0
        self._fixed: InProcess | None = None
        if cfg.tokenizer == "simulator":
            self._fixed = simulator_tokenizer()
        elif cfg.tokenizer == "local":
            self._fixed = file_tokenizer(cfg.tokenizerFile or "")

    async def count(self, body: Mapping[str, Any], path: str, session: aiohttp.ClientSession | None,
                    replica: Replica | None) -> TokenCount:
        chat = "messages" in body
        prompt = body.get("messages") if chat else body.get("prompt", body.get("input"))
        # The chat template's switches change the rendered prompt (a resumed answer continues its message).
        options = {k: body[k] for k in CHAT_OPTIONS + REPLICA_OPTIONS if k in body} if chat else \
            {k: body[k] for k in COMPLETION_OPTIONS if k in body}
        replica_only = any(k in options for k in REPLICA_OPTIONS) or (chat and has_media(prompt))
        ids = _token_ids(prompt)
        if ids is not None:
            self._counted("token_ids")
            return self._with_output(body, path, replica, ids, True)
        key_doc = {"model": body.get("model"), "messages" if chat else "prompt": prompt, **options}
        key = hashlib.sha256(json.dumps(key_doc, sort_keys=True, default=str).encode()).hexdigest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self._counted("cache")
            return self._with_output(body, path, replica, cached, True)
        counted, source = None, "replica"
        local = self._fixed if self._fixed is not None else \
            None if replica_only else self._in_process(session, replica)
        if local is not None and (local.chat or not chat):
            counted, source = local.count(prompt, chat, options), local.source
            if counted is not None and self._fixed is None:
                self._maybe_check(session, replica, body.get("model"), prompt, chat, options, counted)
        if counted is None and self.cfg.tokenizer in ("auto", "replica", "local") and session is not None \
                and replica is not None:
            counted, source = await self._tokenize(session, replica.url, body.get("model"), prompt, chat,
                                                   options), "replica"
        if counted is None:
            self.fallbacks += 1
            self.on_fallback()
            self._counted("estimate")
            return self._with_output(body, path, replica, math.ceil(_chars(prompt) / self.cfg.charsPerToken), False)
        self._counted(source)
        if self.cfg.tokenCacheSize:
            self._cache[key] = counted
            if len(self._cache) > self.cfg.tokenCacheSize:
                self._cache.popitem(last=False)
        return self._with_output(body, path, replica, counted, True)

    def _with_output(self, body: Mapping[str, Any], path: str, replica: Replica | None, prompt_tokens: int,
                     exact: bool) -> TokenCount:
        context = self.cfg.maxContextTokens or (replica.max_model_len if replica is not None else None)
        prompt_tokens = truncated_prompt(body, path, prompt_tokens, context)
        limit = output_limit(body, path, default=self.cfg.maxNewTokensDefault, context=context,
                             prompt_tokens=prompt_tokens)
        return TokenCount(prompt_tokens, limit.tokens, exact, limit.param, limit.sequences)

    def _counted(self, source: str) -> None:
        self.sources[source] += 1
        self.on_count(source)

    # -- tokenizer: auto --------------------------------------------------------------------------------------
    @staticmethod
    def _identity(replica: Replica) -> tuple:
        return replica.url, replica.model, replica.runtime_version

    def _in_process(self, session: aiohttp.ClientSession | None, replica: Replica | None) -> InProcess | None:
        """The verified in-process tokenizer for this replica; starts the check the first time it is asked."""
        if self.cfg.tokenizer != "auto" or replica is None or session is None or replica.model is None:
            return None  # not identified yet: its model and runtime decide the candidates
        ident = self._identity(replica)
        if ident in self._verified:
            return self._verified[ident]
        if ident not in self._verifying and time.monotonic() >= self._retry_at.get(ident, 0.0):
            task = asyncio.create_task(self._verify(session, replica, ident), name="gateway-tokenizer-check")
            self._verifying[ident] = task
        return None

    async def _verify(self, session: aiohttp.ClientSession, replica: Replica, ident: tuple) -> None:
        try:
            chosen = None
            for candidate in candidates(self.cfg, replica):
                agrees, chat = await self._agrees(session, replica.url, candidate)
                if agrees is None:  # the replica did not answer: no verdict, ask again later
                    self._retry_at[ident] = time.monotonic() + CHECK_RETRY_SECONDS
                    log_event(logger, "tokenizer_check_postponed", replica=replica.url,
                              retry_in_s=CHECK_RETRY_SECONDS)
                    return
                if agrees:
                    chosen = candidate if chat == candidate.chat else InProcess(
                        candidate.source, candidate.count, chat=False, path=candidate.path)
                    break
            if chosen is None:
                log_event(logger, "tokenizer_in_process_unavailable", replica=replica.url,
                          model=replica.model, counting="replica /tokenize")
            else:
                log_event(logger, "tokenizer_in_process", replica=replica.url, model=replica.model,
                          source=chosen.source, path=chosen.path, chat=chosen.chat)
            self._verified[ident] = chosen
        finally:
            self._verifying.pop(ident, None)

    async def _agrees(self, session: aiohttp.ClientSession, url: str,
                      candidate: InProcess) -> tuple[bool | None, bool]:
        """(completion prompts agree, chat agrees) between the candidate and the replica's /tokenize; None
        first when the replica did not answer a probe."""
        for text in PROBE_PROMPTS:
            theirs = await self._tokenize(session, url, None, text, False)
            if theirs is None:
                return None, False
            mine = candidate.count(text, False, {})
            if mine != theirs:
                log_event(logger, "tokenizer_candidate_disagrees", replica=url,
                          source=candidate.source, path=candidate.path, probe=text[:24], local=mine,
                          replica_count=theirs)
                return False, False
        if not candidate.chat:
            return True, False
        theirs = await self._tokenize(session, url, None, list(PROBE_CHAT), True)
        if theirs is None:
            return None, False
        return True, candidate.count(list(PROBE_CHAT), True, {}) == theirs

    def _maybe_check(self, session, replica: Replica | None, model: Any, prompt: Any, chat: bool,
                     options: Mapping[str, Any], counted: int) -> None:
        every = self.cfg.tokenizerCheckEvery
        if not every or session is None or replica is None:
            return
        self._since_check += 1
        if self._since_check < every:
            return
        self._since_check = 0
        task = asyncio.create_task(self._check(session, replica, model, prompt, chat, options, counted),
                                   name="gateway-tokenizer-spot-check")
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(self, session, replica: Replica, model: Any, prompt: Any, chat: bool,
                     options: Mapping[str, Any], counted: int) -> None:
        theirs = await self._tokenize(session, replica.url, model, prompt, chat, options)
        if theirs is None or theirs == counted:
            return
        self.disagreements += 1
        ident = self._identity(replica)
        used = self._verified.get(ident)
        self._verified[ident] = None
        log_event(logger, "tokenizer_disagrees", level=logging.WARNING, replica=replica.url,
                  source=used.source if used else None, local=counted, replica_count=theirs,
                  counting="replica /tokenize from now on")

    def state(self) -> dict:
        """What counts prompts now, per replica (auto), and how the counts so far were made."""
        verified = {}
        for (url, model, _runtime), chosen in self._verified.items():
            verified[url] = {"model": model, "in_process": chosen.source if chosen else None,
                             "chat_in_process": bool(chosen and chosen.chat)}
        return {"mode": self.cfg.tokenizer, "replicas": verified, "counted_by": dict(self.sources),
                "disagreements": self.disagreements}

    def close(self) -> None:
        for task in [*self._verifying.values(), *self._checks]:
            task.cancel()

    # -- the replica's /tokenize ------------------------------------------------------------------------------
    async def _tokenize(self, session: aiohttp.ClientSession, url: str, model: Any, prompt: Any,
                        chat: bool, options: Mapping[str, Any] | None = None) -> int | None:
        if chat:
            docs = [{"messages": prompt, **(options or {})}]
        elif isinstance(prompt, str):
            docs = [{"prompt": prompt, **(options or {})}]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            docs = [{"prompt": p, **(options or {})} for p in prompt]
        else:
            return None
        if model is not None:
            for doc in docs:
                doc["model"] = model
        timeout = aiohttp.ClientTimeout(total=self.cfg.tokenizeTimeoutMs / 1000.0)
        total = 0
        try:
            for doc in docs:
                async with session.post(url + "/tokenize", json=doc, timeout=timeout) as resp:
                    if resp.status >= 300:
                        log_event(logger, "tokenize_refused", level=logging.WARNING, replica=url, status=resp.status)
                        return None
                    answer = await resp.json()
                total += int(answer["count"])
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, TypeError) as exc:
            log_event(logger, "tokenize_failed", level=logging.WARNING, replica=url, error=type(exc).__name__)
            return None
        return total
