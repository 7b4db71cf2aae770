"""Small-float arithmetic the KV-cache formats share: blocks, amax, E4M3 and E2M1 codes.

Plain vectorised torch, as the codecs that use it (codecs.py, dsv41.py).
"""

from __future__ import annotations

import torch

_F32_MAX = torch.finfo(torch.float32).max
_E4M3_MAX = 448.0
_E4M3_EMAX = 8
_E2M1_MAX = 6.0
_E2M1_EMAX = 2  # 6 = 1.5 * 2^2
# E2M1 magnitudes by code 0..7; codes 8..15 are the same with the sign bit set.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring E2M1 codes. A tie goes to the even code, so at
# midpoints above an even code the value must be strictly greater to move up,
# and at midpoints above an odd code reaching the midpoint is enough.
_E2M1_UP_IF_GT = (0.25, 1.25, 2.5, 5.0)  # above codes 0, 2, 4, 6
_E2M1_UP_IF_GE = (0.75, 1.75, 3.5)  # above codes 1, 3, 5


_TABLES: dict = {}
_VALUES = {
    "pow2": tuple(2.0 ** (i - 127) for i in range(255)) + (float("nan"),),
    "e2m1": _E2M1_VALUES + tuple(-v for v in _E2M1_VALUES),
}


def _table(name: str, device) -> torch.Tensor:
    """A float32 lookup table on `device`, built once per device.

    Building one from a Python list costs more than the lookup that uses it (tens of
    microseconds, several times per cache op). Tables are never written. Only plain
    tensors are kept, and none is handed out under a fake mode (it gets its own), so a
    tracing tensor never outlives its trace nor meets a real one.
    """
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return torch.tensor(_VALUES[name], dtype=torch.float32, device=device)
    key = (name, device)
    table = _TABLES.get(key)
    if table is None:
        table = torch.tensor(_VALUES[name], dtype=torch.float32, device=device)
        if type(table) is torch.Tensor:
            _TABLES[key] = table
    return table


def _pow2_table(device: torch.device) -> torch.Tensor:
    """float32 ``2^(i - 127)`` for i in 0..254 and NaN at 255 (the UE8M0 decode).

    Built from Python floats, which hold powers of two exactly (2^-127 is a
    float32 subnormal, still exact), so scaling never depends on a libm exp2.
    """
    return _table("pow2", device)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _block_amax(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax with inf -> float32 max and NaN ignored, any-NaN mask) per block."""
    nan = torch.isnan(xb).any(dim=-1)
    mag = torch.nan_to_num(xb.abs(), nan=0.0, posinf=_F32_MAX)
    return mag.amax(dim=-1), nan


def _e4m3_cast(v: torch.Tensor) -> torch.Tensor:
    """The bare cast; only ever called on values already inside [-448, 448]."""
    return v.to(torch.float8_e4m3fn).view(torch.uint8)


def _to_e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    # The clamp is explicit: what an out-of-range value becomes in the cast
    # (NaN or saturated) has differed between torch versions.
    return _e4m3_cast(v.clamp(-_E4M3_MAX, _E4M3_MAX))


def _e4m3_bytes_to_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def _mx_scales(xb: torch.Tensor, elem_emax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """OCP MX block scales of ``xb[..., nblocks, 32]`` for elements whose emax is ``elem_emax``.

    Returns (UE8M0 scale bytes, ``2^-e`` per block broadcastable against ``xb``, amax == 0
    mask, any-NaN mask). The scale byte is 0x00 for a zero block and 0xFF for a NaN block.
    """
    amax, nan = _block_amax(xb)
    # frexp is exact: amax = m * 2^k with m in [0.5, 1), so floor(log2 amax) = k - 1.
    _, k = torch.frexp(amax)
    e = (k.to(torch.int64) - 1 - elem_emax).clamp(-127, 127)
    # 2^-e; 127 - e is in [elem_emax, 254] (e <= 127 - elem_emax as amax < 2^128): never NaN.
    inv_scale = _pow2_table(xb.device)[127 - e].unsqueeze(-1)
    zero = amax == 0
    scale = torch.where(zero, 0, e + 127).to(torch.uint8)
    scale = torch.where(nan, 0xFF, scale).to(torch.uint8)
    return scale, inv_scale, zero, nan


def _mx_decode(elems: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``elems[..., nblocks, 32] * 2^(scale - 127)``; a 0xFF scale gives NaN for its block."""
    return elems * _pow2_table(scale.device)[scale.long()].unsqueeze(-1)


def _e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """Unsigned E2M1 code (0..7) of |q|, nearest with ties to even, saturating at 6."""
    # The clamp only states the saturation: every |q| above 5 already lands on code 7.
    a = q.abs().clamp(max=_E2M1_MAX)
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    # Loop over the 7 midpoints, not the elements: each step is one vector compare.
    for t in _E2M1_UP_IF_GT:
        code += (a > t).to(torch.uint8)
    for t in _E2M1_UP_IF_GE:
        code += (a >= t).to(torch.uint8)
    return code


def _pack_e2m1(q: torch.Tensor, negative: torch.Tensor, keep: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Packed nibble bytes ``[..., dim/2]`` of E2M1(q) with sign bit 0x8 where ``negative``.

    ``q``, ``negative`` and ``keep`` are per element in blocks; nibbles where ``keep`` is
    False are 0. ``shape`` is the row shape ``[..., dim]``.
    """
    nib = _e2m1_codes(q) | torch.where(negative, 0x8, 0).to(torch.uint8)
    nib = torch.where(keep, nib, 0).to(torch.uint8).reshape(shape)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def _unpack_e2m1(packed: torch.Tensor, block: int) -> torch.Tensor:
    """float32 E2M1 values ``[..., nblocks, block]`` of packed nibble bytes ``[..., dim/2]``."""
    dim = 2 * packed.shape[-1]
    nib = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], dim)
    lut = _table("e2m1", packed.device)
    return _blocks(lut[nib.long()], block)
