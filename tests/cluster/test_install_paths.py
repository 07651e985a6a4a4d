"""Every install path builds the whole package, checked offline without Docker or a cluster.

Besides ./setup.sh (which installs the repository in place), specserve reaches a machine two ways:
deploy/Dockerfile COPYs files from the build context (less .dockerignore) and runs
``pip install .``; deploy/cluster.yaml's ``file_mounts`` rsync files to each node (less
``rsync_exclude``) and its setup commands run setup.sh there. Each used to name the package
folders one by one, and broke when a folder was added. Each test below assembles in a temporary
directory exactly the files that one path copies, as Docker or rsync would select them, builds a
wheel from that directory, and checks the wheel holds every ``specserve.<folder>`` package from
pyproject.toml with its modules and package data. A folder the path does not copy fails the build
(setuptools: package directory does not exist) or the check; the last tests make sure of that.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

import pytest
import yaml
from dockerfile import dockerfile_instructions, shell_commands

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"   # the build context is the repository root
CLUSTER_YAML = ROOT / "deploy" / "cluster.yaml"


# ---- what the wheel must hold, from pyproject.toml ------------------------------------------


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folder(package: str, package_dir: dict[str, str]) -> str:
    """The repository folder setuptools builds ``package`` from (the longest mapped prefix)."""
    parts = package.split(".")
    for cut in range(len(parts), -1, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return posixpath.join(package_dir[prefix], *parts[cut:]) if parts[cut:] else package_dir[prefix]
    return posixpath.join(*parts)


def _packages() -> dict[str, str]:
    """``specserve.<folder>`` package -> its folder in the repository."""
    tool = _setuptools()
    packages = tool.get("packages")
    assert isinstance(packages, list) and packages, "pyproject.toml should list [tool.setuptools] packages"
    return {package: _package_folder(package, tool.get("package-dir") or {}) for package in packages}


def _expected_wheel_files() -> set[str]:
    """Every module directly in each package's folder and every package-data file, as wheel paths."""
    data = _setuptools().get("package-data") or {}
    expected = set()
    for package, folder in _packages().items():
        source, target = ROOT / folder, package.replace(".", "/")
        modules = sorted(source.glob("*.py"))
        assert (source / "__init__.py").is_file(), f"{package}: no {folder}/__init__.py in the repository"
        expected |= {f"{target}/{module.name}" for module in modules}
        for pattern in data.get(package, []):
            files = [f for f in source.glob(pattern) if f.is_file() and "__pycache__" not in f.parts]
            assert files, f"{package}: package-data pattern {pattern!r} matches nothing under {folder}/"
            expected |= {f"{target}/{f.relative_to(source).as_posix()}" for f in files}
    return expected


def test_the_expected_files_name_every_package_and_its_data():
    expected = _expected_wheel_files()
    for package in _packages():
        assert f"{package.replace('.', '/')}/__init__.py" in expected
    # The checks below would pass vacuously without these: the zoo drafts and the C kernel sources.
    assert any(name.startswith("specserve/replicas/drafts/zoo/") for name in expected)
    assert any(name.startswith("specserve/replicas/model/kernels/") and name.endswith(".c") for name in expected)


# ---- building and checking a wheel ----------------------------------------------------------


def _build_and_check_wheel(source: Path, out: Path) -> None:
    """``pip wheel`` of a copy of ``source`` (offline, into ``out``: pip builds in the tree it is
    given, and ``source`` stays as assembled); fails unless the wheel holds every package, module
    and package-data file pyproject.toml asks for."""
    out.mkdir(parents=True, exist_ok=True)
    source = Path(shutil.copytree(source, out / "source", symlinks=True))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PIP_NO_INPUT": "1"})
    assert result.returncode == 0, (
        f"the wheel does not build from what this install path copies ({source}):\n"
        f"{result.stdout[-2000:]}{result.stderr[-3000:]}")
    wheels = sorted(out.glob("specserve-*.whl"))
    assert len(wheels) == 1, f"expected one specserve wheel in {out}, found {[w.name for w in wheels]}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = set(wheel.namelist())
    missing = sorted(_expected_wheel_files() - names)
    assert not missing, (
        f"the wheel built from what this install path copies lacks {len(missing)} file(s) the repository "
        f"has, e.g.: {missing[:10]}")


# ---- deploy/Dockerfile and .dockerignore ----------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE)


def _pip_installs_cwd(words: list[str]) -> bool:
    """``pip install ... .`` or ``python -m pip install ... .``: installs the current directory."""
    if "install" not in words or "pip" not in [posixpath.basename(w) for w in words[: words.index("install")]]:
        return False
    return any(word in (".", "./") or re.fullmatch(r"\.(/)?\[[\w,-]+\]", word) for word in words[words.index("install") + 1:])


class DockerIgnore:
    """The build context's .dockerignore, matched as Docker's patternmatcher does: patterns are
    cleaned and taken from the context root, ``*`` and ``?`` stop at ``/``, ``**`` spans folders,
    the last matching pattern decides (``!`` re-includes), and a pattern matching a folder leaves
    out everything in it."""

    def __init__(self, lines: list[str]):
        self.patterns: list[tuple[re.Pattern, bool]] = []
        for raw in lines:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exception = line.startswith("!")
            pattern = posixpath.normpath(line[1:].strip() if exception else line)
            if len(pattern) > 1 and pattern.startswith("/"):
                pattern = pattern[1:]
            self.patterns.append((re.compile(self._regex(pattern)), exception))

    @staticmethod
    def _regex(pattern: str) -> str:
        out, i = "^", 0
        while i < len(pattern):
            ch = pattern[i]
            if pattern.startswith("**", i):
                i += 2
                if i < len(pattern) and pattern[i] == "/":
                    i += 1
                out += ".*" if i >= len(pattern) else "(.*/)?"
                continue
            if ch == "*":
                out += "[^/]*"
            elif ch == "?":
                out += "[^/]"
            elif ch == "[":
                end = pattern.index("]", i + 1)
                body = pattern[i + 1:end]
                out += "[" + ("^" + body[1:] if body.startswith(("!", "^")) else body) + "]"
                i = end
            elif ch == "\\" and i + 1 < len(pattern):
                i += 1
                out += re.escape(pattern[i])
            else:
                out += re.escape(ch)
            i += 1
        return out + "$"

    @property
    def has_exceptions(self) -> bool:
        return any(exception for _, exception in self.patterns)

    def excludes(self, path: str) -> bool:
        parents = path.split("/")[:-1]
        candidates = [path] + ["/".join(parents[: i + 1]) for i in range(len(parents))]
        excluded = False
        for regex, exception in self.patterns:
            if exception != excluded:   # only a pattern that could change the verdict is looked at
                continue
            if any(regex.match(candidate) for candidate in candidates):
                excluded = not exception
        return excluded


def _context_files(ignore: DockerIgnore) -> Iterator[str]:
    """Every file of the build context (the repository root) that .dockerignore leaves in."""
    for folder, dirs, files in os.walk(ROOT):
        rel = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if rel == "." else rel + "/"
        if not ignore.has_exceptions:   # nothing inside a left-out folder can come back: skip it
            dirs[:] = [d for d in dirs if not ignore.excludes(prefix + d)]
        for name in files:
            if not ignore.excludes(prefix + name):
                yield prefix + name


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


def assemble_docker_image(image: Path, extra_ignores: tuple[str, ...] = ()) -> Path:
    """Copy into ``image`` (standing for the image's /) what deploy/Dockerfile's COPY instructions
    put there before it installs the package; return the folder ``pip install .`` runs in."""
    ignore = DockerIgnore([*(DOCKERIGNORE.read_text().splitlines() if DOCKERIGNORE.exists() else []), *extra_ignores])
    context = sorted(_context_files(ignore))
    workdir = "/"
    for instruction, rest in _dockerfile_instructions():
        if instruction == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, rest))
        elif instruction in ("COPY", "ADD"):
            if rest.startswith("["):
                words = json.loads(rest)
            else:
                words = shlex.split(rest)
            flags = [w for w in words if w.startswith("--")]
            args = [w for w in words if not w.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                continue   # from another stage or image, not from the build context
            unknown = [f for f in flags if not f.startswith(("--chown", "--chmod", "--link"))]
            assert not unknown, f"deploy/Dockerfile {instruction} {rest}: extend this test to honour {unknown}"
            *sources, dest = args
            dest_dir = posixpath.normpath(posixpath.join(workdir, dest))
            into_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
            for src in sources:
                src = posixpath.normpath(src).lstrip("/")
                src = "" if src == "." else src
                inside = [f for f in context if not src or f.startswith(src + "/")]
                if inside:   # a folder: its contents go into dest
                    for f in inside:
                        _copy(ROOT / f, image / dest_dir.lstrip("/") / (f[len(src) + 1:] if src else f))
                    continue
                matches = [f for f in context if PurePosixPath(f).match(src) and f.count("/") == src.count("/")]
                assert matches, f"deploy/Dockerfile {instruction} {rest}: {src} is not in the build context (or .dockerignore leaves it out)"
                for f in matches:
                    target = posixpath.join(dest_dir, posixpath.basename(f)) if into_dir else dest_dir
                    _copy(ROOT / f, image / target.lstrip("/"))
        elif instruction == "RUN" and any(_pip_installs_cwd(words) for words in shell_commands(rest)):
            return image / workdir.lstrip("/")
    pytest.fail("deploy/Dockerfile never runs `pip install .`")


# ---- deploy/cluster.yaml: file_mounts less rsync_exclude ------------------------------------


def _rsync_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        if ch == "*":
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
            i = end
        else:
            out += re.escape(ch)
        i += 1
    return out


class RsyncExcludes:
    """``rsync --exclude`` patterns, matched as rsync does: a leading ``/`` anchors a pattern to the
    transfer's root; a trailing ``/`` matches folders only; a pattern with a ``/`` or ``**`` in it
    is matched against the end of the path, any other against the name alone; an excluded folder
    is skipped whole."""

    def __init__(self, patterns: list[str]):
        self.rules: list[tuple[re.Pattern, bool]] = []
        for pattern in patterns:
            assert isinstance(pattern, str) and pattern.strip() == pattern and not pattern.startswith(("+ ", "- ", "!")), (
                f"rsync_exclude {pattern!r}: extend this test to read rsync's filter-rule prefixes")
            dir_only = pattern.endswith("/")
            body = pattern.rstrip("/")
            # Unanchored, a pattern matches the path's last components (its name alone, unless the
            # pattern has a / or ** in it); * and ? never cross a /, so one regex does both.
            anchored = body.startswith("/")
            regex = ("^" if anchored else "(^|/)") + _rsync_regex(body[1:] if anchored else body) + "$"
            self.rules.append((re.compile(regex), dir_only))

    def excludes(self, path: str, is_dir: bool) -> bool:
        return any(regex.search(path) and (is_dir or not dir_only) for regex, dir_only in self.rules)


def _rsync(source: Path, target: Path, excludes: RsyncExcludes) -> None:
    """``rsync -a source/ target/`` with ``excludes`` (what Ray's cluster launcher runs for a
    folder mount; a file mount copies the file unless its name is excluded)."""
    if source.is_file():
        if not excludes.excludes(source.name, is_dir=False):
            _copy(source, target)
        return
    for folder, dirs, files in os.walk(source):
        rel = Path(folder).relative_to(source).as_posix()
        prefix = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if not excludes.excludes(prefix + d, is_dir=True)]
        for name in files:
            if not excludes.excludes(prefix + name, is_dir=False):
                _copy(Path(folder) / name, target / (prefix + name))


def _home_path(home: Path, remote: str) -> Path:
    assert remote.startswith("~/"), f"deploy/cluster.yaml: extend this test for a remote path outside ~: {remote}"
    return home / posixpath.normpath(remote[2:])


def _setup_folders(config: dict) -> list[str]:
    """The folders the setup commands run setup.sh in (``cd DIR && ... ./setup.sh``)."""
    folders = []
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        for command in config.get(key) or []:
            cwd = None
            for words in shell_commands(command):
                if words[0] == "cd" and len(words) == 2:
                    cwd = words[1]
                elif any(posixpath.basename(w) == "setup.sh" for w in words):
                    script = next(w for w in words if posixpath.basename(w) == "setup.sh")
                    folders.append(posixpath.dirname(posixpath.normpath(posixpath.join(cwd or "~", script))))
    return folders


def assemble_cluster_node(home: Path, extra_excludes: tuple[str, ...] = ()) -> Path:
    """Copy into ``home`` (standing for a node's ~) what deploy/cluster.yaml's file_mounts put
    there, ``ray up`` being run from the repository root; return the folder setup.sh runs in."""
    config = yaml.safe_load(CLUSTER_YAML.read_text())
    assert not config.get("rsync_filter"), "deploy/cluster.yaml sets rsync_filter: extend this test to apply it"
    excludes = RsyncExcludes([*(config.get("rsync_exclude") or []), *extra_excludes])
    for remote, local in (config.get("file_mounts") or {}).items():
        if local.startswith("~") or os.path.isabs(local):
            continue   # from outside the repository (the Ray auth token): not part of the install
        source = ROOT / local
        assert source.exists(), f"deploy/cluster.yaml file_mounts {remote}: {local} is not in the repository"
        _rsync(source, _home_path(home, remote), excludes)
    folders = sorted(set(_setup_folders(config)))
    assert len(folders) == 1, f"deploy/cluster.yaml should run setup.sh in one folder on every node, found {folders}"
    folder = _home_path(home, folders[0])
    setup = folder / "setup.sh"
    assert setup.is_file(), f"deploy/cluster.yaml runs {folders[0]}/setup.sh, which file_mounts do not copy"
    assert os.access(setup, os.X_OK), f"{folders[0]}/setup.sh lost its executable bit on the way"
    text = setup.read_text()
    assert 'cd "$(dirname "$0")"' in text and re.search(r'pip install .*-e "?\.[\["]', text), (
        "setup.sh no longer installs the folder it sits in (pip install -e .); this test builds that folder")
    return folder


ASSEMBLERS: dict[str, Callable[..., Path]] = {
    "deploy/Dockerfile": assemble_docker_image,
    "deploy/cluster.yaml": assemble_cluster_node,
}


# ---- the tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(ASSEMBLERS))
def assembled(request, tmp_path_factory) -> tuple[str, Path]:
    """(install path, the folder it installs from), assembled once per module."""
    where = request.param
    return where, ASSEMBLERS[where](tmp_path_factory.mktemp(Path(where).name.replace(".", "-")))


def test_the_install_path_builds_a_wheel_with_every_package(assembled, tmp_path):
    where, source = assembled
    try:
        _build_and_check_wheel(source, tmp_path / "wheel")
    except AssertionError as err:
        raise AssertionError(f"{where}: {err}") from None


def test_the_install_path_leaves_local_state_behind(assembled):
    where, source = assembled
    for folder, dirs, files in os.walk(source):
        rel = Path(folder).relative_to(source)
        for name in [*dirs, *files]:
            assert name not in (".venv", ".git", "__pycache__") and not name.endswith((".egg-info", ".pyc")), (
                f"{where} copies {rel / name}: local state that should stay behind")
    if where == "deploy/Dockerfile":
        assert not (source / "tests").exists(), "deploy/Dockerfile copies tests/ into the image"


@pytest.mark.parametrize("where, drop, why", [
    ("deploy/Dockerfile", "data", "a package folder left out"),
    ("deploy/cluster.yaml", "/replicas/drafts/zoo", "package data left out"),
])
def test_the_check_fails_when_a_path_leaves_part_of_the_package_out(where, drop, why, tmp_path):
    folders = set(_packages().values())
    assert drop.strip("/") in folders or any(drop.strip("/").startswith(f + "/") for f in folders), drop
    source = ASSEMBLERS[where](tmp_path / "assembled", (drop,))
    assert not (source / drop.strip("/")).exists()
    with pytest.raises(AssertionError):
        _build_and_check_wheel(source, tmp_path / "wheel")


def test_dockerignore_matches_as_docker_does():
    ignore = DockerIgnore(["# a comment", ".git", "**/__pycache__", "*.egg-info", "/build", "tests", "bench-*.json",
                           "docs/**", "!docs/keep.md"])
    assert ignore.excludes(".git/HEAD") and ignore.excludes("build/lib/x.py") and ignore.excludes("tests/a/b.py")
    assert ignore.excludes("replicas/drafts/__pycache__/base.cpython-311.pyc") and ignore.excludes("__pycache__/x.pyc")
    assert ignore.excludes("specserve.egg-info/PKG-INFO") and ignore.excludes("bench-1.json")
    assert not ignore.excludes("replicas/tests/x.py") and not ignore.excludes("cluster/build.py")
    assert not ignore.excludes("sub/specserve.egg-info/PKG-INFO") and not ignore.excludes("data/bench-1.json")
    assert ignore.excludes("docs/a.md") and not ignore.excludes("docs/keep.md")


def test_rsync_excludes_match_as_rsync_does():
    excludes = RsyncExcludes(["/.venv", "__pycache__", "*.py[cod]", "/bench-*.json", "build/", "a/b"])
    assert excludes.excludes(".venv", is_dir=True) and not excludes.excludes("x/.venv", is_dir=True)
    assert excludes.excludes("__pycache__", is_dir=True) and excludes.excludes("replicas/drafts/__pycache__", is_dir=True)
    assert excludes.excludes("cli/main.pyc", is_dir=False) and not excludes.excludes("cli/main.py", is_dir=False)
    assert excludes.excludes("bench-1.json", is_dir=False) and not excludes.excludes("data/bench-1.json", is_dir=False)
    assert excludes.excludes("x/build", is_dir=True) and not excludes.excludes("x/build", is_dir=False)
    assert excludes.excludes("a/b", is_dir=False) and excludes.excludes("x/a/b", is_dir=False)
    assert not excludes.excludes("xa/b", is_dir=False)
