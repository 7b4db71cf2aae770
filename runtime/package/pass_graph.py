"""A pass's graph: its archive checked when the package is loaded, deserialised when first used.

Loading checks every graph archive (graph_archive.py: entries, graph JSON, allowed ops), so
a bad package is refused at load as before. Deserialising waits until something reads a
pass's program: a session that replays three passes of five, `b12x inspect` of a manifest
question, or a rank's inspection deserialise only what they read. Until then the checked
document is kept, not the archive bytes: what is deserialised is exactly what was checked.
"""

from __future__ import annotations

import io

import torch

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.graph_archive import check_archive, check_graph_ops
from b12x_toolchain.runtime.parallel.group import NAMESPACE as COLLECTIVES

DIRECT = "direct"  # graph_loader.py: built straight from the checked document
TORCH = "torch.export.load"  # torch's own deserialiser: kept to compare against (tests, benchmarks)
LOADERS = (DIRECT, TORCH)


class PassGraph:
    def __init__(self, file: str, data: bytes, loader: str = DIRECT):
        if loader not in LOADERS:
            raise ValueError(f"graph loader {loader!r}: expected one of {LOADERS}")
        self.file, self.loader = file, loader
        self._document = check_archive(file, data)
        # The archive is kept until the program is built: torch.export.load reads it, and once a
        # replay graph is built the parsed document (about 7 times the JSON's size) is dropped.
        self._data = data
        self._program = self._replay = None

    @property
    def deserialised(self) -> bool:
        return self._program is not None or self._replay is not None

    @property
    def program(self) -> torch.export.ExportedProgram:
        if self._program is None:
            self._program = self._deserialise()
            self._document = self._data = None
        return self._program

    @property
    def replay(self):
        """What a session replays: the program's graph module and calling spec (graph_loader.ReplayGraph).
        Built without described values when the program has not been read (a second or two less
        before the first token); the program itself, once it has been."""
        if self._program is not None:
            return self._program
        if self._replay is None:
            if self.loader != DIRECT:
                return self.program
            from b12x_toolchain.runtime.package.graph_loader import replay_graph

            self._replay = self._checked(lambda: replay_graph(self._document))
            self._document = None  # the program, if it is ever read, is built from the archive again
        return self._replay

    def _deserialise(self) -> torch.export.ExportedProgram:
        if self.loader == DIRECT:
            # Imported when first used: loading and checking a package builds no graph.
            from b12x_toolchain.runtime.package.graph_loader import exported_program

            # The archive is checked again if its document was dropped: what is built is what was checked.
            document = self._document if self._document is not None else check_archive(self.file, self._data)
            return self._checked(lambda: exported_program(document))
        return self._checked(lambda: torch.export.load(io.BytesIO(self._data)))

    def _checked(self, build):
        """What `build()` makes of the checked document, its ops checked again on the built graph."""
        try:
            built = build()
        except PackageError as exc:
            raise PackageError(f"{self.file}: {exc}") from None
        except Exception as exc:  # the checks passed it, the deserialiser did not: still bad input
            raise PackageError(f"{self.file}: torch.export could not load it "
                               f"({type(exc).__name__}: {str(exc)[:300]})") from None
        check_graph_ops(self.file, built.graph_module.graph)  # the second line: the loaded graph's targets
        return built

    def collective_call(self) -> tuple[str, str] | None:
        """(node name, op) of the first node calling a collective, read without deserialising."""
        built = self._program if self._program is not None else self._replay
        if built is not None:
            nodes = ((n.name, str(n.target)) for n in built.graph_module.graph.nodes if n.op == "call_function")
        else:
            nodes = ((n["name"], n["target"].removeprefix("torch.ops."))
                     for n in self._document["graph_module"]["graph"]["nodes"])
        return next(((name, op) for name, op in nodes if op.startswith(f"{COLLECTIVES}.")), None)


def load_graph(file: str, data: bytes, loader: str = DIRECT) -> torch.export.ExportedProgram:
    """One graph archive: its entries and JSON checked first, then deserialised, then its ops
    checked again on the loaded graph. Any refusal is a PackageError naming `file`."""
    return PassGraph(file, data, loader).program


def refuse_collectives(graphs: dict[str, PassGraph]) -> None:
    """A package for one device calls no collective: there is no group for it to run in."""
    for pass_name, graph in graphs.items():
        found = graph.collective_call()
        if found is not None:
            raise PackageError(f"graph {pass_name}: node {found[0]} calls {found[1]}, but the package "
                               "has no parallel mapping")
