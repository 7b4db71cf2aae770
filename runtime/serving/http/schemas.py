"""The request bodies of /openapi.json: what each route takes, as JSON Schema.

The routes read their bodies themselves (protocol.py checks every field and names the one
it refuses), so these schemas describe; they do not validate. A field listed with a
single `enum` value is accepted only at that default.
"""

from __future__ import annotations

from b12x_toolchain.runtime.serving.http.protocol import MAX_CHOICES, MAX_LOGPROBS, MAX_STOP

INT, STR, BOOL, NUMBER = {"type": "integer"}, {"type": "string"}, {"type": "boolean"}, {"type": "number"}
TEXT = {"type": "string", "minLength": 1}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
STOP = {"anyOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": MAX_STOP},
                  {"type": "array", "items": INT, "maxItems": MAX_STOP}, {"type": "null"}]}
STREAM_OPTIONS = {"type": "object", "properties": {"include_usage": BOOL, "continuous_usage_stats": BOOL},
                  "additionalProperties": False}
SAMPLING = {
    "model": STR, "max_tokens": {"type": "integer", "minimum": 1}, "temperature": NUMBER | {"minimum": 0, "maximum": 2},
    "top_p": NUMBER | {"exclusiveMinimum": 0, "maximum": 1}, "seed": INT, "stop": STOP, "stream": BOOL,
    "stream_options": STREAM_OPTIONS, "user": STR, "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
    "ignore_eos": BOOL,
    "min_tokens": {"type": "integer", "minimum": 0}, "presence_penalty": {"enum": [0]},
    "frequency_penalty": {"enum": [0]}, "repetition_penalty": {"enum": [1]},
}
TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
             "properties": {"type": {"enum": ["text"]}, "text": STR}}
CONTENT = {"anyOf": [STR, {"type": "array", "items": TEXT_PART, "minItems": 1}]}
MESSAGES = {"type": "array", "minItems": 1,
            "items": {"type": "object", "required": ["role", "content"], "properties": {"role": STR, "content": CONTENT}}}


def _body(properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


COMPLETION = _body(SAMPLING | {
    "prompt": {"anyOf": [TEXT, TOKEN_IDS, {"type": "array", "items": TEXT, "minItems": 1},
                         {"type": "array", "items": TOKEN_IDS, "minItems": 1}]},
    "echo": BOOL, "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}, {"enum": [False]},
                                         {"type": "null"}]},
}, ["prompt"])
CHAT = _body(SAMPLING | {
    "messages": MESSAGES, "max_completion_tokens": {"type": "integer", "minimum": 1}, "logprobs": BOOL,
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
}, ["messages"])
TOKENIZE = _body({"model": STR, "prompt": STR, "messages": MESSAGES, "add_special_tokens": BOOL,
                  "add_generation_prompt": BOOL, "return_token_strs": BOOL}, [])
DETOKENIZE = _body({"model": STR, "tokens": {"type": "array", "items": INT}}, ["tokens"])
