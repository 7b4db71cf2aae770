"""`b12x serve` fuzzed through its own /openapi.json: every route's documented request body, and
the same bodies broken (unknown keys, wrong types, extreme and non-finite numbers, lone
surrogates, deep nesting, bodies that are not a JSON object, not JSON at all or too large),
some sent in chunks, plus wrong methods and unknown paths.

Whatever arrives, the server answers without a 5xx, every refusal is an OpenAI error body,
the connection stays open (the next requests go out on the same socket), the engine keeps
running (/health is ok) and a small valid completion right after is answered. Two servers:
the suite's small package (no tokenizer) and the shipped model (its text routes work).
Everything goes over one keep-alive connection per server, one request at a time.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from http_serving import start_server

# Marked shorter than it is: test_openai_surface (1 minute) exports the shipped package both need;
# started later, this module finds it made instead of waiting on the export with a core idle.
pytestmark = [pytest.mark.slow(minutes=0.55), pytest.mark.usefixtures("one_torch_thread")]

class Raw(str):
    """JSON text, sent as it is."""


# Numbers at the edges of what JSON and float64 hold, for every numeric field. A Raw value is
# sent as its JSON text: Python's json reads 1e999 as infinity, so the server must refuse it.
EXTREMES = (5e-324, -5e-324, -0.0, 1e308, -1e308, 2**64, -(2**63), Raw("1e999"), Raw("-1e999"))
NOT_NUMBERS = (Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("-1E+999"), Raw("1" + "0" * 5000))  # > int digits
LONE_SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff", "\ude00\ud83d")  # the last: a pair in the wrong order
DEPTHS = (33, 40, 1000, 100_000)  # the server allows 32 levels
NOT_OBJECTS = (b"", b" ", b"null", b"[]", b"0", b'"text"', b"{", b"}", b'{"prompt": [1]', b'{"prompt": [1]} x',
               b"\xff\xfe\xfd", b"\xef\xbb\xbf{}", b'{"prompt": "caf\xe9"}', b'{"a": 1, "a": 2}', b"NaN", b"1e999",
               b'"\\ud800"', b"[" * 100_000, json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode("utf-16"))
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")

PROBE = {"prompt": [1, 2], "max_tokens": 1}  # the valid completion sent after every fuzzed request
ALWAYS_SENT = frozenset({"max_tokens"})  # chat without it generates all the room left: slow on CPU
BASES = {  # the valid body each route's numeric fields are swept from
    "/v1/completions": {"prompt": [1, 2], "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def encode(value) -> str:
    """JSON text of `value`, Raw parts as they are; strings are ASCII, so lone surrogates become \\u escapes."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(encode(v) for v in value) + "]"
    return json.dumps(value, allow_nan=False)


def kind(value) -> str:
    for type_, name in ((Raw, "raw"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                        (list, "array"), (dict, "object")):
        if isinstance(value, type_):
            return name
    return "null"


# -- JSON Schema to strategies (what schemas.py uses) -------------------------------------------

def from_schema(schema: dict, overrides: dict, span: int, name: str | None = None) -> st.SearchStrategy:
    """Values `schema` describes; `overrides` replaces the strategy of named properties (to keep
    generation short: max_tokens 1..4, ...); an integer with a minimum and no maximum stays
    within `span` above it (token ids: a little more than the vocabulary)."""
    if name in overrides:
        return overrides[name]
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(alternative, overrides, span, name) for alternative in schema["anyOf"]])
    type_ = schema.get("type")
    if type_ == "object":
        return objects(schema, overrides, span)
    if type_ == "array":
        low = int(schema.get("minItems", 0))
        high = max(low, min(int(schema.get("maxItems", 3)), 3))
        return st.lists(from_schema(schema.get("items", {}), overrides, span), min_size=low, max_size=high)
    if type_ == "integer":
        low = schema.get("minimum")
        low = math.ceil(low) if low is not None else None
        if "exclusiveMinimum" in schema:
            low = math.floor(schema["exclusiveMinimum"]) + 1
        high = schema.get("maximum")
        high = math.floor(high) if high is not None else (low + span if low is not None else None)
        return st.integers(low, high)
    if type_ == "number":
        low = schema.get("exclusiveMinimum", schema.get("minimum"))
        high = schema.get("maximum")
        floats = st.floats(low, high, exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False)
        int_low = None if low is None else math.floor(low) + 1 if "exclusiveMinimum" in schema else math.ceil(low)
        int_high = None if high is None else math.floor(high)
        if int_low is not None and int_high is not None and int_low > int_high:
            return floats
        return floats | st.integers(int_low, int_high)
    if type_ == "string":
        low = int(schema.get("minLength", 0))
        return st.text(min_size=low, max_size=max(low, min(int(schema.get("maxLength", 12)), 12)))
    if type_ == "boolean":
        return st.booleans()
    if type_ == "null":
        return st.none()
    return json_values


def objects(schema: dict, overrides: dict, span: int) -> st.SearchStrategy:
    """Required properties (and ALWAYS_SENT ones), a few optional ones, and unknown keys only
    where additionalProperties allows them."""
    properties = schema.get("properties", {})
    always = [k for k in properties if k in schema.get("required", ()) or k in ALWAYS_SENT]
    optional = [k for k in properties if k not in always]

    @st.composite
    def build(draw):
        body = {k: draw(from_schema(properties[k], overrides, span, k)) for k in always}
        chosen = draw(st.lists(st.sampled_from(optional), unique=True, max_size=4)) if optional else []
        for k in chosen:
            body[k] = draw(from_schema(properties[k], overrides, span, k))
        if schema.get("additionalProperties", True) is not False:
            body |= draw(st.dictionaries(st.text(max_size=6).filter(lambda k: k not in properties), json_values,
                                         max_size=2))
        return body

    return build()


def numeric_paths(schema: dict, path: tuple = ()) -> list[tuple]:
    """Where a number may go in a body of `schema`: property names, and 0 for an array's item."""
    found = []
    if any(kind(v) in ("integer", "number") for v in schema.get("enum", ())) or \
            schema.get("type") in ("integer", "number"):
        found.append(path)
    for alternative in schema.get("anyOf", ()):
        found += numeric_paths(alternative, path)
    if schema.get("type") == "object":
        for name, sub in schema.get("properties", {}).items():
            found += numeric_paths(sub, path + (name,))
    if schema.get("type") == "array":
        found += numeric_paths(schema.get("items", {}), path + (0,))
    return list(dict.fromkeys(found))


def value_paths(value, path: tuple = ()) -> list[tuple]:
    """Every place inside a body (not the body itself)."""
    found = [path] if path else []
    if isinstance(value, dict):
        for k, v in value.items():
            found += value_paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += value_paths(v, path + (i,))
    return found


def get_path(body, path: tuple):
    for key in path:
        body = body[key]
    return body


def set_path(body, path: tuple, value):
    """`body` with `value` at `path`, making the containers on the way (an int key is a list index)."""
    if not path:
        return value
    node = body
    for key, below in zip(path, path[1:]):
        want = list if isinstance(below, int) else dict
        if isinstance(node, list):
            if key >= len(node):
                node.append(None)
                key = len(node) - 1
            if not isinstance(node[key], want):
                node[key] = want()
        elif not isinstance(node.get(key), want):
            node[key] = want()
        node = node[key]
    last = path[-1]
    if isinstance(node, list) and last >= len(node):
        node.append(value)
    else:
        node[last] = value
    return body


def nested(depth: int, as_object: bool) -> Raw:
    return Raw('{"a": ' * depth + "0" + "}" * depth) if as_object else Raw("[" * depth + "0" + "]" * depth)


# -- requests -----------------------------------------------------------------------------------

@dataclass
class Call:
    method: str
    path: str
    content: bytes | None = None
    headers: dict = field(default_factory=dict)
    how: str = "plain"  # what was done to the body
    route: str = ""  # the route, as /openapi.json names it: with `how`, the tally's key
    chunked: bool = False  # the body sent in pieces (Transfer-Encoding: chunked) instead of with a length

    def label(self) -> str:
        shown = "" if self.content is None else f" {self.content[:400]!r}" + ("..." if len(self.content) > 400 else "")
        return f"{self.method} {self.path} [{self.how}{', chunked' if self.chunked else ''}]{shown}"


def mutated(draw, body: dict, schema: dict, how: str):
    """`body` broken the way `how` names; the result may be Raw text as a whole."""
    body = copy.deepcopy(body)
    places = value_paths(body)
    if how == "unknown_key":
        for _ in range(draw(st.integers(1, 2))):
            body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
        return body
    if how == "wrong_type":
        path = draw(st.sampled_from(places)) if places else (draw(st.sampled_from(sorted(schema["properties"]))),)
        old = get_path(body, path) if places else None
        new = draw(json_values.filter(lambda v: kind(v) != kind(old) and not (v is None and path[-1] in ALWAYS_SENT)))
        return set_path(body, path, new)
    if how == "extreme":
        paths = numeric_paths(schema)
        if not paths:
            return set_path(body, (draw(st.text(max_size=6)),), draw(st.sampled_from(EXTREMES)))
        return set_path(body, draw(st.sampled_from(paths)), draw(st.sampled_from(EXTREMES + NOT_NUMBERS)))
    if how == "surrogate":
        lone = draw(st.sampled_from(LONE_SURROGATES))
        texts = [p for p in places if isinstance(get_path(body, p), str)]
        where = draw(st.sampled_from(["key", "model"] + (["text"] if texts else [])))
        if where == "key":
            body[draw(st.text(max_size=3)) + lone] = draw(json_values)
            return body
        path = draw(st.sampled_from(texts)) if where == "text" else ("model",)
        text = get_path(body, path) if where == "text" else ""
        at = draw(st.integers(0, len(text)))
        return set_path(body, path, text[:at] + lone + text[at:])
    if how == "deep":
        value = nested(draw(st.sampled_from(DEPTHS)), draw(st.booleans()))
        path = draw(st.sampled_from([()] + places + [(name,) for name in schema.get("properties", {})]))
        return set_path(body, path, value)
    raise AssertionError(how)


def body_calls(live: "Live", path: str, schema: dict, how: str) -> st.SearchStrategy:
    """Requests to a route that takes a body: a valid one, or one broken as `how` (HOWS) names."""
    valid = from_schema(schema, live.overrides, live.server.service.limits.vocab_size + 16)
    too_large = b'{"prompt": [' + b"1, " * (live.server.service.options.max_body_bytes // 3) + b"1]}"
    request_ids = st.none() | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=140) | \
        st.sampled_from(["", "a b", "x" * 129])

    @st.composite
    def build(draw):
        headers = {}
        if path in GENERATION_ROUTES:
            request_id = draw(request_ids)
            if request_id is not None:
                headers["X-Request-Id"] = request_id
        if draw(st.booleans()):
            headers["Content-Type"] = "application/json"
        chunked = draw(st.booleans())
        if how == "bad_body":
            content = draw(st.sampled_from(NOT_OBJECTS + (too_large,)) | st.binary(max_size=16) |
                           json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: encode(v).encode()))
            return Call("POST", path, content, headers, how, path, chunked)
        if how == "wrong_method":
            method = draw(st.sampled_from([m for m in METHODS if m != "POST"]))
            return Call(method, path, draw(st.none() | st.binary(max_size=16)), headers, how, path)
        body = draw(valid)
        if how != "valid":
            body = mutated(draw, body, schema, how)
        return Call("POST", path, encode(body).encode(), headers, how, path, chunked)

    return build()


def bodiless_calls(path: str, method: str) -> st.SearchStrategy:
    query = st.text(st.characters(codec="ascii", exclude_characters="#"), max_size=20).map(
        lambda q: "?" + httpx.QueryParams({"q": q, q: "1"}).__str__())
    return st.one_of(
        st.just(Call(method, path, route=path)),
        query.map(lambda q: Call(method, path + q, how="query", route=path)),
        st.tuples(st.sampled_from([m for m in METHODS if m != method]), st.none() | st.binary(max_size=16)).map(
            lambda mc: Call(mc[0], path, mc[1], how="wrong_method", route=path)))


def unknown_calls() -> st.SearchStrategy:
    segment = st.text(st.characters(codec="ascii", categories=["L", "N"], include_characters="-_."), min_size=1,
                      max_size=12)
    return st.tuples(st.sampled_from(METHODS), st.sampled_from(["/", "/v1/", "/v2/"]), segment).map(
        lambda t: Call(t[0], t[1] + t[2], b"{}" if t[0] != "GET" else None, how="unknown_path", route="?"))


# -- checks -------------------------------------------------------------------------------------

def send(http: httpx.Client, call: Call) -> httpx.Response:
    try:
        content = call.content
        if call.chunked and content:
            pieces = [content[i:i + 7] for i in range(0, min(len(content), 64), 7)] + [content[64:]]
            content = iter([piece for piece in pieces if piece])
        return http.request(call.method, call.path, content=content, headers=call.headers)
    except httpx.TransportError as exc:
        raise AssertionError(f"{call.label()}: the connection failed: {exc!r}") from None


def socket_of(response: httpx.Response):
    """The client's end of the connection that carried `response`, or None once it is closed."""
    stream = response.extensions.get("network_stream")
    try:
        return stream.get_extra_info("client_addr") if stream is not None else None
    except OSError:
        return None


def check_error(response: httpx.Response, what: str) -> None:
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"{what}: a {response.status_code} that is not JSON: {response.text[:300]!r}") from None
    assert isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], dict), \
        f"{what}: not an OpenAI error body: {body!r:.300}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, f"{what}: error fields {sorted(error)}"
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), \
        f"{what}: {error!r:.300}"
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), f"{what}: {error!r:.300}"


def expected_choices(body: dict, chat: bool) -> int:
    """How many choices a request the server accepted asks for: prompts times n."""
    prompt = body.get("prompt")
    single = chat or isinstance(prompt, str) or all(isinstance(t, int) for t in prompt)
    return (1 if single else len(prompt)) * (body.get("n") or 1)


def check_generation(call: Call, response: httpx.Response, what: str) -> None:
    """An accepted generation: its X-Request-Id, and choice by choice one finished answer (a stream
    too: each index once finished, usage last when asked, then [DONE]) that fits max_tokens."""
    sent = call.headers.get("X-Request-Id")
    got = response.headers.get("x-request-id", "")
    if sent and REQUEST_ID.fullmatch(sent):
        assert got == sent, f"{what}: X-Request-Id {got!r}, sent {sent!r}"
    else:
        assert got.startswith(("cmpl-", "chatcmpl-")), f"{what}: X-Request-Id {got!r}, sent {sent!r}"
    body, chat = json.loads(call.content), call.path == "/v1/chat/completions"
    limit = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens") or math.inf
    expected = set(range(expected_choices(body, chat)))
    ids, finished, usage = defaultdict(list), Counter(), None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"{what}: the stream ends {events[-2:]!r}"
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "error" not in chunk and usage is None, f"{what}: {event[:300]}"
            if not chunk["choices"]:
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                ids[choice["index"]] += choice["token_ids"]
                finished[choice["index"]] += choice["finish_reason"] is not None
        assert (usage is not None) == bool((body.get("stream_options") or {}).get("include_usage")), what
    else:
        answer = response.json()
        assert "error" not in answer, what
        for choice in answer["choices"]:
            ids[choice["index"]] += choice["token_ids"]
            finished[choice["index"]] += choice["finish_reason"] is not None
        usage = answer["usage"]
    assert set(ids) == expected and finished == Counter(expected), f"{what}: choices {dict(finished)}"
    assert body.get("echo") or all(len(i) <= limit for i in ids.values()), f"{what}: more than {limit} tokens"
    if usage is not None:
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], f"{what}: {usage}"


def check_answer(call: Call, response: httpx.Response) -> None:
    what = f"{call.label()} -> {response.status_code} {response.text[:300]!r}"
    assert response.status_code < 500, f"{what}: a server error"
    if response.status_code >= 400:
        check_error(response, what)
    elif response.status_code == 200 and call.path in GENERATION_ROUTES and call.method == "POST":
        check_generation(call, response, what)


def still_serving(http: httpx.Client, connection, after: str, probe: bool = True) -> None:
    """/health is ok and (with `probe`) a small completion is answered, both on `connection`."""
    health = send(http, Call("GET", "/health"))
    assert (health.status_code, health.json()) == (200, {"status": "ok"}), f"after {after}: /health {health.text}"
    assert socket_of(health) == connection, f"after {after}: /health went out on a new connection"
    if not probe:
        return
    probe = send(http, Call("POST", "/v1/completions", json.dumps(PROBE).encode()))
    assert probe.status_code == 200, f"after {after}: the probe got {probe.status_code} {probe.text[:300]}"
    assert len(probe.json()["choices"][0]["token_ids"]) == 1
    assert socket_of(probe) == connection, f"after {after}: the probe went out on a new connection"


def exchange(http: httpx.Client, call: Call) -> int:
    """Send `call`, check its answer and that the server still serves on the same connection."""
    response = send(http, call)
    check_answer(call, response)
    connection = socket_of(response)
    what = f"{call.label()} -> {response.status_code}"
    assert connection is not None and response.headers.get("connection", "").lower() != "close", \
        f"{what}: the server closed the connection"
    still_serving(http, connection, what)
    return response.status_code


# -- the servers --------------------------------------------------------------------------------

@dataclass
class Live:
    server: object
    http: httpx.Client
    spec: dict
    overrides: dict  # valid bodies stay small: max_tokens 1..4, ...
    tally: dict = field(default_factory=lambda: defaultdict(Counter))  # (route, how) -> statuses

    def routes(self) -> list[tuple[str, str, dict | None]]:
        """(path, METHOD, request body schema or None) of every operation /openapi.json lists."""
        return [(path, method.upper(), request_schema(operation))
                for path, operations in self.spec["paths"].items() for method, operation in operations.items()]


def request_schema(operation: dict) -> dict | None:
    return operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")


def live_server(package):
    server = start_server(package)
    # The client drops an idle connection after 2 s, before uvicorn's keep-alive of 5 s can
    # close it under a request: within one check the requests go out back to back.
    http = httpx.Client(base_url=server.url, timeout=120, limits=httpx.Limits(keepalive_expiry=2))
    try:
        spec = http.get("/openapi.json").raise_for_status().json()
        name = server.service.model_name
        overrides = {"max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4),
                     "n": st.integers(1, 2), "min_tokens": st.integers(0, 2),
                     "role": st.sampled_from(["user", "assistant", "system"]) | st.text(max_size=8),
                     "model": st.one_of(st.just(name), st.just(name), st.text(max_size=8))}
        yield Live(server, http, spec, overrides)
    finally:
        http.close()
        server.shutdown()


@pytest.fixture(scope="module")
def shipped(shipped_path):
    yield from live_server(shipped_path)


@pytest.fixture(scope="module")
def small(small_path):
    yield from live_server(small_path)


def fuzz(live: Live, calls: st.SearchStrategy, examples: int, explicit: tuple[Call, ...] = ()) -> None:
    """`examples` calls drawn from `calls`, after the `explicit` ones, each checked by exchange()."""
    def one(call: Call):
        note(call.label())
        status = exchange(live.http, call)
        live.tally[(call.route, call.how)][status] += 1

    for call in explicit:
        one = example(call)(one)
    settings(max_examples=examples, deadline=None, derandomize=True, database=None)(given(calls)(one))()


HOWS = ("valid", "unknown_key", "wrong_type", "extreme", "surrogate", "deep", "bad_body", "wrong_method")
EXAMPLES = {"valid": 4, "wrong_type": 3, "extreme": 3}  # per route that takes a body; 2 for the other HOWS


def test_openapi_documents_every_route(shipped):
    paths = {path: set(operations) for path, operations in shipped.spec["paths"].items()}
    assert paths.items() >= {"/v1/completions": {"post"}, "/v1/chat/completions": {"post"}, "/v1/models": {"get"},
                             "/tokenize": {"post"}, "/detokenize": {"post"}, "/tokenizer_info": {"get"},
                             "/health": {"get"}, "/metrics": {"get"}}.items()
    for path, method, schema in shipped.routes():
        assert (schema is not None) == (method == "POST"), f"{method} {path}"
        assert schema is None or schema["type"] == "object", path


def base_call(path: str) -> Call:
    return Call("POST", path, json.dumps(BASES.get(path, {})).encode(), how="valid", route=path)


@pytest.mark.parametrize("how", HOWS)
def test_fuzz_the_shipped_model(shipped, how):
    for path, method, schema in shipped.routes():
        if schema is not None:  # the valid ones start from the route's base body: the engine runs at least once
            explicit = (base_call(path),) if how == "valid" else ()
            fuzz(shipped, body_calls(shipped, path, schema, how), EXAMPLES.get(how, 2), explicit)
    if how == "valid":
        for route in GENERATION_ROUTES:
            assert shipped.tally[(route, how)][200], f"{route}: {dict(shipped.tally[(route, how)])}"


@pytest.mark.parametrize("how", HOWS)
def test_fuzz_the_package_without_a_tokenizer(small, how):
    """Token-id completions go through the engine; the other routes refuse (no tokenizer): a
    glance at them is enough."""
    for path, method, schema in small.routes():
        if schema is None or (path != "/v1/completions" and how not in ("valid", "wrong_type")):
            continue
        explicit = (base_call(path),) if how == "valid" else ()
        fuzz(small, body_calls(small, path, schema, how), EXAMPLES.get(how, 2) if path == "/v1/completions" else 1,
             explicit)
    if how == "valid":
        assert small.tally[("/v1/completions", how)][200], dict(small.tally[("/v1/completions", how)])


@pytest.mark.parametrize(("which", "examples"), [("shipped", 3), ("small", 2)])
def test_fuzz_routes_without_a_body(which, examples, request):
    """GET routes with and without a query string, other methods on them, and unknown paths."""
    live = request.getfixturevalue(which)
    for path, method, schema in live.routes():
        if schema is None:
            fuzz(live, bodiless_calls(path, method), examples)
    fuzz(live, unknown_calls(), examples)


def test_extreme_numbers_in_every_numeric_field(shipped):
    """Each numeric field of each route's body, one at a time, at each of EXTREMES: /health after
    each field, the probe completion after each route (the accepted ones ran in the engine)."""
    http = shipped.http
    for path, method, schema in shipped.routes():
        if schema is None:
            continue
        base = BASES.get(path, {})
        response = send(http, Call("POST", path, json.dumps(base).encode(), how="base"))
        assert response.status_code == 200, f"{path} {base}: {response.status_code} {response.text[:300]}"
        connection = socket_of(response)
        for where in numeric_paths(schema):
            for value in EXTREMES:
                call = Call("POST", path, encode(set_path(copy.deepcopy(base), where, value)).encode(),
                            how=f"{'.'.join(map(str, where))}={value}")
                response = send(http, call)
                check_answer(call, response)
                assert socket_of(response) == connection, f"{call.label()}: the server closed the connection"
            still_serving(http, connection, f"{path} {where}", probe=False)
        still_serving(http, connection, path)


def test_bodies_over_the_limit(shipped):
    """A body over max_body_bytes, declared by its length or sent in chunks, gets 413 and the
    connection stays open."""
    limit = shipped.server.service.options.max_body_bytes
    content = b'{"prompt": [' + b"1, " * (limit // 3) + b"1]}"
    for path, method, schema in shipped.routes():
        if schema is None:
            continue
        for chunked in (False, True):
            call = Call("POST", path, content, how="too_large", route=path, chunked=chunked)
            response = send(shipped.http, call)
            assert response.status_code == 413, call.label()
            check_error(response, call.label())
            still_serving(shipped.http, socket_of(response), call.label())
