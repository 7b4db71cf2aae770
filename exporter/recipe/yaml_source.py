"""Safe YAML loading that remembers the line of every key and list item.

Recipes are small hand-written files, so an error must point at the line to edit.
PyYAML's constructors drop position marks, so this module composes the node graph
with ``SafeLoader`` (which keeps them) and converts the nodes to plain Python
itself, recording ``path -> line`` as it goes.  A path is a tuple of mapping keys
(str) and list indices (int); ``()`` is the document root.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["MAX_DOCUMENT_BYTES", "Lines", "Path", "YamlSourceError", "load_yaml"]

# A recipe is a few kilobytes; a cap keeps a mistaken or hostile input from
# tying up the parser.
MAX_DOCUMENT_BYTES = 1 << 20

Path = tuple[str | int, ...]
Lines = dict[Path, int]

# Only plain JSON-like values may appear; timestamps, sets, binary and custom tags would
# either leak odd types into the schema or run constructors nobody reviewed.
_ALLOWED_TAGS = {
    "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:str",
}


class YamlSourceError(Exception):
    """A problem with the YAML text itself; ``line`` is 1-based or None."""

    def __init__(self, message: str, line: int | None = None, path: Path = ()):
        super().__init__(message)
        self.message = message
        self.line = line
        self.path = path


def _line(node_or_event: Any) -> int:
    return node_or_event.start_mark.line + 1


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases while composing.

    Aliases make one node appear under several keys, which would make the
    reported line for an error ambiguous, and they enable "billion laughs"
    expansion; a recipe never needs them.
    """

    def compose_node(self, parent, index):  # type: ignore[override]
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise YamlSourceError("YAML anchors and aliases are not allowed in recipes", _line(event))
        return super().compose_node(parent, index)


# YAML 1.1 (what PyYAML implements) reads ``1e-6`` as a string because its float
# pattern needs a dot; accept the YAML 1.2 exponent form so eps values read naturally.
_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> tuple[Any, Lines]:
    """Parse one YAML document into plain Python plus a ``path -> line`` map."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_DOCUMENT_BYTES:
        raise YamlSourceError(
            f"document is {size} bytes; the limit is {MAX_DOCUMENT_BYTES} bytes (1 MiB)"
        )
    loader = None
    try:
        loader = _RecipeLoader(text)  # the reader already rejects control characters here
        loader.get_event()  # StreamStartEvent
        if loader.check_event(yaml.StreamEndEvent):
            raise YamlSourceError("document is empty; expected a mapping", 1)
        root = loader.compose_document()
        if not loader.check_event(yaml.StreamEndEvent):
            raise YamlSourceError(
                "found a second YAML document; a recipe is exactly one document",
                _line(loader.peek_event()),
            )
        lines: Lines = {(): _line(root)}
        return _convert(loader, root, (), lines), lines
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        detail = " ".join(str(p) for p in (exc.context, exc.problem) if p)
        raise YamlSourceError(
            f"YAML syntax error: {detail or 'invalid YAML'}",
            mark.line + 1 if mark is not None else None,
        ) from None
    except yaml.reader.ReaderError as exc:  # control characters and the like
        line = text[: exc.position].count("\n") + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise YamlSourceError(f"character U+{code:04X} is not allowed in YAML", line) from None
    except yaml.YAMLError as exc:
        raise YamlSourceError(f"YAML error: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _convert(loader: yaml.SafeLoader, node: yaml.Node, path: Path, lines: Lines) -> Any:
    if node.tag not in _ALLOWED_TAGS:
        raise YamlSourceError(f"unsupported YAML tag {node.tag!r}", _line(node), path)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlSourceError("mapping keys must be plain names", _line(key_node), path)
            # Keys are names, so take the text as written: YAML 1.1 would
            # otherwise turn keys such as ``no`` or ``on`` into booleans.
            key = key_node.value
            if key in out:
                first = lines[path + (key,)]
                raise YamlSourceError(
                    f"duplicate key {key!r} (first at line {first}, again at line {_line(key_node)})",
                    _line(key_node),
                    path + (key,),
                )
            lines[path + (key,)] = _line(key_node)
            out[key] = _convert(loader, value_node, path + (key,), lines)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            lines[path + (index,)] = _line(item)
            items.append(_convert(loader, item, path + (index,), lines))
        return items
    try:
        return loader.construct_object(node, deep=True)
    except (ValueError, KeyError, TypeError):  # e.g. ``!!int abc``
        raise YamlSourceError(
            f"cannot read {node.value!r} as {node.tag.rsplit(':', 1)[-1]}", _line(node), path
        ) from None
