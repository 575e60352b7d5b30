"""The declared dependencies: requirements.txt and pyproject.toml say the same, and every declared floor is
one CI runs the suite with (.ci/floors.txt, which .ci/run installs as pip constraints in a venv of its own)."""

import os
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from script_runner import ROOT


def read_requirements(path: str) -> dict[str, Requirement]:
    """The requirements a pip requirements (or constraints) file lists itself, by canonical name; the files it
    includes with `-r` are left out."""
    requirements = {}
    with open(os.path.join(ROOT, path)) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                requirement = Requirement(line)
                requirements[canonicalize_name(requirement.name)] = requirement
    return requirements


def declared(requirements: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, requirements)}


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def floor(requirement: Requirement) -> str | None:
    """The lowest version a requirement allows: its `>=` or `==` bound."""
    bounds = [s.version for s in requirement.specifier if s.operator in (">=", "==", "===")]
    assert len(bounds) <= 1, f"{requirement} has more than one lower bound"
    return bounds[0] if bounds else None


def specifiers(requirements: dict[str, Requirement]) -> dict[str, str]:
    return {name: f"{r.specifier}{'; ' + str(r.marker) if r.marker else ''}" for name, r in requirements.items()}


def test_pyproject_declares_the_runtime_requirements_as_requirements_txt_does():
    assert specifiers(declared(pyproject()["dependencies"])) == specifiers(read_requirements("requirements.txt"))


def test_pyproject_test_extra_agrees_with_requirements_test_txt():
    """The extra holds the test tools and references; requirements-test.txt adds the browser driver and the
    demo's and the TPU compiler's files."""
    in_file = specifiers(read_requirements("requirements-test.txt"))
    extra = specifiers(declared(pyproject()["optional-dependencies"]["test"]))
    assert {name: in_file.get(name) for name in extra} == extra


def test_every_runtime_requirement_has_a_floor():
    assert [str(r) for r in read_requirements("requirements.txt").values() if floor(r) is None] == []


def test_ci_installs_every_declared_floor_and_nothing_else():
    """.ci/floors.txt pins each floor of requirements.txt and of pyproject's test extra (`name==floor`): what
    CI's floors step installs is what the files promise."""
    wanted = {}
    for requirement in [*pyproject()["dependencies"], *pyproject()["optional-dependencies"]["test"]]:
        requirement = Requirement(requirement)
        if floor(requirement):
            wanted[canonicalize_name(requirement.name)] = ("==", Version(floor(requirement)))
    pinned = {name: [(s.operator, Version(s.version)) for s in r.specifier]
              for name, r in read_requirements(".ci/floors.txt").items()}
    assert pinned == {name: [pin] for name, pin in wanted.items()}
