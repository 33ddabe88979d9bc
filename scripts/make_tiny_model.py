"""Write a tiny random Llama model and a tokenizer for it, for the contract and gateway tests.

Run with the engines' Python (it needs transformers, tokenizers and torch):
    .venv-engines/bin/python scripts/make_tiny_model.py DIR

The tokenizer is a byte-level BPE trained here on tests/data/tiny_tokenizer_corpus.txt (so
nothing is downloaded), with a chat template: vLLM serves chat with it, and a gateway that loads
the same directory tokenizes exactly as the engine does. The engine contract tests ignore it
(--skip-tokenizer-init; their prompts are token ids).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 512
CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "tiny_tokenizer_corpus.txt"
# Roles as special tokens, so a template's markup is a fixed number of tokens; begin and end
# take ids 1 and 2, the model's bos and eos (LlamaConfig's defaults).
SPECIAL_TOKENS = ["<|pad|>", "<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ '<|begin|>' }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def write_tokenizer(out: Path) -> None:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([str(CORPUS)], trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        # A wide MLP (about 100 MB of weights read per token) slows decoding to tens of tokens a
        # second. Narrower, the engine decodes hundreds a second and, on two cores, its API
        # server falls seconds behind: an abort sent while a generation runs arrives after it.
        # The attention layout (hence each block's KV bytes) is unchanged.
        intermediate_size=65536,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,  # the contract tests serve contexts up to the whole pool
    )
    LlamaForCausalLM(config).save_pretrained(out)
    write_tokenizer(out)
    print(f"tiny model and tokenizer written to {out}")


if __name__ == "__main__":
    main()
