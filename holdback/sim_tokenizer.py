"""The simulator's tokenizer and chat template: deterministic, reversible, and the same everywhere it is used.

`model_sim` tokenizes and renders chats with them; the gateway counts a `holdback sim` replica's prompts in
process with the same code (gateway/tokenization.py), so both always agree. `prompt_text` is the prompt a request body renders to, for
the processor's prefix plans and the gateway's prefix routing. Pure: no imports but `re` and holdback.contract.

Text is split as GPT-2-style tokenizers do: words and punctuation marks with at most one leading space,
and whitespace runs (a run before a word leaves its last space to the word, so a newline never merges with
the word after it: text continued after a chat header tokenizes as the model generated it). Any piece
longer than 6 UTF-8 bytes is cut into 6-byte pieces. A token id packs the piece's bytes
and its length into one integer below 2**53, so `decode(encode(text)) == text` and ids survive JSON
in any language. English prose comes out at roughly one token per short word, two per long word.
"""

from __future__ import annotations

import re

from holdback.contract import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, RESPONSES_ENDPOINT

MAX_PIECE_BYTES = 6
_PIECES = re.compile(r" ?\w+| ?[^\w\s]|\s+(?!\S)|\s+")


def _split_bytes(piece: bytes) -> list[bytes]:
    if len(piece) <= MAX_PIECE_BYTES:
        return [piece]
    out: list[bytes] = []
    start = 0
    while start < len(piece):
        end = min(start + MAX_PIECE_BYTES, len(piece))
        # never cut a multi-byte character: back off while the next byte is a continuation byte
        while end < len(piece) and end > start + 1 and (piece[end] & 0xC0) == 0x80:
            end -= 1
        out.append(piece[start:end])
        start = end
    return out


def piece_to_id(piece: bytes) -> int:
    return (int.from_bytes(piece, "big") << 3) | (len(piece) - 1)


def id_to_piece(token_id: int) -> bytes:
    length = (token_id & 0b111) + 1
    value = token_id >> 3
    if token_id < 0 or length > MAX_PIECE_BYTES or value >= 1 << (8 * length):
        return f"<|{token_id}|>".encode()
    return value.to_bytes(length, "big")


class Tokenizer:
    """`encode` for prompt counts, /tokenize and prefix hashing; `decode` for /detokenize."""

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for match in _PIECES.finditer(text):
            for piece in _split_bytes(match.group().encode("utf-8")):
                ids.append(piece_to_id(piece))
        return ids

    def count(self, text: str) -> int:
        """len(encode(text)) without building the ids: a piece of at most 6 characters that are all ASCII is
        one token; only longer or non-ASCII pieces are cut as encode cuts them."""
        pieces = _PIECES.findall(text)
        n = len(pieces)
        if text.isascii():  # one byte per character: a piece of L > 6 is cut into ceil(L / 6)
            return n + sum((len(p) - 1) // MAX_PIECE_BYTES for p in pieces if len(p) > MAX_PIECE_BYTES)
        for piece in pieces:
            if len(piece) > MAX_PIECE_BYTES or not piece.isascii():
                data = piece.encode("utf-8")
                if len(data) > MAX_PIECE_BYTES:
                    n += len(_split_bytes(data)) - 1
        return n

    def decode(self, token_ids: list[int]) -> str:
        return b"".join(id_to_piece(t) for t in token_ids).decode("utf-8", errors="replace")

    def token_strings(self, token_ids: list[int]) -> list[str]:
        return [id_to_piece(t).decode("utf-8", errors="replace") for t in token_ids]


# -- the chat template --------------------------------------------------------------------------------------
CHAT_ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


class ChatTemplateError(ValueError):
    """A chat the template cannot render; `param` names the request field to change (vLLM's 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


def chat_switches(body: dict) -> tuple[bool, bool]:
    """vLLM's `add_generation_prompt` (default true) and `continue_final_message` (default false) of a chat body."""
    add_generation_prompt = _switch(body, "add_generation_prompt", True)
    continue_final = _switch(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to true; "
                                "send \"add_generation_prompt\": false to continue the final message.",
                                "continue_final_message")
    return add_generation_prompt, continue_final


def _switch(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatTemplateError(f"\"{name}\" must be true or false, got {value!r}.", name)
    return value


def render_chat(messages, add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The simulator's chat template: one `<|role|>` header per message, then the assistant header.

    Continuing the final message leaves it open (no end of turn, no new assistant header), so the
    model writes on in the same message: how an interrupted assistant answer is resumed.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("\"messages\" is required: send a non-empty list of {\"role\", \"content\"} "
                                "objects.", "messages")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with \"role\" and \"content\".", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}.",
                                    "messages")
        parts.append(f"<|{role}|>\n{content_text(message.get('content'), i)}\n")
    if continue_final_message:
        parts[-1] = parts[-1][:-1]  # the final message stays open
    elif add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def content_text(content, index: int) -> str:
    """A message's content as the template renders it: a string, or its text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ChatTemplateError(
                    f"messages[{index}].content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                    "the simulator accepts text only.", "messages")
        return "\n".join(texts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts.", "messages")


# The content part types a Responses API message's text comes in; vLLM's chat parser reads each as text.
RESPONSES_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def responses_messages(body: dict) -> list[dict]:
    """A /v1/responses request as the chat vLLM renders it (its `construct_input_messages`): `instructions` a
    system message, a string `input` one user message, each input item with a `role` a message of its text
    (parts of RESPONSES_TEXT_PARTS). Items without a role (tool calls and their output, reasoning) are left out:
    the simulator models none of them. ChatTemplateError (param `input`) for an input of another shape."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str) and given:
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ChatTemplateError("\"input\" is required: a non-empty string, or a non-empty list of input items "
                                "such as {\"role\": \"user\", \"content\": \"...\"}.", "input")
    for i, item in enumerate(given):
        if not isinstance(item, dict) or "role" not in item:
            continue
        content = item.get("content")
        if isinstance(content, list):
            texts = [part.get("text") for part in content if isinstance(part, dict)
                     and part.get("type") in RESPONSES_TEXT_PARTS and isinstance(part.get("text"), str)]
            if len(texts) != len(content):
                raise ChatTemplateError(f"input[{i}].content parts must be {{\"type\": \"input_text\", \"text\": "
                                        "...}; the simulator accepts text only.", "input")
            content = [{"type": "text", "text": t} for t in texts]
        messages.append({"role": item["role"], "content": content})
    return messages


def prompt_text(path: str, body: dict) -> str | None:
    """The prompt a request body renders to (this template for a chat or a Responses request, the prompt of a
    completion), or None for a body with no text prompt to share (embeddings, token ids, several prompts, a chat
    the template refuses)."""
    try:
        if path == CHAT_ENDPOINT.path:
            return render_chat(body.get("messages"))
        if path == RESPONSES_ENDPOINT.path:
            return render_chat(responses_messages(body))
    except ChatTemplateError:
        return None
    if path == COMPLETIONS_ENDPOINT.path:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else None
    return None
