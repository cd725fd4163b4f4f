"""What the gateway reads of a request's body and of a replica's answer body, beyond relaying them.

The request body is parsed once (for the cache salt and KV admission); a /v1/responses body is counted as the
chat vLLM renders it to; a prompt's leading blocks are hashed for prefix routing; a replica's 404 is told apart from
vLLM's own error envelopes.
"""

from __future__ import annotations

import hashlib
import json

from holdback.contract import CHAT_ENDPOINT, RESPONSES_ENDPOINT
from holdback.sim_tokenizer import ChatTemplateError, prompt_text, responses_messages

PREFIX_BLOCK_CHARS = 128  # about 30 tokens of English: two of vLLM's 16-token KV blocks
PREFIX_MAX_BLOCKS = 64


def document(body: bytes) -> object:
    """The request body parsed once, for the cache salt and KV admission: {} when empty, None when not JSON."""
    if not body:
        return {}
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def responses_as_chat(doc: dict) -> tuple[dict, str]:
    """A /v1/responses body counted as the chat vLLM renders it to (holdback.sim_tokenizer.responses_messages),
    its `max_output_tokens` the chat's output limit (without one vLLM's chat generates to the context's end
    too) and `truncation: "auto"` its truncation (vLLM 0.32 applies it only beside `max_output_tokens`; without,
    an input as long as the context is refused). An input that renders no chat is counted as it is (the replica
    answers it)."""
    try:
        messages = responses_messages(doc)
    except ChatTemplateError:
        return doc, RESPONSES_ENDPOINT.path
    chat = {"model": doc.get("model"), "messages": messages}
    if doc.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = doc["max_output_tokens"]
        if doc.get("truncation") == "auto":  # vLLM then keeps the input's last (context − 1) tokens
            chat["truncate_prompt_tokens"] = -1
    return chat, CHAT_ENDPOINT.path


def prefix_blocks(doc: object, path: str, salt: str | None) -> tuple[int, ...]:
    """The prompt's leading `PREFIX_BLOCK_CHARS`-character blocks as chained hashes under the request's cache salt
    (the i-th hash stands for the salt and the first i + 1 blocks, so a replica holding it holds the whole prefix
    that far, in that tenant's scope): what the prefix-affinity picker remembers per replica. Stable across
    processes (a relay computes it, flow control compares). () when the body renders no text prompt."""
    return prefix_share(doc, path, salt)[0]


def prefix_share(doc: object, path: str, salt: str | None) -> tuple[tuple[int, ...], float]:
    """`prefix_blocks`, and the share of the prompt's characters those blocks cover (1.0 for a prompt of at most
    PREFIX_MAX_BLOCKS blocks): of its tokens, KV admission takes that share as what the blocks hold."""
    text = prompt_text(path, doc) if isinstance(doc, dict) else None
    if not text:
        return (), 0.0
    chain = hashlib.blake2b((salt or "").encode("utf-8", "surrogatepass"), digest_size=8)
    out = []
    covered = min(len(text), PREFIX_BLOCK_CHARS * PREFIX_MAX_BLOCKS)
    for start in range(0, covered, PREFIX_BLOCK_CHARS):
        chain.update(text[start:start + PREFIX_BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        out.append(int.from_bytes(chain.digest(), "big"))
    return tuple(out), covered / len(text)


def route_not_found(body: bytes) -> bool:
    """FastAPI's answer for a path it has no route for, `{"detail":"Not Found"}` (vLLM's own 404s, such as an
    unknown model, are OpenAI error envelopes)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("detail") == "Not Found" and "error" not in doc
