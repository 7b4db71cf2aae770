"""The runtime's text codec: exact round trips, streaming that holds back half characters,
chat templates rendered in the sandbox, and clear errors for what it cannot use."""

from __future__ import annotations

import json

import pytest

from b12x_toolchain.exporter.train.tokenizer import CHAT_TEMPLATE, tokenizer_config, train_tokenizer
from b12x_toolchain.runtime.serving.text import TextCodec

MULTI_BYTE = "café: 中文 and 🙂🎉 — naïve ünïcödé\n"


@pytest.fixture(scope="module")
def tokenizer_json() -> bytes:
    return train_tokenizer(["def f(x):\n    return x + 1\n" * 20, MULTI_BYTE], vocab_size=300).to_str().encode()


def with_template(tokenizer_json: bytes, template: str) -> TextCodec:
    return TextCodec.from_files(tokenizer_json, json.dumps(tokenizer_config(template)).encode())


@pytest.fixture(scope="module")
def codec(tokenizer_json):
    return with_template(tokenizer_json, CHAT_TEMPLATE)


def test_ids_of_the_special_tokens(codec):
    assert (codec.eos_id, codec.pad_id, codec.chat_template) == (0, 2, CHAT_TEMPLATE)


@pytest.mark.parametrize("text", [MULTI_BYTE, "", "x<|endoftext|>y", "\x00\xff\u2028"])
def test_decode_gives_back_the_text(codec, text):
    assert codec.decode(codec.encode(text)) == text


def test_streaming_equals_the_full_decode(codec):
    ids = codec.encode(MULTI_BYTE * 2)
    stream = codec.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == codec.decode(ids) == MULTI_BYTE * 2
    assert "" in pieces  # some token ended inside a character and was held back
    assert all("\ufffd" not in piece for piece in pieces)


def test_an_unfinished_character_is_flushed_as_the_decode_shows_it(codec):
    ids = codec.encode("🙂")
    stream = codec.stream()
    assert [stream.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.flush() == codec.decode(ids[:-1])


def test_the_chat_template_renders(codec):
    messages = [{"role": "user", "content": "print the squares"}]
    assert codec.apply_chat_template(messages) == "# user:\nprint the squares\n# assistant:\n"
    assert codec.apply_chat_template(messages, add_generation_prompt=False) == "# user:\nprint the squares\n"


@pytest.mark.parametrize("template", ["{{ ''.__class__ }}", "{{ messages.__class__.__mro__ }}",
                                      "{{ cycler.__init__.__globals__ }}"])
def test_a_template_reaching_for_internals_is_refused(tokenizer_json, template):
    hostile = with_template(tokenizer_json, template)
    with pytest.raises(ValueError, match="chat template: SecurityError: access to attribute '__"):
        hostile.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_and_message_errors_are_named(codec, tokenizer_json):
    broken = with_template(tokenizer_json, "{% for %}")
    with pytest.raises(ValueError, match="chat template: TemplateSyntaxError"):
        broken.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\] .*expected an object with string 'role' and 'content'"):
        codec.apply_chat_template([{"role": "user"}])
    bare = TextCodec.from_files(tokenizer_json)
    assert bare.eos_id is None and bare.chat_template is None
    with pytest.raises(ValueError, match="this tokenizer has no chat_template"):
        bare.apply_chat_template([])


def test_bad_ids_and_files_are_named(codec, tokenizer_json):
    with pytest.raises(ValueError, match=r"token id 300: expected an integer in \[0, 300\)"):
        codec.decode([1, 300])
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer the tokenizers library reads"):
        TextCodec.from_files(b"{}")
    config = json.dumps({"eos_token": "<|nothing|>"}).encode()
    with pytest.raises(ValueError, match=r"ckpt/tokenizer.json: eos_token '<\|nothing\|>' is not a token"):
        TextCodec.from_files(tokenizer_json, config, source="ckpt")
    with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
        TextCodec.from_files(tokenizer_json, b"{,")
