"""A checkpoint's tokenizer, carried into the package: Hugging Face's tokenizer.json and,
when present, tokenizer_config.json (chat template, eos and pad tokens).

The files are copied as they are, under `tokenizer/`, and listed, hashed and checked at
load like every other file of the package; the manifest's `tokenizer` section records
what a server needs without parsing them (the eos and pad ids, whether there is a chat
template). They are read here with the runtime's own codec, so a tokenizer the runtime
could not use, or one with more tokens than the model's vocabulary, is refused at export.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from b12x_toolchain.runtime.package.checkpoint import CheckpointError
from b12x_toolchain.runtime.package.manifest_sections import TokenizerFacts
from b12x_toolchain.runtime.serving.text import CONFIG_FILE, TOKENIZER_FILE, TextCodec

PACKAGE_FOLDER = "tokenizer"
SIZE_LIMIT = 64 << 20  # bytes; a large vocabulary's tokenizer.json is a few tens of MiB


@dataclass(frozen=True)
class PackageTokenizer:
    files: dict[str, bytes]  # package file name -> bytes
    facts: TokenizerFacts  # the manifest's tokenizer section


def _read(path: Path) -> bytes:
    if path.is_symlink() or not path.is_file():
        raise CheckpointError(f"{path.name}: not a plain file")
    if path.stat().st_size > SIZE_LIMIT:
        raise CheckpointError(f"{path.name}: {path.stat().st_size} bytes, over the {SIZE_LIMIT} byte limit")
    return path.read_bytes()


def checkpoint_tokenizer(directory, vocab_size: int) -> PackageTokenizer | None:
    """The tokenizer of checkpoint `directory` for a model of `vocab_size` tokens; None when
    the directory has no tokenizer.json. A CheckpointError names the file at fault."""
    root = Path(directory)
    if not (root / TOKENIZER_FILE).exists():
        return None
    tokenizer = _read(root / TOKENIZER_FILE)
    config = _read(root / CONFIG_FILE) if (root / CONFIG_FILE).exists() else None
    try:
        codec = TextCodec.from_files(tokenizer, config)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if codec.vocab_size > vocab_size:
        raise CheckpointError(f"{TOKENIZER_FILE}: {codec.vocab_size} tokens, more than the model's vocab_size "
                              f"{vocab_size}; it would encode ids the model has no embedding for")
    names = {TOKENIZER_FILE: f"{PACKAGE_FOLDER}/{TOKENIZER_FILE}", CONFIG_FILE: f"{PACKAGE_FOLDER}/{CONFIG_FILE}"}
    files = {names[TOKENIZER_FILE]: tokenizer} | ({names[CONFIG_FILE]: config} if config is not None else {})
    facts = TokenizerFacts(names[TOKENIZER_FILE], names[CONFIG_FILE] if config is not None else None, codec.eos_id,
                           codec.pad_id, codec.chat_template is not None)
    return PackageTokenizer(files, facts)
