"""The layers of a DeepSeek V4 / V4.1 config.json: each target layer's compression ratio (V4's
layer kinds and rates, V4.1's ratios themselves), the hash-routed layers, V4.1's CSA2 source
layers and its DSpark drafter, each field with the key it came from.
"""

from __future__ import annotations

from b12x_toolchain.exporter.errors import HfConfigError
from b12x_toolchain.exporter.hf.config_values import Fields, as_int, as_list, choice, has_key, required

CSA, HCA, WINDOW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# transformers' own table for the legacy per-layer `compress_ratios`: the number picks the
# layer kind, and the kind's rate then comes from `compress_rates`.
LEGACY_RATIO_KINDS = {0: WINDOW, 4: CSA, 128: HCA}
V41_RATIOS = (0, 1, 2)


def _kind_rates(config: dict) -> dict[str, tuple[int, str]]:
    """compress_rates (and its legacy scalars) as {layer kind: (rate, key)}."""
    rates = {}
    if has_key(config, "compress_rates"):
        given = config["compress_rates"]
        if not isinstance(given, dict):
            raise HfConfigError(f"compress_rates: {given!r} is not an object")
        for kind, rate in given.items():
            choice(kind, "compress_rates", (CSA, HCA))
            rates[kind] = (as_int(rate, f"compress_rates.{kind}"), f"compress_rates.{kind}")
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if has_key(config, legacy):  # transformers lets the legacy scalars override the dict
            rates[kind] = (as_int(config[legacy], legacy), legacy)
    return rates


def _rates(f: Fields) -> dict[str, int]:
    rates = _kind_rates(f.config)
    for kind, path in ((CSA, "csa_ratio"), (HCA, "hca_ratio")):
        if kind not in rates:
            raise HfConfigError(f"compress_rates.{kind}: missing from config.json")
        f.set(path, *rates[kind])
    return {WINDOW: 0, CSA: rates[CSA][0], HCA: rates[HCA][0]}


def _layer_types(config: dict, layers: int) -> list[str]:
    kinds = as_list(config["layer_types"], "layer_types")
    if len(kinds) != layers:
        raise HfConfigError(f"layer_types: has {len(kinds)} entries; num_hidden_layers is {layers}")
    for i, kind in enumerate(kinds):
        choice(kind, f"layer_types[{i}]", (WINDOW, CSA, HCA))
    return kinds


def read_v4_ratios(f: Fields, layers: int, stages: int) -> list[int]:
    """V4's per-layer ratios: each layer's kind (`layer_types`, or the legacy `compress_ratios`) at its rate."""
    config, rates = f.config, _rates(f)
    if has_key(config, "layer_types"):
        kinds, source = _layer_types(config, layers), "layer_types"
    elif has_key(config, "compress_ratios"):
        legacy = as_list(config["compress_ratios"], "compress_ratios")
        if len(legacy) not in (layers, layers + stages):
            raise HfConfigError(f"compress_ratios: has {len(legacy)} entries; expected num_hidden_layers = {layers}"
                                f" (or {layers + stages} with the MTP stage)")
        kinds = []
        for i, ratio in enumerate(legacy):
            key = f"compress_ratios[{i}]"
            if i >= layers:  # the MTP stage's own entry: b12x's MTP stage attends its window only
                if ratio != 0:
                    raise HfConfigError(f"{key}: the MTP stage's entry is {ratio!r}; b12x's MTP stage is "
                                        "window-only (0)")
                continue
            kinds.append(LEGACY_RATIO_KINDS[choice(as_int(ratio, key, 0), key, tuple(LEGACY_RATIO_KINDS))])
        source = "compress_ratios"
    else:
        raise HfConfigError("layer_types: missing from config.json (and no legacy compress_ratios)")
    return f.set("compress_ratios", [rates[kind] for kind in kinds] + [0] * stages, source)


def read_v41_ratios(f: Fields, layers: int, stages: int) -> list[int]:
    """V4.1's per-layer ratios from `compress_ratios` (the ratios themselves) or `layer_types`
    with `compress_rates`; where both are given they must agree."""
    config = f.config
    ratios = source = None
    if has_key(config, "layer_types"):
        kinds, rates = _layer_types(config, layers), _kind_rates(config)
        for kind in (CSA, HCA):
            if kind in kinds and kind not in rates:
                raise HfConfigError(f"compress_rates.{kind}: missing from config.json (layer_types has {kind})")
            if kind in rates:
                choice(rates[kind][0], rates[kind][1], V41_RATIOS[1:])
        ratios, source = [0 if kind == WINDOW else rates[kind][0] for kind in kinds], "layer_types"
    if has_key(config, "compress_ratios"):
        given = as_list(config["compress_ratios"], "compress_ratios")
        if len(given) not in (layers, layers + stages):
            raise HfConfigError(f"compress_ratios: has {len(given)} entries; expected num_hidden_layers = {layers}"
                                f" (or {layers + stages} with the {stages} DSpark stages)")
        for i, ratio in enumerate(given):
            key = f"compress_ratios[{i}]"
            if i >= layers:  # a DSpark stage's entry: the stages attend their window only
                if ratio != 0 or isinstance(ratio, bool):
                    raise HfConfigError(f"{key}: DSpark stage {i - layers}'s entry is {ratio!r}; draft stages are "
                                        "window-only (0)")
                continue
            choice(as_int(ratio, key, 0), key, V41_RATIOS)
        if ratios is not None and given[:layers] != ratios:
            raise HfConfigError(f"compress_ratios: {given[:layers]} disagrees with layer_types and compress_rates,"
                                f" which give {ratios}")
        ratios, source = given[:layers], source or "compress_ratios"
    if ratios is None:
        raise HfConfigError("compress_ratios: missing from config.json (and no layer_types)")
    return f.set("compress_ratios", [*ratios, *[0] * stages], source)


def _layer_ids(f: Fields, path: str, key: str, layers: int) -> list[int]:
    """A list of distinct target layer ids in increasing order, each below num_hidden_layers."""
    ids = as_list(required(f.config, key, " (a DeepSeek V4.1 config)"), key)
    values = [as_int(v, f"{key}[{i}]", 0) for i, v in enumerate(ids)]
    if not values or values != sorted(set(values)):
        raise HfConfigError(f"{key}: {ids!r}; expected distinct layer ids in increasing order")
    for i, layer in enumerate(values):
        if layer >= layers:
            raise HfConfigError(f"{key}[{i}]: layer {layer} is out of range; num_hidden_layers is {layers}")
    return f.set(path, values, key)


def read_csa2(f: Fields, layers: int) -> None:
    """V4.1's CSA2 source layers, and its hierarchical candidates where a candidate source is given."""
    config = f.config
    _layer_ids(f, "csa2.kv_source_layer_ids", "kv_source_layer_ids", layers)
    _layer_ids(f, "csa2.index_source_layer_ids", "index_source_layer_ids", layers)
    candidate = "candidate_source_layer_id"
    if has_key(config, candidate):
        layer = f.set(f"csa2.{candidate}", as_int(config[candidate], candidate, 0), candidate)
        if layer >= layers:
            raise HfConfigError(f"{candidate}: layer {layer} is out of range; num_hidden_layers is {layers}")
    why = f" ({candidate} is given)" if has_key(config, candidate) else ""
    for key in ("candidate_topk_blocks", "candidate_block_size"):
        if why or has_key(config, key):  # without a candidate source they keep no candidates, but are kept as given
            f.set(f"csa2.{key}", as_int(required(config, key, why), key), key)


def read_dspark(f: Fields, layers: int, stages: int) -> None:
    """The DSpark drafter: its own keys, and the target's for the MoE fields it has no key of."""
    f.set("draft.stages", stages, "num_nextn_predict_layers")
    _layer_ids(f, "draft.target_layer_ids", "dspark_target_layer_ids", layers)
    f.set("draft.noise_token_id", as_int(required(f.config, "dspark_noise_token_id"), "dspark_noise_token_id", 0),
          "dspark_noise_token_id")
    f.read_int("draft.markov_rank", "dspark_markov_rank")
    f.read_int("draft.moe.experts", "dspark_n_routed_experts")
    f.read_int("draft.moe.experts_per_token", "dspark_num_experts_per_tok")
    for field in ("shared_experts", "intermediate_size", "scoring", "routed_scaling_factor", "swiglu_limit"):
        f.set(f"draft.moe.{field}", f.values[f"moe.{field}"], f.sources[f"moe.{field}"])


def dspark_block_size(config: dict) -> int:
    """DSpark's trained block, anchor and noise tokens together: the draft pass's width."""
    return as_int(required(config, "dspark_block_size", " (a DeepSeek V4.1 config)"), "dspark_block_size")


def read_hash_layers(f: Fields, layers: int) -> int:
    """How many leading layers route by hash (`mlp_layer_types`, or the legacy `num_hash_layers`)."""
    config = f.config
    if has_key(config, "mlp_layer_types"):
        kinds = as_list(config["mlp_layer_types"], "mlp_layer_types")
        if len(kinds) != layers:
            raise HfConfigError(f"mlp_layer_types: has {len(kinds)} entries; num_hidden_layers is {layers}")
        hashed = 0
        for i, kind in enumerate(kinds):
            choice(kind, f"mlp_layer_types[{i}]", ("hash_moe", "moe"))
            if kind == "hash_moe":
                if hashed != i:  # the recipe has one count: hash routing in the leading layers only
                    raise HfConfigError(f"mlp_layer_types[{i}]: hash_moe follows a moe layer; b12x supports "
                                        "hash-routed layers only before all routed ones")
                hashed += 1
        return f.set("moe.hash_layers", hashed, "mlp_layer_types")
    if has_key(config, "num_hash_layers"):
        return f.set("moe.hash_layers", min(layers, as_int(config["num_hash_layers"], "num_hash_layers", 0)),
                     "num_hash_layers")
    raise HfConfigError("mlp_layer_types: missing from config.json (and no legacy num_hash_layers)")
