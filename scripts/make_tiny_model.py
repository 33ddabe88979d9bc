"""Write a tiny random Llama model (weights and config only) for the engine contract tests.

Run with the engines' Python (it needs transformers and torch):
    .venv-engines/bin/python scripts/make_tiny_model.py DIR
vLLM serves it with --skip-tokenizer-init; prompts are token ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
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
    print(f"tiny model written to {out}")


if __name__ == "__main__":
    main()
