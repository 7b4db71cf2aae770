"""The model's tokenizer: byte-level BPE trained with the `tokenizers` library.

Byte-level pre-tokenization without a prefix space, a ByteLevel decoder and no normalizer,
so every text, whatever its characters, encodes and decodes back exactly. The special
tokens come first (ids 0, 1, 2): end of text (documents are separated by it, and it is the
default stop), DSpark's noise token, padding. `save_tokenizer` writes Hugging Face's
layout: tokenizer.json, and tokenizer_config.json with the chat template and the eos and
pad tokens; `b12x export --checkpoint` carries both into the package.

CHAT_TEMPLATE renders a conversation as Python comments headed by role, the form of text
the model reads in training, then opens the assistant's turn:

    # user:
    print the squares
    # assistant:
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|noise|>", "<|pad|>")
EOS_TOKEN, NOISE_TOKEN, PAD_TOKEN = SPECIAL_TOKENS
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m.role }}:\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")
TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"


def train_tokenizer(texts: Sequence[str], vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` tokens (special tokens and the 256 bytes
    included) trained on `texts`. BPE training is deterministic for the same texts; `seed`
    is accepted so every training step takes one, and must be an integer."""
    minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size {vocab_size!r}: expected an integer of at least {minimum} "
                         "(the special tokens and the 256 bytes)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed {seed!r}: expected an integer")
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: expected a non-empty sequence of strings")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def tokenizer_config(chat_template: str = CHAT_TEMPLATE) -> dict:
    """tokenizer_config.json's content, as Hugging Face checkpoints write it."""
    return {"chat_template": chat_template, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
            "tokenizer_class": "PreTrainedTokenizerFast"}


def save_tokenizer(tokenizer: Tokenizer, directory: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """Write tokenizer.json and tokenizer_config.json into `directory` (a checkpoint's folder)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TOKENIZER_FILE).write_text(tokenizer.to_str() + "\n", encoding="utf-8")
    text = json.dumps(tokenizer_config(chat_template), indent=2, sort_keys=True, ensure_ascii=False)
    (directory / CONFIG_FILE).write_text(text + "\n", encoding="utf-8")
