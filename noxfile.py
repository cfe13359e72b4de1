"""Every kp workflow is a nox session.

    nox                      the default set (lint, tests, conformance, build, docs): the README's test command
    nox -s demo              the Llama-style demo: eager vs kp-patched, outputs, gradients, time, memory
    nox -s bench             benchmarks against the anchors (needs a GPU)
    nox -s conformance-report
    nox -s mutants           planted bugs in one package's kernels: do its specs catch them? (-- --package P)
    nox -s memcheck          the specs under compute-sanitizer's memcheck (a CUDA machine)
    nox -s fa-suite -- PATH  FlashAttention's own tests against kp_attention.flash_attn (a GPU)

On a machine without a package registry (the GPU box) run `nox --no-venv -s conformance`: sessions then use
the current interpreter's packages and put packages/*/src on PYTHONPATH instead of installing.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
# CPU sessions pin torch's small CPU build; KP_TORCH_INDEX adds an index that serves it (e.g. PyTorch's
# CPU wheel index on hosted CI), where the default registry only has the CUDA build.
TORCH = os.environ.get("KP_TORCH", "torch==2.13.0")
TORCH_INDEX = os.environ.get("KP_TORCH_INDEX")
KERNEL_DEPS = ("triton>=3.2", "numpy")
TEST_DEPS = ("pytest>=8", "pytest-xdist", "hypothesis>=6.100")
OPINFO_DEPS = ("expecttest",)  # torch's op_db (the opinfo spec's samples) imports it
HF_DEPS = ("transformers>=4.45",)  # kp-norms' "hf" extra (kp_norms.patch on Hugging Face models)
# kp-distributed's tests also shard a model built from the kernel packages (its code imports none of them)
TESTED_WITH = {"kp-distributed": ("kp-norms", "kp-attention", "kp-precision")}
# The umbrella package `kp` depends on every other package.
TESTED_WITH["kp"] = tuple(p for p in PACKAGES if p != "kp")

nox.options.sessions = ["lint", "tests", "conformance", "build", "docs"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _installing(session: nox.Session) -> bool:
    return session.venv_backend != "none"


def _install_torch(session: nox.Session) -> None:
    if _installing(session):
        extra = ("--extra-index-url", TORCH_INDEX) if TORCH_INDEX else ()
        session.install(TORCH, *extra, *KERNEL_DEPS)


def _install_packages(session: nox.Session, *names: str) -> dict[str, str]:
    """Install packages/<name> (non-editable: what users get); without a venv, use the sources in place."""
    if _installing(session):
        session.install("--no-deps", *(str(ROOT / "packages" / n) for n in names))
        return {}
    paths = [str(ROOT / "packages" / n / "src") for n in names] + [str(ROOT / "conformance" / "src")]
    return {"PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])}


def _cpu_env() -> dict[str, str]:
    # Off-GPU, kernels run under Triton's interpreter; on a GPU the caller's environment decides.
    try:
        import torch  # noqa: F401  (only present in --no-venv runs)

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    return {} if has_gpu or os.environ.get("TRITON_INTERPRET") else {"TRITON_INTERPRET": "1"}


@nox.session(python="3.11", tags=["ci"])
def lint(session: nox.Session) -> None:
    if _installing(session):
        session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", str(ROOT / "docs" / "check_imports.py"))  # no import circles or private imports


@nox.session(python="3.11", tags=["ci"])
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's own tests, in a venv holding only that package and kp-core (and TESTED_WITH's)."""
    _install_torch(session)
    if _installing(session):
        session.install(*TEST_DEPS)
        if package in ("kp-norms", "kp-attention", "kp-distributed", "kp"):  # tiny transformers models
            session.install(*HF_DEPS)
        if package in ("kp-norms", "kp-attention"):  # their patch tests' tolerance rule
            session.install("--no-deps", str(ROOT / "conformance"))
    env = _install_packages(session, *dict.fromkeys(["kp-core", package, *TESTED_WITH.get(package, ())]))
    env.update(_cpu_env())
    session.run("pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "packages" / package / "tests"), env=env)


@nox.session(python="3.11", tags=["ci"])
def conformance(session: nox.Session) -> None:
    """All specs. KP_TIER picks the size tier (small by default; GPU runs use large)."""
    _install_torch(session)
    if _installing(session):
        session.install(*TEST_DEPS, *OPINFO_DEPS)
        session.install("--no-deps", str(ROOT / "conformance"))
    env = _install_packages(session, *PACKAGES)
    env.update(_cpu_env())
    env.setdefault("KP_TIER", os.environ.get("KP_TIER", "small"))
    workers = session.posargs or ["-n", os.environ.get("KP_WORKERS", "2")]
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(ROOT),
        str(ROOT / "conformance" / "specs"),
        "--durations=25",  # the slowest tests in every log: CI's time budget is watched from them
        *workers,
        env=env,
    )


@nox.session(python="3.11")
def mutants(session: nox.Session) -> None:
    """Planted bugs: one at a time in a package's Triton kernels, each run against its specs on the CPU.

    nox -s mutants -- --package kp-norms --list
    nox -s mutants -- --package kp-norms --sample 20 --jobs 2 --out docs/mutants.md
    """
    _install_torch(session)
    if _installing(session):
        session.install(*TEST_DEPS)
        session.install("--no-deps", str(ROOT / "conformance"))
    # The packages too: the spec registry, which maps a package to its specs, imports every spec and package.
    env = _install_packages(session, *PACKAGES)
    # Each mutant runs on its own copy of packages/ and conformance/, with their src folders on PYTHONPATH.
    session.run("python", "-m", "kp_conformance.mutants", "--root", str(ROOT), *session.posargs, env=env)


@nox.session(python="3.11")
def memcheck(session: nox.Session) -> None:
    """The specs under compute-sanitizer's memcheck (a CUDA machine with the toolkit; see docs/conformance.md).

    nox --no-venv -s memcheck -- --tier micro --jobs 16
    nox --no-venv -s memcheck -- --tier small --specs norm --shards 4 --jobs 20
    nox --no-venv -s memcheck -- --tool racecheck --specs norm quantize decode flex_attention
    """
    _install_torch(session)
    if _installing(session):
        session.install(*TEST_DEPS, *OPINFO_DEPS)
        session.install("--no-deps", str(ROOT / "conformance"))
    env = _install_packages(session, *PACKAGES)
    session.run("python", "-m", "kp_conformance.memcheck", "--root", str(ROOT), *session.posargs, env=env)


@nox.session(name="fa-suite", python="3.11")
def fa_suite(session: nox.Session) -> None:
    """FlashAttention's own tests (tests/test_flash_attn.py of a checkout you point to) against
    kp_attention.flash_attn, a fixed-seed sample of them; a GPU only (the tests allocate on CUDA).

    nox --no-venv -s fa-suite -- PATH [--fa-sample N] [--fa-seed S] [--fa-report out.json] [pytest options]
    """
    if not session.posargs:
        session.error("usage: nox -s fa-suite -- PATH (a FlashAttention checkout) [pytest options]")
    tests = Path(session.posargs[0]) / "tests" / "test_flash_attn.py"
    if not tests.is_file():
        session.error(f"{tests} not found: PATH must be a FlashAttention checkout")
    _install_torch(session)
    if _installing(session):
        session.install(*TEST_DEPS, "einops")
        session.install("--no-deps", str(ROOT / "conformance"))
    env = _install_packages(session, "kp-core", "kp-attention")
    gpu = session.run("python", "-c", "import torch; print(torch.cuda.is_available())", silent=True, env=env)
    if "True" not in (gpu or ""):
        session.skip("FlashAttention's tests allocate on CUDA: a GPU only")
    args = ("-p", "kp_conformance.fa_suite", "-p", "no:cacheprovider", "-q", "--rootdir", str(tests.parent))
    session.run("python", "-m", "pytest", str(tests), *args, *session.posargs[1:], env=env)


@nox.session(name="conformance-report", python="3.11")
def conformance_report(session: nox.Session) -> None:
    """Merge conformance/reports/*.json into docs/conformance-matrix.md."""
    _install_torch(session)  # kp_conformance's package imports torch, pytest and hypothesis, and kp-core
    if _installing(session):
        session.install(*TEST_DEPS)
    env = _install_packages(session, "kp-core")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "conformance" / "src"), env.get("PYTHONPATH", "")])
    session.run("python", "-m", "kp_conformance.report", env=env)


@nox.session(python="3.11", tags=["ci"])
def build(session: nox.Session) -> None:
    """Build each wheel alone, install it in a clean venv with only its dependencies, import it."""
    if not _installing(session):
        session.skip("build needs virtualenvs")
    session.install("build")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for name in [*PACKAGES, "conformance"]:
        src = ROOT / ("conformance" if name == "conformance" else f"packages/{name}")
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist), str(src), silent=True)
    wheels = {w.name.split("-")[0].replace("_", "-"): w for w in dist.glob("*.whl")}
    tmp = Path(session.create_tmp())
    extra = ("--extra-index-url", TORCH_INDEX) if TORCH_INDEX else ()
    # One venv with torch alone (what every package needs; installing it per package took most of this session's
    # 5 minutes). Each package goes in with what pip resolves for it, is imported, and everything it brought is
    # uninstalled again, so the next package finds torch and nothing else.
    venv = tmp / "clean"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    session.run(py, "-m", "pip", "install", "-q", TORCH, *extra, external=True)
    base = _installed(session, py)
    for name in PACKAGES:
        deps = [str(wheels[d]) for d in _local_dependencies(name)]
        session.run(py, "-m", "pip", "install", "-q", TORCH, *extra, *deps, str(wheels[name]), external=True)
        module = name.replace("-", "_")
        check = f"import {module}; print({module}.__name__, {module}.__version__, 'imports alone')"
        session.run(py, "-c", check, external=True)
        brought = sorted(_installed(session, py) - base)
        if brought:
            session.run(py, "-m", "pip", "uninstall", "-q", "-y", *brought, external=True)
    shutil.rmtree(venv)


def _installed(session: nox.Session, py: str) -> set[str]:
    """The distributions installed in the venv of `py`, by name."""
    out = session.run(py, "-m", "pip", "list", "--format=freeze", silent=True, external=True)
    return {line.split("==")[0].lower() for line in out.splitlines() if "==" in line}


def _local_dependencies(name: str) -> list[str]:
    """The packages/ folders `name` depends on (by pyproject), deepest first: their wheels install from dist/."""
    import tomllib

    deps = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]["dependencies"]
    local = [d for d in (re.split(r"[<>=!~ \[]", d, maxsplit=1)[0] for d in deps) if d in PACKAGES]
    return list(dict.fromkeys([*(x for d in local for x in _local_dependencies(d)), *local]))


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """A small Llama-style model, eager vs kp-patched: outputs, gradients, time and peak memory."""
    _install_torch(session)
    if _installing(session):
        session.install(*HF_DEPS)
    env = _install_packages(session, *PACKAGES)
    env.update(_cpu_env())
    session.run("python", str(ROOT / "benchmarks" / "demo.py"), *session.posargs, env=env)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks against the anchors in the same run (GPU only); writes benchmarks/results/<device>/."""
    _install_torch(session)
    if _installing(session):
        session.install("matplotlib", "tqdm")
    env = _install_packages(session, *PACKAGES)
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        session.run("python", str(script), *session.posargs, env=env)


@nox.session(python="3.11", tags=["ci"])
def docs(session: nox.Session) -> None:
    """The README's package table against packages/, then the site with its links checked (mkdocs --strict)."""
    if _installing(session):
        session.install("mkdocs>=1.6")
    session.run("python", str(ROOT / "docs" / "check_packages.py"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"))
