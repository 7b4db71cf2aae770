"""b12x-toolchain[cuda] installs into the environment of the vLLM a user already runs.

pip's own resolver decides, offline, over wheels that hold metadata only: vLLM and torch with the
Requires-Dist their published wheels declare (the {name}-{version}.requires.txt files beside this
module), this project with the requirements pyproject.toml declares, and every other distribution
named anywhere in a few versions taken from the specifiers that name it, with no requirements of
its own. The stubs keep the environment markers, so pip evaluates them for this interpreter and
platform as it would for the real wheels (torch asks for its Triton on Linux only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from b12x_toolchain.runtime.formats.dsv41 import FLASHINFER_PIN
from paths import ROOT

pytestmark = pytest.mark.slow(minutes=0.2)  # three pip resolutions: the module's time on two busy cores

HERE = Path(__file__).resolve().parent
VLLM = HERE / "vllm-0.33.0.requires.txt"
TORCH = HERE / "torch-2.14.0.requires.txt"  # vLLM's torch: its own Requires-Dist pins the Triton
EXACT = {"==", "==="}
LOWER_BOUNDS = {">=", ">", "~=", "==", "==="}


@dataclass(frozen=True)
class Release:
    """One stub wheel: a distribution's name, version and Requires-Dist (markers kept)."""

    name: str
    version: str
    requires: tuple[str, ...] = ()
    extras: frozenset[str] = frozenset()


def published(path: Path) -> Release:
    """The release a data file beside this module describes (name and version from its file name)."""
    name, version = path.name.removesuffix(".requires.txt").rsplit("-", 1)
    prefix = "Requires-Dist: "
    lines = path.read_text().splitlines()
    return Release(name, version, tuple(line.removeprefix(prefix) for line in lines if line.startswith(prefix)))


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def with_extra(requirement: str, extra: str) -> str:
    """An optional dependency as a wheel's METADATA declares it: only with its extra asked for."""
    req = Requirement(requirement)
    marker = f'extra == "{extra}"' if req.marker is None else f'({req.marker}) and extra == "{extra}"'
    req.marker = None
    return f"{req}; {marker}"


def ours(cuda: list[str]) -> Release:
    """This project as its wheel declares it, with `cuda` as the cuda extra's requirements."""
    meta = project()
    extras = meta["optional-dependencies"] | {"cuda": cuda}
    optional = [with_extra(req, extra) for extra, reqs in extras.items() for req in reqs]
    return Release(meta["name"], meta["version"], (*meta["dependencies"], *optional), frozenset(extras))


def exact_pin(release: Release, name: str) -> str:
    """The version a release's requirements pin `name` to with ==."""
    (pin,) = [spec.version for req in map(Requirement, release.requires) if canonicalize_name(req.name) == name
              for spec in req.specifier if spec.operator == "=="]
    return pin


def just_above(version: Version) -> Version:
    """The next release at the version's last place (3.8.0: 3.8.1)."""
    *head, last = version.release
    return Version(".".join(map(str, [*head, last + 1])))


def candidate_versions(specifiers: list[SpecifierSet]) -> set[Version]:
    """Each version a specifier mentions, and one just above the highest lower bound: the stubs require
    nothing, so a name's specifiers alone decide, and among these versions pip finds one meeting them
    all wherever a bound or the release after the highest lower bound does."""
    specs = [spec for specifier in specifiers for spec in specifier]
    mentioned = {Version(spec.version.removesuffix(".*")) for spec in specs}
    lower = [Version(spec.version.removesuffix(".*")) for spec in specs if spec.operator in LOWER_BOUNDS]
    candidates = mentioned | ({just_above(max(lower))} if lower else set())
    return candidates or {Version("1.0")}  # named without a version: any will do


def stand_ins(releases: list[Release], roots: list[str]) -> list[Release]:
    """The releases given, and stubs for every other distribution their requirements name."""
    given = {canonicalize_name(release.name) for release in releases}
    named = defaultdict(list)
    for req in map(Requirement, [*roots, *(text for release in releases for text in release.requires)]):
        named[canonicalize_name(req.name)].append(req)
    others = [Release(reqs[0].name, str(version), extras=frozenset().union(*(req.extras for req in reqs)))
              for key, reqs in named.items() if key not in given
              for version in candidate_versions([req.specifier for req in reqs])]
    return [*releases, *others]


def write_wheel(folder: Path, release: Release) -> None:
    stem = f"{canonicalize_name(release.name).replace('-', '_')}-{release.version}"  # the file name pip parses
    dist_info = f"{stem}.dist-info"
    metadata = ["Metadata-Version: 2.1", f"Name: {release.name}", f"Version: {release.version}",
                *(f"Provides-Extra: {extra}" for extra in sorted(release.extras)),
                *(f"Requires-Dist: {req}" for req in release.requires)]
    files = {f"{dist_info}/METADATA": "\n".join(metadata) + "\n",
             f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist_info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist_info}/RECORD"])
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def offline_pip_environment() -> dict[str, str]:
    # This machine's pip settings (an index, find-links, a constraints file) would add candidates or
    # rule some out: no configuration file, no PIP_* variable, and an empty constraint.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_CONSTRAINT": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@dataclass(frozen=True)
class Resolution:
    ok: bool
    output: str
    installed: dict[str, str]  # canonical name: version, from pip's installation report


def resolve(tmp_path: Path, releases: list[Release], roots: list[str]) -> Resolution:
    """What `pip install roots` would install, choosing among `releases` and stand-ins only."""
    index = tmp_path / "wheels"
    index.mkdir()
    for release in stand_ins(releases, roots):
        write_wheel(index, release)
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", index,
               "--ignore-installed", "--report", report, *roots]
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True,
                            env=offline_pip_environment(), cwd=tmp_path, timeout=120)
    output = f"{' '.join(roots)}: pip exited {result.returncode}\n{result.stdout}{result.stderr}"
    if result.returncode != 0:
        return Resolution(False, output, {})
    installs = json.loads(report.read_text())["install"]
    versions = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in installs}
    return Resolution(True, output, versions)


def beside_vllm(tmp_path: Path, cuda: list[str]) -> Resolution:
    """Resolve this project with its cuda extra (as given) together with vLLM's published release."""
    vllm, torch = published(VLLM), published(TORCH)
    assert exact_pin(vllm, "torch") == torch.version, "the torch data file is not the torch this vLLM pins"
    project_release = ours(cuda)
    roots = [f"{project_release.name}[cuda]=={project_release.version}", f"{vllm.name}=={vllm.version}"]
    return resolve(tmp_path, [vllm, torch, project_release], roots)


def cuda_extra() -> list[str]:
    return project()["optional-dependencies"]["cuda"]


def replacing(requirements: list[str], pin: str) -> list[str]:
    """requirements with `pin` in place of any requirement of the same distribution."""
    name = canonicalize_name(Requirement(pin).name)
    return [req for req in requirements if canonicalize_name(Requirement(req).name) != name] + [pin]


def test_the_cuda_extra_resolves_beside_vllm(tmp_path):
    resolution = beside_vllm(tmp_path, cuda_extra())
    assert resolution.ok, resolution.output
    assert resolution.installed["torch"] == published(TORCH).version
    assert resolution.installed["flashinfer-python"] == exact_pin(published(VLLM), "flashinfer-python")
    assert resolution.installed[canonicalize_name(project()["name"])] == project()["version"]


def dev_triton() -> str:
    """The dev extra's Triton: the one version the kernel tests run on the CPU."""
    (pin,) = [req for req in project()["optional-dependencies"]["dev"] if Requirement(req).name == "triton"]
    return pin


def asks_here(release: Release, name: str) -> bool:
    """Whether a release requires `name` on this interpreter and platform (its markers evaluated)."""
    reqs = [req for req in map(Requirement, release.requires) if canonicalize_name(req.name) == name]
    return any(req.marker is None or req.marker.evaluate() for req in reqs)


# The extra's former pins: the FlashInfer whose record bytes the tests compare with, and the Triton
# of torch 2.13 (still dev's). vLLM pins another FlashInfer, and its torch another Triton.
FORMER_PINS = {"flashinfer-python": lambda: f"flashinfer-python=={FLASHINFER_PIN}", "triton": dev_triton}


@pytest.mark.parametrize("name", FORMER_PINS)
def test_an_exact_pin_vllm_disagrees_with_fails_to_resolve(name, tmp_path):
    if name == "triton" and not asks_here(published(TORCH), name):
        pytest.skip("torch requires no Triton on this platform, so no Triton pin can conflict with it")
    pin = FORMER_PINS[name]()
    resolution = beside_vllm(tmp_path, replacing(cuda_extra(), pin))
    assert not resolution.ok, f"resolved with {pin}:\n{resolution.output}"
    assert "ResolutionImpossible" in resolution.output, resolution.output
    # pip lists each requirement in the conflict: ours and the other side's, all of this distribution.
    _, found, after = resolution.output.partition("The conflict is caused by:")
    causes = [line.strip() for line in after.split("\n\n", 1)[0].splitlines() if line.strip()]
    assert found, resolution.output
    assert len(causes) >= 2 and all(f"depends on {name}" in line for line in causes), resolution.output


def test_the_cuda_extra_pins_neither_flashinfer_nor_triton_exactly():
    for req in map(Requirement, cuda_extra()):
        if canonicalize_name(req.name) in {"flashinfer-python", "triton"}:
            assert not any(spec.operator in EXACT for spec in req.specifier), req
