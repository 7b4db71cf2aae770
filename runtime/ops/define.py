"""How the op set's ops are registered: straight on the dispatcher, one kernel each.

`torch.library.custom_op` wraps every call in three Python layers (an autograd wrapper, a
version-counter bump for mutated arguments, an aliasing check on the result) that cost
15-50 us a call on CPU; a pass replay calls the op set dozens of times per step, and none
of those layers does anything for inference. So each op is defined here with the schema
`custom_op` would infer (`torch.library.infer_schema`, mutations annotated), its torch
reference registered as the CompositeExplicitAutograd kernel (every device, until
`cuda_kernels` registers a CUDA one) and a fake implementation for capture. The graphs,
schemas and packages are the same as with `custom_op`.
"""

from __future__ import annotations

from typing import Callable

import torch

from b12x_toolchain.runtime.ops.namespace import NAMESPACE

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
REFERENCES: dict[str, Callable] = {}
"""Each op's torch reference by op name: its kernel on the CPU (a caller that knows its tensors
are there may call it without dispatching again)."""


def reference_op(mutates_args: tuple[str, ...] = ()) -> Callable:
    """Decorator: define op `NAMESPACE::<function name>` with the function as its reference."""

    def define(fn: Callable) -> Callable:
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIBRARY.define(fn.__name__ + schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIBRARY.impl(fn.__name__, fn, "CompositeExplicitAutograd")
        REFERENCES[fn.__name__] = fn
        return fn

    return define


def fake_for(reference: Callable) -> Callable:
    """Decorator: the fake (shape-only) implementation of the op `reference` defines."""
    return torch.library.register_fake(f"{NAMESPACE}::{reference.__name__}", lib=_LIBRARY)
