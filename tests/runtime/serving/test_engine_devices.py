"""Every tensor the serving path makes names its device.

A tensor factory called without `device=` (torch.full((rows,), width), torch.tensor(ids))
makes a CPU tensor. In a CUDA session that tensor then meets the session's CUDA tensors:
an op mixing them fails, or an assignment into a CUDA buffer copies it up and waits for
the device. On the CPU, where the suite runs, every such call works, so nothing else shows
it. Here a TorchFunctionMode records each tensor factory called by code in
runtime/serving/ and runtime/session/ during engine steps (torch's own calls and those of
pass graphs are not theirs), and each must pass `device=`. A host tensor made on purpose
says so: device="cpu". The *_like factories inherit their input's device and are not
counted.

The engines cover greedy and sampled speculative decoding, drafts ended by the drafter's
confidence (the small package's threshold is 0, so its manifest is given one above 0), and
prefix-cache hits that adopt shared pages.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode

from b12x_toolchain.runtime.package.reader import Package
from b12x_toolchain.runtime.prefix.cache import PrefixCache
from b12x_toolchain.runtime.serving import drafts as drafts_module
from b12x_toolchain.runtime.serving import engine as engine_module
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from conftest import random_tokens
from paths import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SERVING = Path(engine_module.__file__).resolve().parent
FOLDERS = (SERVING, SERVING.parent / "session")  # runtime/serving/ and runtime/session/
# Factories that make a tensor from nothing but sizes or host values: without `device=` it lands on the CPU.
FACTORIES = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.zeros, torch.ones, torch.empty,
             torch.empty_strided, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn,
             torch.randint, torch.randperm, torch.tril_indices, torch.triu_indices}


class FactoryCalls(TorchFunctionMode):
    """Records (call site, factory, whether it named a device) for factories called from FOLDERS."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            # A factory is a C function: the frame above this one is the code that called it.
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename).resolve()
            if any(path.is_relative_to(folder) for folder in FOLDERS):
                site = f"{path.relative_to(ROOT).as_posix()}:{caller.f_lineno}"
                self.calls.append((site, f"torch.{func.__name__}", _names_device(func, args, kwargs)))
        return func(*args, **kwargs)

    def sites(self, named: bool | None = None) -> list[str]:
        return sorted({f"{site} {factory}" for site, factory, has in self.calls if named is None or has == named})


def _names_device(func, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("device") is not None:
        return True
    if func is torch.as_tensor:  # as_tensor(data, dtype, device): a tensor's data keeps its device
        return isinstance(args[0] if args else kwargs.get("data"), torch.Tensor) or (len(args) > 2 and
                                                                                      args[2] is not None)
    return False


def _with_confidence_threshold(package, threshold: float) -> Package:
    model = dataclasses.replace(package.manifest.model, confidence_threshold=threshold)
    return Package(package.path, dataclasses.replace(package.manifest, model=model), package.passes, package.weights)


def _prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [random_tokens(gen, n) for n in (70, 9, 30, 5)[:count]]


def _serve(engine: Engine, requests: list[Request], calls: FactoryCalls) -> list:
    """Serve to completion with the recorder active during every step."""
    states = engine.submit(requests)
    while engine.busy:
        with calls:
            engine.step()
    return states


def greedy(package, calls):
    _serve(Engine(package.session(slots=3)), [Request(p, 5) for p in _prompts(4)], calls)


def sampled(package, calls):
    _serve(Engine(package.session(slots=3), temperature=0.8, seed=3), [Request(p, 5) for p in _prompts(4)], calls)


def confident_drafts(package, calls):
    variant = _with_confidence_threshold(package, 0.5)
    with mock.patch.object(drafts_module, "confident_lengths", wraps=drafts_module.confident_lengths) as spy:
        _serve(Engine(variant.session(slots=3)), [Request(p, 5) for p in _prompts(3)], calls)
    assert any("confidence" in c.args[0] and c.args[1].model.confidence_threshold > 0 for c in spy.call_args_list), \
        "the engine never cut drafts by the drafter's confidence"


def prefix_hits(package, calls):
    engine = Engine(package.session(slots=2), prefix_cache=PrefixCache(package))
    prompts = _prompts(2)
    _serve(engine, [Request(p, 4) for p in prompts], calls)
    again = _serve(engine, [Request(prompts[0], 4)], calls)
    assert again[0].cached_tokens == len(prompts[0]), "the repeated prompt should hit the prefix cache"


@pytest.mark.parametrize("serve", [greedy, sampled, confident_drafts, prefix_hits],
                         ids=["greedy", "sampled", "confident drafts", "prefix hits"])
def test_every_tensor_an_engine_step_makes_names_its_device(small_pkg, serve):
    calls = FactoryCalls()
    serve(small_pkg, calls)
    assert calls.calls, "no tensor factory call from the serving path was seen: is the recorder active?"
    implicit = calls.sites(named=False)
    assert not implicit, "tensor factories called without device= (they land on the CPU):\n" + "\n".join(implicit)


@pytest.mark.parametrize("threshold", [0.0, 0.5], ids=["no threshold", "threshold 0.5"])
def test_confident_lengths_names_the_device_of_what_it_makes(threshold):
    """Both branches of the draft lengths, on outputs built here: every draft kept (no
    threshold), or each row ended at its first token below the threshold."""
    confidence = torch.tensor([[0.9, 0.9, 0.1, 0.9], [0.9] * 4, [0.2] * 4])
    out = {"logits": torch.zeros(3, 4, 16), "confidence": confidence}
    manifest = SimpleNamespace(model=SimpleNamespace(confidence_threshold=threshold))  # what it reads
    calls = FactoryCalls()
    with calls:
        lengths = drafts_module.confident_lengths(out, manifest)
    assert [int(n) for n in lengths] == ([4, 4, 4] if threshold == 0 else [2, 4, 0])
    implicit = calls.sites(named=False)
    assert not implicit, "tensor factories called without device= (they land on the CPU):\n" + "\n".join(implicit)
