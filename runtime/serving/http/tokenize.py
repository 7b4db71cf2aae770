"""/tokenize, /detokenize and /tokenizer_info, shaped as vLLM's (lm-eval's remote tokenizer
reads them: `eos_token` from /tokenizer_info, `tokens` from /tokenize, `prompt` from
/detokenize)."""

from __future__ import annotations

from b12x_toolchain.runtime.serving.http.errors import bad_request, no_tokenizer
from b12x_toolchain.runtime.serving.http.protocol import Limits, chat_ids, check_fields
from b12x_toolchain.runtime.serving.requests import is_int


def tokenize(body, codec, limits: Limits) -> dict:
    """{prompt} or {messages}: their ids; add_special_tokens adds none (this tokenizer's post-
    processor has no template) and is accepted either way."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                         "return_token_strs"), ())
    if codec is None:
        raise no_tokenizer("prompt")
    for name in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be true or false, got {body[name]!r}", name)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("send either prompt (a string) or messages", "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad_request(f"prompt must be a string, got {body['prompt']!r:.80}", "prompt")
        ids = codec.encode(body["prompt"])
    else:
        ids = chat_ids(body["messages"], codec)
    strs = [codec.token(i) for i in ids] if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": limits.max_seq_len, "tokens": ids, "token_strs": strs}


def detokenize(body, codec) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, ("model", "tokens"), ())
    if codec is None:
        raise no_tokenizer("tokens")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise bad_request("tokens must be a list of integer token ids", "tokens")
    try:
        return {"prompt": codec.decode(tokens)}
    except ValueError as exc:
        raise bad_request(str(exc), "tokens", "invalid_token_id") from None


def tokenizer_info(codec, limits: Limits) -> dict:
    if codec is None:
        raise no_tokenizer("tokenizer")
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": codec.token(codec.eos_id),
            "pad_token": codec.token(codec.pad_id), "bos_token": None, "chat_template": codec.chat_template,
            "model_max_length": limits.max_seq_len, "vocab_size": codec.vocab_size}
