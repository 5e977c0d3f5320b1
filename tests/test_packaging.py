"""What an install holds: a regular ``hbmd`` package with its version, type hints everywhere, and an sdist an
operator can build and deploy from."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _clean_copy(tmp_path: Path) -> Path:
    """The tree without earlier build output: setuptools adds what an old egg-info lists, whatever MANIFEST.in says."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    return tree


def _build(tmp_path: Path, kind: str) -> Path:
    """The sdist or wheel (``kind``) setuptools builds from a clean copy of the tree."""
    build_meta = pytest.importorskip("setuptools.build_meta")
    tree = _clean_copy(tmp_path)
    here = os.getcwd()
    os.chdir(tree)
    try:
        return tmp_path / getattr(build_meta, f"build_{kind}")(str(tmp_path))
    finally:
        os.chdir(here)


def test_hbmd_is_a_regular_package_that_knows_its_version():
    import hbmd

    # A namespace package has no __file__, and any directory named hbmd on the path would join it.
    assert hbmd.__file__ is not None and Path(hbmd.__file__).name == "__init__.py"
    assert hbmd.__version__ == importlib.metadata.version("hbmd")


def test_every_package_ships_its_type_hints():
    setuptools = PYPROJECT["tool"]["setuptools"]
    for package in setuptools["packages"]:
        directory = ROOT / setuptools["package-dir"].get(package, "")
        if package in setuptools["package-dir"]:
            assert "py.typed" in setuptools["package-data"][package], package
            assert (directory / "py.typed").is_file(), package
    assert "hbmd" in setuptools["packages"]  # PEP 561: the top package's py.typed covers the subpackages


def test_the_sdist_carries_what_the_readme_and_the_operator_need(tmp_path):
    with tarfile.open(_build(tmp_path, "sdist")) as sdist:
        members = {m.name.split("/", 1)[1] for m in sdist.getmembers() if "/" in m.name}
    for path in ("SECURITY.md", "README.md", "CHANGELOG.md", "Dockerfile", ".dockerignore", "deploy/hbmd@.service",
                 "deploy/daemonset.py", "bench/README.md", "bench/restart_bench.py", "scripts/vllm-tier.sh",
                 "scripts/vllm-venv.sh", "__init__.py", "py.typed"):
        assert path in members, path
    assert not any(m.startswith((".venv", ".git/")) or "__pycache__" in m for m in members)


def test_the_wheel_ships_what_a_node_needs_besides_the_code(tmp_path):
    with zipfile.ZipFile(_build(tmp_path, "wheel")) as wheel:
        members = set(wheel.namelist())
    for path in ("hbmd@.service", "hbmd.sysusers.conf", "grafana-dashboard.json", "daemonset.py", "README.md"):
        assert f"hbmd/deploy/{path}" in members, path
    assert not any(m.startswith(("hbmd/tests/", "hbmd/bench/", "hbmd/testing/")) for m in members)
    # Every package of the code a node runs, each listed by hand in pyproject.toml: one left out imports nowhere.
    for top in ("proto", "daemon", "client", "driver", "integrations"):
        for init in (ROOT / top).rglob("__init__.py"):
            module = "/".join(init.relative_to(ROOT).parent.parts)
            assert f"hbmd/{module}/__init__.py" in members, module


def test_python_m_hbmd_deploy_says_where_the_files_are():
    out = subprocess.run([sys.executable, "-m", "hbmd.deploy"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and (Path(out.stdout.strip()) / "hbmd@.service").is_file()


@pytest.mark.unit
def test_no_hint_or_document_tells_anyone_to_install_hbmd_by_a_name_nobody_here_publishes():
    """hbmd is not on PyPI: `pip install hbmd` (or one of its extras by name) would install whatever someone else
    registers under it. Hints name the dependency itself, or a checkout or a wheel."""
    import re

    wrong = re.compile(r"pip install\s+(-\S+\s+)*['\"]?hbmd(\[|['\"\s]|$)")
    files = [p for p in ROOT.rglob("*") if p.suffix in {".py", ".md", ".toml", ".yaml", ".service", ".sh"}
             or p.name == "Dockerfile"]
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in files
                 if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
                 and p.relative_to(ROOT).parts[0] not in ("build", "dist") and p.name != "CHANGELOG.md"
                 for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if wrong.search(line)]
    assert offenders == []


def test_from_a_clones_parent_directory_the_installed_hbmd_is_imported_not_the_clone(tmp_path):
    """``git clone`` makes ``hbmd/``, whose root is the package itself: from the directory it sits in, Python finds
    the clone before the installed package (the current directory leads ``sys.path`` for ``-m`` and ``-c``), so
    ``python -m hbmd.deploy`` named the clone's files, and ``import hbmd`` ran the clone's code."""
    installed = tmp_path / "site-packages"
    with zipfile.ZipFile(_build(tmp_path, "wheel")) as wheel:
        wheel.extractall(installed)
    parent = tmp_path / "src"
    parent.mkdir()
    (parent / "hbmd").symlink_to(ROOT, target_is_directory=True)  # the clone
    env = {**os.environ, "PYTHONPATH": str(installed)}

    def python(*args: str) -> str:
        out = subprocess.run([sys.executable, *args], cwd=parent, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert Path(python("-m", "hbmd.deploy").strip()) == installed / "hbmd" / "deploy"
    assert python("-c", "import hbmd, hbmd.proto; print(hbmd.__file__, hbmd.proto.__file__)").split() == [
        str(installed / "hbmd" / "__init__.py"), str(installed / "hbmd" / "proto" / "__init__.py")]
    # Nothing installed there: the clone is what there is, and it is imported.
    env.pop("PYTHONPATH")
    clone = subprocess.run([sys.executable, "-S", "-c", "import hbmd; print(hbmd.__file__)"], cwd=parent, env=env,
                           capture_output=True, text=True, timeout=60)
    assert clone.stdout.split() == [str(parent / "hbmd" / "__init__.py")], clone.stderr
