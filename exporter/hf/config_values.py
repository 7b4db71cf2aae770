"""Typed reads of a Hugging Face config.json's values, each refusal naming the key at fault
(an `HfConfigError`), and `Fields`, the recipe's model fields being built from them with the
key each came from."""

from __future__ import annotations

import math
from typing import Any

from b12x_toolchain.exporter.errors import HfConfigError


def has_key(config: dict, key: str) -> bool:
    return config.get(key) is not None


def required(config: dict, key: str, why: str = "") -> Any:
    if not has_key(config, key):
        raise HfConfigError(f"{key}: missing from config.json{why}")
    return config[key]


def as_int(value: Any, key: str, minimum: int = 1) -> int:
    # bool is an int in Python; `true` is never a size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise HfConfigError(f"{key}: {value!r} is not an integer")
    if value < minimum:
        raise HfConfigError(f"{key}: {value} is less than {minimum}")
    return value


def as_float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HfConfigError(f"{key}: {value!r} is not a positive number")
    return float(value)


def choice(value: Any, key: str, allowed: tuple) -> Any:
    if value not in allowed:
        raise HfConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


def as_list(value: Any, key: str) -> list:
    if not isinstance(value, list):
        raise HfConfigError(f"{key}: {value!r} is not a list")
    return value


def required_in(section: dict, key: str, where: str) -> Any:
    if section.get(key) is None:
        raise HfConfigError(f"{where}.{key}: missing from config.json")
    return section[key]


class Fields:
    """The model fields being built, each with the config key it was read from."""

    def __init__(self, config: dict):
        self.config, self.values, self.sources = config, {}, {}

    def set(self, path: str, value: Any, source: str) -> Any:
        self.values[path], self.sources[path] = value, source
        return value

    def read_int(self, path: str, key: str, minimum: int = 1) -> int:
        return self.set(path, as_int(required(self.config, key), key, minimum), key)

    def read_float(self, path: str, key: str) -> float:
        return self.set(path, as_float(required(self.config, key), key), key)
