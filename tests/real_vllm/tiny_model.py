"""Build the real-engine tier's model: a tiny random-weight Llama and a small byte-level BPE tokenizer.

Deterministic (fixed seeds, fixed corpus), offline, a few seconds on a CPU. The shape is the smallest vLLM's
CPU attention serves: hidden 128, 2 layers, 2 attention heads of head_dim 64 (its CPU kernels need 64), one KV
head. The weights are random, so the text is noise, but every token, template and byte is real: vLLM
tokenizes, renders the chat template, schedules, caches and streams exactly as it would for a large model.

Run with the real-engine venv's Python: `python tests/real_vllm/tiny_model.py DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Renders every message's content verbatim, so `continue_final_message` can cut the rendered prompt right after
# the final assistant message (transformers looks for that content in the rendered text).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 2048
MAX_POSITIONS = 2048
SEED = 20261202
CORPUS_WORDS = (
    "the batch request gateway replica realtime latency token cache prefix tenant queue worker priority evict "
    "resume output input model server engine block memory schedule stream answer question hello world write "
    "story about a quick brown fox jumps over lazy dog one two three four five six seven eight nine ten "
    "summarize translate explain why how what when where which who shall will would could should must may"
).split()


def corpus(lines: int = 4000) -> list[str]:
    """A fixed pseudo-random text over a small vocabulary, with digits and punctuation, for the BPE merges."""
    state = SEED
    out = []
    for _ in range(lines):
        words = []
        for _ in range(12):
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
            words.append(CORPUS_WORDS[(state >> 33) % len(CORPUS_WORDS)])
        out.append(" ".join(words) + f", {state % 1000}. ")
    return out


def build_tokenizer(target: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(target))
    return len(fast)


def build_model(target: Path, vocab: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=1,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(target), safe_serialization=True)
    # No sampling defaults and no eos stop words beyond the tokenizer's: vLLM's own defaults apply.
    GenerationConfig(bos_token_id=0, eos_token_id=1).save_pretrained(str(target))


def build(target: Path) -> Path:
    target.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(target)
    build_model(target, vocab)
    (target / "holdback-tiny.json").write_text(json.dumps({"seed": SEED, "vocab": vocab}) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="directory to write the model and tokenizer into")
    args = parser.parse_args(argv)
    print(build(args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
