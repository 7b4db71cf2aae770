"""`b12x recipe`: write recipes. `from-hf` turns a Hugging Face DeepSeek V4 or V4.1 config.json into one."""

from __future__ import annotations

from pathlib import Path

import click
import yaml

from b12x_toolchain.exporter.cli.common import fail


class _Dumper(yaml.SafeDumper):
    pass


def _represent_list(dumper, values):
    # Lists of numbers on one line, as the bundled recipes write them.
    flow = all(not isinstance(v, (dict, list)) for v in values)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", values, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def recipe_text(doc: dict, config_label: str, template_name: str) -> str:
    weights = ("# The weights section from its quantization_config: the formats its checkpoint stores.\n"
               if "weights" in doc else "")
    draft = ("# The draft pass's width is its dspark_block_size; the DSpark confidence threshold is the template's.\n"
             if doc["model"]["family"] == "deepseek_v41" else "")
    header = (f"# Made by `b12x recipe from-hf` from {config_label}: the model from that config,\n"
              f"# max_seq_len, init_seed, cache, passes and rewrites from recipe {template_name}.\n{draft}{weights}")
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


@click.group()
def recipe():
    """Write export recipes."""


@recipe.command("from-hf")
@click.argument("config_json", type=click.Path())
@click.option("--template", help="Recipe (bundled name or YAML path) giving max_seq_len, init_seed, cache, passes and "
                                 "rewrites; of the config's family. Default: dsv4-tiny, or dsv41-tiny for a V4.1 config.")
@click.option("--name", help="Recipe name; default: the checkpoint directory's name, lower-cased.")
@click.option("--max-seq-len", type=click.IntRange(min=1), help="Replace the template's max_seq_len.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), help="Write here instead of to stdout.")
def from_hf(config_json, template, name, max_seq_len, out_file):
    """Make a deepseek_v4 recipe from a Hugging Face DeepSeek V4 CONFIG_JSON (or its directory),
    or a deepseek_v41 one from a DeepSeek V4.1 config (model_type deepseek_v41, or any of its
    CSA2 / DSpark keys: kv_source_layer_ids, dspark_* ...), with its Engram layers.

    A quantized config.json (DeepSeek's FP8 quantization_config, FP4 routed experts) also
    gives the recipe's weights section, so `export --checkpoint` reads the checkpoint as
    stored; a quantization b12x cannot represent is refused, naming the key.
    """
    from b12x_toolchain.exporter.hf.config import HfConfigError, is_v41, read_config, recipe_from_hf_config, recipe_name
    from b12x_toolchain.exporter.recipe.loader import RecipeError, load_recipe, parse_recipe

    path = Path(config_json)
    label = f"{path.resolve().parent.name}/{path.name}" if not path.is_dir() else f"{path.resolve().name}/config.json"
    try:
        config = read_config(path)
        base = load_recipe(template or ("dsv41-tiny" if is_v41(config) else "dsv4-tiny"))
    except (RecipeError, HfConfigError) as exc:
        fail(str(exc))
    try:
        doc = recipe_from_hf_config(config, base, name or recipe_name(path), max_seq_len=max_seq_len)
    except HfConfigError as exc:
        fail(f"{config_json}: {exc}")
    text = recipe_text(doc, label, base.name)
    try:  # what is written must load as it is: parse it back before writing anything
        parse_recipe(text, file=out_file or "generated recipe")
    except RecipeError as exc:
        fail(str(exc))
    if out_file is None:
        click.echo(text, nl=False)
        return
    try:
        Path(out_file).write_text(text)
    except OSError as exc:
        fail(f"cannot write {out_file}: {exc.strerror or exc}")
    click.echo(f"wrote {out_file}", err=True)
