"""RoPE in a DeepSeek V4 / V4.1 config.json: the rotary dimensions, the two RoPE bases (the
window layers' and the compressed layers') and the compressed layers' YaRN, read as
`transformers.DeepseekV4Config` reads them (`rope_parameters` nested or flat, the older
`rope_scaling`, the top-level `rope_theta`, `compress_rope_theta` and `partial_rotary_factor`).
"""

from __future__ import annotations

from b12x_toolchain.exporter.errors import HfConfigError
from b12x_toolchain.exporter.hf.config_values import Fields, as_float, as_int, choice, has_key, required_in

YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# Accepted and ignored, as transformers' V4 ignores them: it fixes attention_factor at 1.0
# (so mscale cannot matter) and reads `truncate` from a level V4 never writes it to.
YARN_IGNORED = {"mscale", "mscale_all_dim", "truncate"}


def read_rope_head_dim(f: Fields, head_dim: int) -> int:
    """partial_rotary_factor * head_dim, or the legacy qk_rope_head_dim; where both are given they must agree."""
    config = f.config
    rope_dim = source = None
    if has_key(config, "partial_rotary_factor"):
        factor = as_float(config["partial_rotary_factor"], "partial_rotary_factor")
        exact = head_dim * factor
        if abs(exact - round(exact)) > 1e-6:
            raise HfConfigError(f"partial_rotary_factor: {factor} * head_dim {head_dim} = {exact} is not a whole "
                                "number of dimensions")
        rope_dim, source = round(exact), "partial_rotary_factor"
    if has_key(config, "qk_rope_head_dim"):
        legacy = as_int(config["qk_rope_head_dim"], "qk_rope_head_dim")
        if rope_dim is not None and legacy != rope_dim:
            raise HfConfigError(f"qk_rope_head_dim: {legacy} disagrees with partial_rotary_factor * head_dim"
                                f" = {rope_dim}")
        rope_dim, source = legacy, source or "qk_rope_head_dim"
    if rope_dim is None:
        raise HfConfigError("partial_rotary_factor: missing from config.json (and no qk_rope_head_dim)")
    return f.set("rope_head_dim", rope_dim, source)


def _rope_sections(config: dict) -> tuple[dict, dict, str, str, bool]:
    """(main, compress, main key, compress key, nested): the two RoPE parameter sets as written."""
    for key in ("rope_parameters", "rope_scaling"):  # rope_scaling: the older name of the same flat dict
        given = config.get(key)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise HfConfigError(f"{key}: {given!r} is not an object")
        if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
            return given["main"], given["compress"], f"{key}.main", f"{key}.compress", True
        # Flat: transformers applies it to the compressed layers (the main RoPE is plain) and
        # overwrites its rope_theta and partial_rotary_factor from the top-level keys.
        flat = {k: v for k, v in given.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
        return {}, flat, f"{key}.main", key, False
    return {}, {}, "rope_parameters.main", "rope_parameters", False


def _theta(f: Fields, path: str, top: str, section: dict, where: str, nested: bool) -> None:
    """A RoPE base: nested sections win in transformers, the top-level key otherwise; both must agree."""
    config = f.config
    if nested and "rope_theta" in section:
        value = f.set(path, as_float(section["rope_theta"], f"{where}.rope_theta"), f"{where}.rope_theta")
        if has_key(config, top) and as_float(config[top], top) != value:
            raise HfConfigError(f"{top}: {config[top]} disagrees with {where}.rope_theta = {section['rope_theta']}")
        return
    value = f.read_float(path, top)
    if "rope_theta" in section and as_float(section["rope_theta"], f"{where}.rope_theta") != value:
        raise HfConfigError(f"{where}.rope_theta: {section['rope_theta']} disagrees with {top} = {config[top]}")


def read_rope(f: Fields, head_dim: int, rope_dim: int) -> None:
    """Both RoPE bases, and the compressed layers' YaRN (or none); plain RoPE in the window layers."""
    main, compress, main_key, compress_key, nested = _rope_sections(f.config)
    for section, where in ((main, main_key), (compress, compress_key)):
        if section.get("partial_rotary_factor") is not None:
            factor = as_float(section["partial_rotary_factor"], f"{where}.partial_rotary_factor")
            if abs(head_dim * factor - rope_dim) > 1e-6:
                raise HfConfigError(f"{where}.partial_rotary_factor: {factor} * head_dim {head_dim} disagrees with "
                                    f"rope_head_dim {rope_dim}")
    _theta(f, "rope_theta", "rope_theta", main, main_key, nested)
    _theta(f, "compress_rope_theta", "compress_rope_theta", compress, compress_key, nested)
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise HfConfigError(f"{main_key}.rope_type: {main.get('rope_type', main.get('type'))!r} is not supported; "
                            "b12x's window-only RoPE is plain ('default')")
    _unknown(main, main_key, ROPE_KEYS)
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        _unknown(compress, compress_key, ROPE_KEYS)
        f.set("yarn", None, compress_key)
        return
    choice(kind, f"{compress_key}.rope_type", ("default", "yarn"))
    _unknown(compress, compress_key, ROPE_KEYS | set(YARN_KEYS) | {"attention_factor"} | YARN_IGNORED)
    # The V4 reference never rescales cos/sin. transformers fills in attention_factor 1.0 for
    # a flat rope_parameters only; a nested one without it gets YaRN's mscale (about 1.28).
    factor = compress.get("attention_factor", None if nested else 1.0)
    if factor is None or isinstance(factor, bool) or factor != 1:
        raise HfConfigError(f"{compress_key}.attention_factor: {'missing' if factor is None else repr(factor)}; "
                            "b12x implements DeepSeek V4's YaRN, which does not rescale cos/sin (1.0)")
    yarn = {
        "factor": as_float(required_in(compress, "factor", compress_key), f"{compress_key}.factor"),
        "original_max_position_embeddings": as_int(
            required_in(compress, "original_max_position_embeddings", compress_key),
            f"{compress_key}.original_max_position_embeddings"),
        # transformers reads a missing (or zero) beta as the YaRN paper's 32 and 1
        "beta_fast": as_float(compress.get("beta_fast") or 32.0, f"{compress_key}.beta_fast"),
        "beta_slow": as_float(compress.get("beta_slow") or 1.0, f"{compress_key}.beta_slow"),
    }
    f.set("yarn", yarn, compress_key)


def _unknown(section: dict, where: str, allowed: set) -> None:
    for key in section:
        if key not in allowed:
            raise HfConfigError(f"{where}.{key}: not a RoPE parameter b12x implements")
