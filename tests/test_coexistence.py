"""This project and FlashInfer installed in one fresh environment, as a new user gets them.

flashinfer-python's wheel ships a top-level `b12x` package (a shim onto its own kernels), the
name this project once imported as. One fresh venv gets both real wheels, FlashInfer first (the
order a vLLM environment has), and the test checks that the two wheels' files are disjoint,
that neither touched the other's files and that both still work. Disjoint files make the order
moot: whichever wheel comes second has no file of the first to write over, so the other order
would check nothing more. The same venv then runs this project with the repository root as the
working directory, where a checkout's folders come first on sys.path.
torch and the other dependencies come from the dev venv through a .pth file, because
installing them into every fresh venv would take minutes.
"""

from __future__ import annotations

import base64
import csv
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from b12x_toolchain.exporter.pipeline.reexport import differences
from b12x_toolchain.runtime.formats.dsv41 import FLASHINFER_PIN
from paths import ROOT

pytestmark = pytest.mark.slow(minutes=0.4)  # the module's time on two busy cores: longest runs first

OURS = "b12x_toolchain"  # the dist-info prefix of b12x-toolchain
FLASHINFER = "flashinfer_python"  # the dist-info prefix of flashinfer-python
# The dev venv's uv (the Makefile installs it) builds and installs: the same files pip writes, in a
# third of the time.
UV = Path(sys.executable).parent / "uv"


def test_manifest_flashinfer_pin_is_the_test_environments_and_not_the_cuda_extras():
    # FlashInfer is only the byte reference: a pin in the cuda extra would refuse to install beside
    # an engine (vLLM) that brings another. Packages record FLASHINFER_PIN as versions.flashinfer_pin;
    # the record tests compare against it, and the Makefile installs it for them.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cuda_extra = project["optional-dependencies"]["cuda"]
    assert "flashinfer-python" not in {canonicalize_name(Requirement(req).name) for req in cuda_extra}, cuda_extra
    makefile = (ROOT / "Makefile").read_text()
    assert f"FLASHINFER ?= flashinfer-python=={FLASHINFER_PIN}\n" in makefile


def run_quietly(*command, failure: str = "", **kwargs) -> subprocess.CompletedProcess:
    """Run a command with its output captured, and show that output only if it fails."""
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        pytest.fail(f"{failure}{' '.join(map(str, command))} exited {result.returncode}\n"
                    f"--- stdout\n{result.stdout[-5000:]}\n--- stderr\n{result.stderr[-5000:]}", pytrace=False)
    return result


# The FlashInfer release the Makefile installs and the manifest records, by name from the index as
# the Makefile installs it: uv then links the files it unpacked into its cache once, where a wheel
# file at a new path every run (downloaded into the run's temporary folder) is unpacked anew,
# ~15,000 files and 700 MB more in uv's cache each time.
FLASHINFER_REQUIREMENT = f"flashinfer-python=={FLASHINFER_PIN}"


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory) -> Path:
    # Built from a copy of the tree: setuptools writes build/ and *.egg-info beside the sources,
    # and a build/lib left from an earlier build would carry deleted modules into this wheel.
    # The ignored folders hold nothing the wheel takes, and .venv-clients (the client tests'
    # venvs) is over a gigabyte.
    source = tmp_path_factory.mktemp("source") / "b12x-toolchain"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".hypothesis", ".pytest_cache", ".ruff_cache", "__pycache__", "build", "dist",
        "*.egg-info", "out", "*.b12x"))
    wheel_dir = tmp_path_factory.mktemp("project-wheel")
    run_quietly(UV, "build", "--quiet", "--wheel", "--out-dir", wheel_dir, source)
    (wheel,) = wheel_dir.glob(f"{OURS}-*.whl")
    return wheel


def record_paths_and_hashes(site_packages: Path, dist: str) -> dict[Path, str]:
    """The files an installed distribution's RECORD lists (resolved), each with its recorded hash."""
    (record,) = site_packages.glob(f"{dist}-*.dist-info/RECORD")
    # Installers write a wheel's files as regular files, never links, so a file resolves as its
    # folder does: each folder resolved once, rather than each of FlashInfer's ~15,000 files, is a
    # quarter of the time.
    resolved = functools.cache(Path.resolve)
    with record.open(newline="") as rows:
        return {resolved((site_packages / path).parent) / Path(path).name: digest
                for path, digest, _size in csv.reader(rows)}


def record_digest(path: Path) -> str:
    """A file's hash as RECORD writes it: sha256, urlsafe base64 without padding."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def damaged_files(listed: dict[Path, str]) -> list[str]:
    damaged = []
    for path, digest in listed.items():
        if not path.is_file():
            damaged.append(f"{path}: missing")
        elif digest and record_digest(path) != digest:  # RECORD lists itself with no hash
            damaged.append(f"{path}: changed")
    return damaged


# What `import b12x_toolchain` finds in the fresh venv, and whether the dev venv's editable install
# (an import hook its __editable__ .pth would install) came along through the .pth path; given
# arguments, the same process then runs them as the `b12x` console script would (torch's import,
# most of a small command's time, paid once for both).
IMPORT_PROBE = """
import json, sys
import b12x_toolchain
from b12x_toolchain.runtime import load
print(json.dumps({"file": b12x_toolchain.__file__,
                  "editable_hooks": sorted(m for m in sys.modules if m.startswith("__editable__"))}), flush=True)
if sys.argv[1:]:
    from b12x_toolchain.exporter.cli.main import main
    main(sys.argv[1:], prog_name="b12x")
"""


@dataclass(frozen=True)
class FreshVenv:
    python: Path
    scripts: Path
    site_packages: Path
    env: dict[str, str]


def fresh_venv(tmp_path: Path, *wheels: Path | str) -> FreshVenv:
    """A new venv with these wheels (files, or requirements on the index) installed in this order,
    without their dependencies; torch and the rest come from the dev venv through a .pth file
    written after the installs."""
    venv = tmp_path / "venv"
    # Without pip: seeding one is most of a venv's creation; the dev venv's uv installs into
    # this one instead (`--python`).
    run_quietly(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # No PYTHONPATH: it may not put the repository's sources on sys.path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    for wheel in wheels:
        # No byte-compiling (uv's default): FlashInfer's ~14,000 modules would be most of its install time.
        run_quietly(UV, "pip", "install", "--quiet", "--python", python, "--no-deps", wheel, cwd=tmp_path, env=env,
                    failure=f"could not install {wheel}: one from the index needs PyPI (network access) "
                            f"or uv's cache to hold it.\n")
    print_paths = "import json, sysconfig; print(json.dumps(sysconfig.get_paths()))"
    venv_paths = json.loads(run_quietly(python, "-c", print_paths, cwd=tmp_path, env=env).stdout)
    site_packages = Path(venv_paths["purelib"]).resolve()
    # Written after the installs, so that the installer saw only the fresh venv. Python does not scan a
    # directory a .pth adds for .pth files, so the dev venv's editable install stays out.
    (site_packages / "dev-venv-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return FreshVenv(python, Path(venv_paths["scripts"]), site_packages, env)


def imported_from(venv: FreshVenv, cwd: Path, *command) -> Path:
    """Where `import b12x_toolchain` in the venv, run in cwd, finds it (the runtime imports too),
    in the process that then runs `b12x COMMAND...`, if given."""
    stdout = run_quietly(venv.python, "-c", IMPORT_PROBE, *command, cwd=cwd, env=venv.env).stdout
    imported = json.loads(stdout.splitlines()[0])
    assert imported["editable_hooks"] == [], imported
    return Path(imported["file"]).resolve()


@pytest.fixture(scope="module")
def side_by_side(project_wheel, tmp_path_factory) -> FreshVenv:
    """A fresh venv with FlashInfer's wheel installed, then this project's."""
    return fresh_venv(tmp_path_factory.mktemp("side-by-side"), FLASHINFER_REQUIREMENT, project_wheel)


def test_installs_side_by_side(side_by_side, one_layer_recipe, one_layer_path, tmp_path):
    venv = side_by_side
    site_packages = venv.site_packages
    ours = record_paths_and_hashes(site_packages, OURS)
    theirs = record_paths_and_hashes(site_packages, FLASHINFER)
    shim = site_packages / "b12x" / "__init__.py"
    assert shim in theirs and shim not in ours
    assert ours.keys() & theirs.keys() == set()
    assert damaged_files(theirs) == []
    assert damaged_files(ours) == []

    recipe = tmp_path / "one-layer.yaml"  # one layer of each op kind: a fraction of the bundled tiny recipe's export
    recipe.write_text(yaml.safe_dump(one_layer_recipe.normalized()))
    # A cwd outside the repository: it may not put the sources on sys.path either.
    run_quietly(venv.scripts / "b12x", "export", "--recipe", recipe, "--out", tmp_path / "out", cwd=tmp_path, env=venv.env)
    package = tmp_path / "out" / f"{one_layer_recipe.name}.b12x"
    # Another install, process and folder give the package's bytes, weights included (the recipe's
    # seeded initialisation), as the suite's own export of that recipe.
    assert (package / "weights.safetensors").exists()
    assert differences(one_layer_path, package) == []
    run = ("run", package, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "4")
    assert imported_from(venv, tmp_path, *run).is_relative_to(site_packages)


def test_a_wheel_install_works_from_the_repository_root(side_by_side):
    # `python -c`, `python -m` (how torchrun starts the ranks of `b12x run --nproc`) and the REPL
    # put the working directory first on sys.path: run from a checkout's root, no folder there
    # may shadow the installed import root.
    venv = side_by_side
    assert imported_from(venv, ROOT).is_relative_to(venv.site_packages)
    in_root = dict(cwd=ROOT, env=venv.env)
    run_quietly(venv.python, "-m", "b12x_toolchain.exporter.cli.main", "--help", **in_root)
    assert "export" in run_quietly(venv.scripts / "b12x", "--help", **in_root).stdout
