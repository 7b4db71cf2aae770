"""Helpers of the server tests: a server on a free loopback port, its metrics, the official client."""

from __future__ import annotations

from dataclasses import fields

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from b12x_toolchain.runtime.serving.http.server import Server
from b12x_toolchain.runtime.serving.http.service import ServeOptions, Service
from b12x_toolchain.runtime.serving.options import EngineOptions

ENGINE_FIELDS = {f.name for f in fields(EngineOptions)}


def serve_options(package, **options) -> ServeOptions:
    """ServeOptions from flat keywords: the engine's (EngineOptions fields) and the server's."""
    engine = {k: options.pop(k) for k in list(options) if k in ENGINE_FIELDS}
    return ServeOptions(str(package), EngineOptions(**engine), **options)


def start_server(package, grace_seconds: float = 5.0, **options) -> Server:
    """A server of `package` on a free port of 127.0.0.1, serving from a thread."""
    return Server(Service(serve_options(package, **options)), "127.0.0.1", 0, grace_seconds).start()


def client(server: Server, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def scrape(server: Server, api_key: str | None = None) -> dict:
    """/metrics as {(sample name, ((label, value), ...)): value}, parsed as Prometheus parses it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(server.url + "/metrics", headers=headers)
    response.raise_for_status()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def pages_in_use(samples: dict) -> dict[str, float]:
    return {dict(labels)["pool"]: value for (name, labels), value in samples.items() if name == "b12x_pages_in_use"}
