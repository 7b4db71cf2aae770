"""`b12x inspect`: what a package holds, and views of its graphs (text, Graphviz, ONNX)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from b12x_toolchain.exporter.cli import common
from b12x_toolchain.exporter.cli.common import fail


def _console() -> Console:
    """The shared console, or a wide one when the output is not a terminal (a file, a pipe):
    rows are what a reader greps for, and an 80-column default would cut names short."""
    shared = common.console
    return shared if shared.is_terminal else Console(width=max(shared.width, 160))


def _described(info) -> tuple[str, str, str]:
    """kind, owner (layer N / stage N) and rows (format x dims, /ratio) of a buffer's info; '-' where none applies."""
    if info is None:
        return "-", "-", "-"
    owner = f"layer {info.layer}" if info.layer is not None else f"stage {info.stage}" if info.stage is not None else "-"
    fmt = f"{info.format} x{info.dims}" if info.format else "-"
    if info.ratio not in (None, 1):
        fmt += f" /{info.ratio}"
    return info.kind, owner, fmt


def _table(title: str, columns: tuple[str, ...], rows, caption: str | None = None,
           no_wrap: tuple[str, ...] = ()) -> Table:
    """A table of `rows` under `columns`; the `no_wrap` ones hold what a reader greps for: never folded."""
    table = Table(title=title, caption=caption)
    for column in columns:
        table.add_column(column, no_wrap=column in no_wrap)
    for row in rows:
        table.add_row(*row)
    return table


def _pass_table(name: str, entry) -> Table:
    """A pass's inputs and outputs; its weights only counted, in the caption."""
    rows = [(spec.name, spec.role, spec.dtype, str(list(spec.shape)), _described(spec.info)[0])
            for spec in entry.inputs + entry.outputs if spec.role != "weight"]
    weights = sum(1 for s in entry.inputs if s.role == "weight")
    staged = f"; persists the staging of {entry.reads_staging_of}" if entry.reads_staging_of else ""
    return _table(f"pass {name}: width {entry.width}, rows buckets {list(entry.rows_buckets)}",
                  ("name", "role", "dtype", "shape", "kind"), rows,
                  caption=f"advances {entry.advances or '-'}{staged}; + {weights} weight inputs", no_wrap=("name",))


def _buffers_table(buffers: dict) -> Table:
    rows = []
    for name, info in buffers.items():
        kind, owner, described = _described(info)
        rows.append((name, kind, owner.replace("layer ", "L").replace("stage ", "S"), described))
    return _table("buffers: what each cache and staging buffer holds", ("name", "kind", "owner", "rows"), rows,
                  caption="owner: L target layer, S draft stage; rows: format x dims, /positions per row",
                  no_wrap=("name", "kind", "rows"))


def _rewrites_table(rewrites) -> Table:
    rows = [(pass_name, rewrite, str(r.matches), str(r.nodes_before), str(r.nodes_after))
            for pass_name, results in rewrites.results.items() for rewrite, r in results.items()]
    return _table(f"rewrites: {list(rewrites.pipeline) or 'none'}",
                  ("pass", "rewrite", "matches", "nodes before", "nodes after"), rows)


def _summary(manifest) -> None:
    """`manifest`: the typed Manifest (runtime/package/manifest.py)."""
    console = _console()
    console.print(f"[bold]{manifest.name}[/]  format {manifest.format_version}  op set {manifest.opset_version}"
                  f"  abi {manifest.abi_fingerprint}", highlight=False)
    parallel = manifest.parallel
    if parallel is not None:
        collectives = ", ".join(f"{name} {sum(counts.values())}" for name, counts in (parallel.collectives or {}).items())
        console.print(f"parallel: {parallel.describe()}; {len(parallel.splits)} weights split; collectives per "
                      f"rank: {collectives}", highlight=False)
    for name, entry in manifest.passes.items():
        console.print(_pass_table(name, entry))
    console.print(_buffers_table(manifest.buffers))
    console.print(_table("cache formats: whose bytes the caches hold", ("format", "convention"),
                         manifest.cache_formats.items(), no_wrap=("format", "convention"),
                         caption=f"records of flashinfer-python {manifest.versions['flashinfer_pin']}, "
                                 "the pinned release"))
    console.print(_rewrites_table(manifest.rewrites))
    if manifest.weights.external:
        tensors = manifest.weights.tensors
        checked = sum(1 for t in tensors.values() if t.sha256)
        console.print(f"weights: external, {len(tensors)} tensors ({checked} with sha256), bound at load time",
                      highlight=False)
    tokenizer = manifest.tokenizer
    if tokenizer is not None:
        template = "a chat template" if tokenizer.chat_template else "no chat template"
        console.print(f"tokenizer: {tokenizer.file}, eos {tokenizer.eos_token_id}, pad {tokenizer.pad_token_id}, "
                      f"{template}", highlight=False)
    console.print(_table("files", ("file", "sha256"), manifest.files.items()))


def _write_onnx(pkg, out_dir: str) -> None:
    import onnx

    from b12x_toolchain.exporter.views.onnx_view import graph_to_onnx

    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    for name, info in pkg.passes.items():
        model = graph_to_onnx(info.program.graph_module, info.inputs, info.outputs, name)
        onnx.checker.check_model(model)
        onnx.save(model, str(root / f"{name}.onnx"))
        click.echo(f"wrote {root / f'{name}.onnx'} ({len(model.graph.node)} nodes)")


@click.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--graph", "graph_pass", metavar="PASS", help="Print PASS's graph: one node per line, ops and shapes.")
@click.option("--dot", "dot_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="With --graph: write the graph as Graphviz to this file ('-': standard output) instead.")
@click.option("--onnx", "onnx_dir", type=click.Path(file_okay=False),
              help="Write an ONNX view of every pass to DIR/PASS.onnx (b12x ops in domain b12x).")
@click.option("--rank", type=click.IntRange(min=0), help="A parallel package's rank whose graphs to show [default: 0].")
def inspect(package, as_json, graph_pass, dot_path, onnx_dir, rank):
    """Show a package's passes, calling conventions, ABI fingerprint, rewrites and files."""
    from b12x_toolchain.runtime import PackageError, load
    from b12x_toolchain.runtime.package.reader import read_manifest

    if dot_path is not None and graph_pass is None:
        fail("--dot needs --graph PASS")
    try:
        parallel = read_manifest(package).parallel is not None
        # Every check but the process group's: inspecting a rank needs none.
        pkg = load(package, rank=(rank or 0) if parallel else rank, join_group=False)
    except PackageError as exc:
        fail(str(exc))
    if as_json:
        click.echo(json.dumps(pkg.manifest.to_json(), indent=2, sort_keys=True))
    elif graph_pass is not None:
        from b12x_toolchain.exporter.views.graph_text import graph_dot, graph_text

        if graph_pass not in pkg.passes:
            fail(f"no pass {graph_pass!r}; this package has {', '.join(sorted(pkg.passes))}")
        info = pkg.passes[graph_pass]
        render = graph_dot if dot_path is not None else graph_text
        text = render(info.program.graph_module, info.inputs, info.outputs, graph_pass)
        if dot_path not in (None, "-"):
            Path(dot_path).write_text(text)
            click.echo(f"wrote {dot_path}")
        else:
            click.echo(text, nl=False)
    elif onnx_dir is None:
        _summary(pkg.manifest)
    if onnx_dir is not None:
        _write_onnx(pkg, onnx_dir)
