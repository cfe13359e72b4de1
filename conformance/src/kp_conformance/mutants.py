"""Planted bugs: does the conformance suite catch a one-token mistake in a kernel?

Each mutant changes one thing in the body of one `@triton.jit` function of a package (an operator, a
comparison, a constant, a dropped `mask=`/`other=`, swapped `tl.where` branches), runs that package's specs
against it under Triton's interpreter, and counts it killed (a test failed, crashed or timed out) or survived.

    python -m kp_conformance.mutants --package kp-norms --list
    python -m kp_conformance.mutants --package kp-norms --sample 20 --jobs 2 --out docs/mutants.md

A mutant's ID is `path:line:col:kind:original->replacement` (path under packages/<pkg>/src, col 1-based).
conformance/mutants/equivalent.txt lists IDs that cannot change behaviour, each with its reason.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import concurrent.futures
import io
import json
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

from kp_conformance import registry

ARITH = {"+": ["-", "*"], "-": ["+"], "*": ["/"], "/": ["*"], "//": ["%"], "%": ["//"]}
ARITH.update({f"{k}=": [f"{r}=" for r in v] for k, v in ARITH.items()})  # augmented: total += x
COMPARE = {"<": ["<=", ">"], "<=": ["<"], ">": [">=", "<"], ">=": [">"], "==": ["!="], "!=": ["=="]}
BOOLEAN = {"&": ["|"], "|": ["&"], "and": ["or"], "or": ["and"]}
# Constants whose change only breaks compilation (arange bounds, literal shapes, reduction axes): not planted.
SHAPE_CALLS = {"arange", "zeros", "full"}
SHAPE_KEYWORDS = {"axis", "num_stages", "num_warps"}
WORDS = (tokenize.NAME, tokenize.OP)  # the tokens an operator can be: + and `and`
# The properties a kernel bug can change; opcheck, compile and bad-input tests check the op's schema, tracing and
# argument checks (slow on the interpreter, blind to a kernel's arithmetic), so the mutant runs skip them.
SELECT = "not opcheck and not compile and not bad_input and not reference_is_independent"
START = time.monotonic()
OUTCOMES = ("killed-test", "killed-crash", "killed-timeout", "equivalent", "survived", "not run")
# Verdicts of a check: pytest.fail and "DID NOT RAISE" are Failed; GuardError is kp_conformance.guard's
# out-of-bounds-write check.
TEST_FAILURES = ("AssertionError", "Failed", "Flaky", "GuardError")


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str  # under packages/<pkg>/src
    line: int
    col: int
    function: str
    kind: str
    edits: tuple[tuple[int, int, str], ...]  # (start, end, text) character offsets in the file


@dataclass
class Result:
    id: str
    function: str
    kind: str
    mutated: str  # the mutated line, for the report
    outcome: str = "equivalent"  # or killed-test, killed-crash, killed-timeout, survived
    seconds: float = 0.0
    detail: str = ""


class _Source:
    """A file's text with AST positions (line, UTF-8 byte column) mapped to character offsets, and its tokens."""

    def __init__(self, text: str):
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        toks = tokenize.generate_tokens(io.StringIO(text).readline)
        self.tokens = [(self.offset(*t.start, chars=True), t.string) for t in toks if t.type in WORDS]

    def offset(self, line: int, col: int, chars: bool = False) -> int:
        if not chars:
            col = len(self.lines[line - 1].encode()[:col].decode())
        return self.starts[line - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)

    def operator(self, lo: int, hi: int) -> tuple[int, str]:
        """The operator between two operands, which end at lo and start at hi (only brackets besides it)."""
        i = bisect.bisect_left(self.tokens, lo, key=lambda t: t[0])
        found = next(t for t in self.tokens[i:] if t[1] not in "()")
        assert found[0] < hi, f"no operator between offsets {lo} and {hi}"
        return found

    def line_col(self, offset: int) -> tuple[int, int]:
        line = bisect.bisect_right(self.starts, offset)
        return line, offset - self.starts[line - 1] + 1


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator  # @triton.jit(...), @jit
    return ast.unparse(target).rsplit(".", 1)[-1] == "jit"


def _call_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    return ""


def _shape_constants(fn: ast.FunctionDef) -> set[int]:
    """ids of constant nodes whose change only breaks compilation."""
    skip = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.AnnAssign):
            skip.update(id(n) for n in ast.walk(node.annotation))
        if _call_name(node) in SHAPE_CALLS:
            shape_args = node.args if _call_name(node) == "arange" else node.args[:1]
            skip.update(id(n) for a in shape_args for n in ast.walk(a))
        if isinstance(node, ast.keyword) and node.arg in SHAPE_KEYWORDS:
            skip.update(id(n) for n in ast.walk(node.value))
    return skip


def _constants(value) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [v for v in dict.fromkeys([value + 1, 0 if value == 1 else value + 1]) if v != value]
    if isinstance(value, float):
        extra = [0.0] if value == 1.0 else [1.0] if value == 0.0 else []
        return [v for v in dict.fromkeys([2 * value, value + 1, *extra]) if v != value]
    return []


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, str) and node.value == 0


def _drop_keywords(src: _Source, call: ast.Call, names: set[str]) -> tuple[tuple[int, int, str], ...]:
    """Edits removing `, name=value` for each named keyword (from the end of the argument before it)."""
    args = [*call.args, *call.keywords]
    edits = [
        (src.end(args[i - 1]), src.end(a), "") for i, a in enumerate(args) if i and getattr(a, "arg", None) in names
    ]
    return tuple(edits)


def _mutations(src: _Source, fn: ast.FunctionDef):
    """(offset, kind, original, replacement, edits) for every mutation in fn's body."""
    skip = _shape_constants(fn)
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    for node in (n for stmt in body for n in ast.walk(stmt)):
        pairs = []  # (kind, table, lo, hi): an operator token between two operands
        if isinstance(node, ast.BinOp):
            kind = "bool" if isinstance(node.op, (ast.BitAnd, ast.BitOr)) else "arith"
            pairs.append((kind, BOOLEAN if kind == "bool" else ARITH, node.left, node.right))
        elif isinstance(node, ast.AugAssign):
            pairs.append(("arith", ARITH, node.target, node.value))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            pairs += [("compare", COMPARE, a, b) for a, b in zip(operands, operands[1:])]
        elif isinstance(node, ast.BoolOp):
            pairs += [("bool", BOOLEAN, a, b) for a, b in zip(node.values, node.values[1:])]
        for kind, table, left, right in pairs:
            at, op = src.operator(src.end(left), src.start(right))
            for repl in table.get(op, ()):  # not every operator is planted: **, <<, `is`, `in`
                yield at, kind, op, repl, ((at, at + len(op), repl),)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            at = src.start(node)
            yield at, "neg", "-x", "x", ((at, at + 1, ""),)
        if isinstance(node, ast.Constant) and id(node) not in skip:
            at, end = src.start(node), src.end(node)
            for value in _constants(node.value):
                yield at, "const", src.text[at:end], repr(value), ((at, end, repr(value)),)
        name, kw = _call_name(node), {k.arg: k.value for k in getattr(node, "keywords", ())}
        if name in ("load", "store") and "mask" in kw:
            # A load's `other` needs its mask: dropping the mask drops both.
            dropped = "mask,other" if "other" in kw else "mask"
            yield src.start(node), "mask", dropped, "none", _drop_keywords(src, node, {"mask", "other"})
        # Triton's interpreter fills masked-off lanes with zeros when `other` is absent, so dropping
        # `other=0` is unobservable on the CPU (its value is still planted by const: 0.0->1.0).
        if name == "load" and "other" in kw and not _is_zero(kw["other"]):
            yield src.start(node), "other", "other", "none", _drop_keywords(src, node, {"other"})
        if name == "where" and len(node.args) == 3 and not node.keywords:
            a, b = node.args[1:]
            edits = ((src.start(a), src.end(a), ast.get_source_segment(src.text, b)),)
            edits += ((src.start(b), src.end(b), ast.get_source_segment(src.text, a)),)
            yield src.start(node), "where", "c,a,b", "c,b,a", edits


def apply(text: str, edits) -> str:
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def find_mutants(src_dir: Path) -> list[Mutant]:
    mutants = {}
    for path in sorted(src_dir.rglob("*.py")):
        rel = path.relative_to(src_dir).as_posix()
        src = _Source(path.read_text())
        tree = ast.parse(src.text)
        jitted = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(map(_is_jit, n.decorator_list))]
        for fn in jitted:
            # The function's own lines, parsed once per mutant: a splice error is this tool's bug, not a kill.
            lo, hi = src.starts[fn.lineno - 1], src.end(fn)
            prefix = "if 1:\n" if fn.col_offset else ""  # an indented def parses inside a block
            for at, kind, orig, repl, edits in _mutations(src, fn):
                line, col = src.line_col(at)
                mid = f"{rel}:{line}:{col}:{kind}:{orig}->{repl}"
                mutants[mid] = Mutant(mid, rel, line, col, fn.name, kind, edits)
                ast.parse(prefix + apply(src.text[lo:hi], [(a - lo, b - lo, t) for a, b, t in edits]), mid)
    return sorted(mutants.values(), key=lambda m: (m.path, m.line, m.col, m.id))


def _copy_tree(root: Path, dest: Path) -> Path:
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", ".nox", "dist", "build", "*.egg-info", "reports")
    for name in ("packages", "conformance"):
        shutil.copytree(root / name, dest / name, ignore=junk)
    return dest


def _env(tree: Path, tier: str) -> dict[str, str]:
    srcs = sorted(str(p) for p in (tree / "packages").glob("*/src")) + [str(tree / "conformance" / "src")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(srcs), "TRITON_INTERPRET": "1", "KP_TIER": tier}
    # No bytecode: a mutant and the original can share a size and an mtime second, and a stale .pyc would win.
    env.update(KP_REPORT_DIR=str(tree / "reports"), PYTHONDONTWRITEBYTECODE="1")
    env["COLUMNS"] = "1000"  # else pytest's summary line drops the exception name to fit 80 columns
    env.setdefault("OMP_NUM_THREADS", "1")  # parallel runs come from --jobs; the interpreter is Python-bound
    return env


def _pytest(tree: Path, tests: list[str], tier: str, timeout: float | None, select: str) -> tuple[str, float, str]:
    """(outcome, seconds, detail): passed, killed-test, killed-crash or killed-timeout."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests, "-k", select]
    t0 = time.monotonic()
    # In our process group: Ctrl-C stops it too. pytest without xdist starts no processes of its own.
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen(cmd, cwd=tree, env=_env(tree, tier), **pipes)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return "killed-timeout", time.monotonic() - t0, f"over {timeout:.0f} s"
    seconds = time.monotonic() - t0
    if proc.returncode == 0:
        return "passed", seconds, ""
    failed = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - ([\w.]+)(.*))?$", out, re.M)
    exc = (failed.group(2) or "").rsplit(".", 1)[-1] if failed else ""
    detail = " ".join(failed.group(1, 2, 3))[:200] if failed and exc else out.strip()[-200:]
    if proc.returncode < 0:  # a segfault in the interpreter (an out-of-bounds access), say
        detail = f"killed by signal {-proc.returncode}"
    # A failed check is a kill by a test; an exception in the kernel or at import is a crash. Hypothesis
    # reports several distinct failures as an ExceptionGroup.
    grouped_asserts = exc.endswith("ExceptionGroup") and "AssertionError" in out
    by_test = proc.returncode == 1 and (exc in TEST_FAILURES or grouped_asserts)
    return ("killed-test" if by_test else "killed-crash"), seconds, detail


def load_equivalent(path: Path) -> dict[str, str]:
    """ID -> reason from lines `ID  reason`; blank lines and # comments skipped."""
    lines = path.read_text().splitlines() if path.is_file() else []
    pairs = [line.split(None, 1) for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return {p[0]: p[1].strip() if len(p) > 1 else "" for p in pairs}


def mutated_line(src_dir: Path, m: Mutant) -> str:
    text = (src_dir / m.path).read_text()
    return apply(text, m.edits).splitlines()[m.line - 1].strip()


def run(root: Path, package: str, mutants: list[Mutant], equivalent: dict, opts) -> tuple[list[Result], float]:
    src_rel = Path("packages") / package / "src"
    # the mutated lines for the report, read now: the working tree may change while the mutants run
    lines = {m.id: mutated_line(root / src_rel, m) for m in mutants}
    with tempfile.TemporaryDirectory(prefix="kp-mutants-") as tmp:
        trees = queue.Queue()  # one copy of the repo per job; a job restores its file after each mutant
        for j in range(opts.jobs):
            trees.put(_copy_tree(root, Path(tmp) / f"w{j}"))
        tree = trees.get()
        outcome, baseline, detail = _pytest(tree, opts.tests, opts.tier, None, opts.select)
        trees.put(tree)
        if outcome != "passed":
            sys.exit(f"the unmutated baseline fails ({outcome}: {detail}); fix it before planting bugs")
        print(f"baseline passed in {baseline:.1f} s", flush=True)
        timeout = min(3 * baseline + 30, opts.timeout or float("inf"))
        stop_at = START + opts.deadline if opts.deadline else None

        def one(m: Mutant) -> Result:
            r = Result(m.id, m.function, m.kind, lines[m.id], detail=equivalent.get(m.id, ""))
            if m.id in equivalent:
                return r
            if stop_at and time.monotonic() > stop_at:
                r.outcome, r.detail = "not run", "past --deadline"
                return r
            tree = trees.get()
            target = tree / src_rel / m.path
            original = target.read_text()
            try:
                target.write_text(apply(original, m.edits))
                outcome, r.seconds, r.detail = _pytest(tree, opts.tests, opts.tier, timeout, opts.select)
                r.outcome = "survived" if outcome == "passed" else outcome
            finally:
                target.write_text(original)
                trees.put(tree)
            return r

        results = {}
        with concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
            futures = {pool.submit(one, m): m.id for m in mutants}
            for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
                r = results[futures[future]] = future.result()
                print(f"[{i}/{len(mutants)}] {r.outcome:<14} {r.seconds:6.1f} s  {r.id}", flush=True)
    return [results[m.id] for m in mutants], baseline


def summarize(results: list[Result], **extra) -> dict:
    n = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    killed = n["killed-test"] + n["killed-crash"] + n["killed-timeout"]
    scored = len(results) - n["equivalent"] - n["not run"]
    mean = sum(r.seconds for r in results if r.outcome != "not run") / scored if scored else 0.0
    caught = round(100 * killed / scored, 1) if scored else None
    return {"planted": len(results), **n, "caught_pct": caught, "mean_s": round(mean, 1), **extra}


def markdown(package: str, s: dict, results: list[Result]) -> str:
    cell = lambda text: "`" + text.replace("|", "\\|") + "`"  # noqa: E731  (a | inside a table cell)
    caught = "n/a" if s["caught_pct"] is None else f"{s['caught_pct']:.1f} %"
    lines = [
        f"## {package}\n",
        f"{s['date']}, tier `{s['tier']}`, {s['planted']} of {s['total']} mutants (seed {s['seed']}), "
        f"{s['jobs']} job(s). Tests: `{s['command']}`\n",
        "| planted | killed: test | killed: crash | killed: timeout | equivalent | survived | not run | caught |",
        "|---|---|---|---|---|---|---|---|",
        "| " + " | ".join(str(s[k]) for k in ("planted", *OUTCOMES)) + f" | {caught} |\n",
        f"Caught = killed / (planted - equivalent - not run). Baseline (unmutated) run {s['baseline_s']:.1f} s; "
        f"mutants {s['mean_s']:.1f} s each on average, {s['wall_s']:.0f} s wall in all.\n",
    ]
    survivors = [r for r in results if r.outcome == "survived"]
    if survivors:
        lines += ["Survivors: a missing test, or an equivalent mutant to add to conformance/mutants/equivalent.txt.\n"]
        lines += ["| file:line | function | mutation | mutated line |", "|---|---|---|---|"]
        for r in survivors:
            path, line, _, kind, change = r.id.split(":", 4)
            lines.append(f"| {path}:{line} | `{r.function}` | {kind} {cell(change)} | {cell(r.mutated)} |")
        lines.append("")
    if s["stale"]:
        lines.append("Equivalent-list IDs that match no mutant (stale after an edit?): " + ", ".join(s["stale"]) + "\n")
    return "\n".join(lines)


def write_markdown(path: Path, package: str, section: str) -> None:
    """Replace this package's section of the report, keeping the other packages'."""
    text = path.read_text() if path.is_file() else "# Planted bugs (mutation testing)\n\nWritten by `nox -s mutants`.\n"
    pattern = re.compile(rf"^## {re.escape(package)}\n.*?(?=^## |\Z)", re.M | re.S)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def package_tests(root: Path) -> dict[str, list[str]]:
    """package -> the spec files its mutants run, from the spec registry (kp_conformance.registry): the specs whose
    `package` it is, and for kp-core, whose Triton helpers (kp_core.activation_kernels) run inside the other
    packages' kernels, every spec that covers registered kernels. Packages under root/packages only."""
    specs = registry.load_specs(root)
    tests = {}
    for name, spec in specs.items():
        tests.setdefault(spec.package, []).append(registry.spec_file(name))
    kernels = [registry.spec_file(name) for name in registry.kernel_specs(specs)]
    tests["kp-core"] = list(dict.fromkeys(tests.get("kp-core", []) + kernels))
    return {package: files for package, files in tests.items() if (root / "packages" / package / "src").is_dir()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kp_conformance.mutants", description=__doc__.splitlines()[0])
    p.add_argument("--package", required=True, help="a package under packages/ (its specs: the spec registry's)")
    p.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (default: current directory)")
    p.add_argument("--tests", nargs="+", help="spec files to run, relative to the root (default: the package's)")
    p.add_argument("--tier", default=os.environ.get("KP_TIER", "micro"))
    p.add_argument("--select", default=SELECT, help="pytest -k expression (default: the value properties)")
    p.add_argument("--deadline", type=float, help="start no mutant this many seconds after the start (not run)")
    p.add_argument("--timeout", type=float, help="cap on a mutant's seconds (default 3x the baseline + 30)")
    p.add_argument("--sample", type=int, help="run N mutants drawn at random (see --seed); default all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", nargs="+", metavar="ID", help="run just these mutant IDs (e.g. a report's survivors)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--list", action="store_true", help="list the mutants and the count per kind; run nothing")
    p.add_argument("--out", type=Path, help="markdown report (this package's section is replaced)")
    p.add_argument("--json", type=Path, help="the summary and every mutant's result")
    opts = p.parse_args(argv)
    root = opts.root.resolve()
    if not (root / "packages" / opts.package / "src").is_dir():
        p.error(f"{root} is not the kp repository (no packages/{opts.package}/src): pass --root")
    if not opts.tests:
        tests = package_tests(root)
        if opts.package not in tests:
            p.error(f"argument --package: no spec covers {opts.package} (choose from {', '.join(sorted(tests))})")
        opts.tests = tests[opts.package]
    mutants = find_mutants(root / "packages" / opts.package / "src")
    equivalent = load_equivalent(root / "conformance" / "mutants" / "equivalent.txt")
    if opts.list:
        for m in mutants:
            print(f"{m.id}  [{m.function}]{'  (equivalent)' if m.id in equivalent else ''}")
        kinds = sorted({m.kind for m in mutants})
        print(f"{len(mutants)} mutants: " + ", ".join(f"{k} {sum(m.kind == k for m in mutants)}" for k in kinds))
        return
    chosen = mutants
    if opts.only:
        unknown = set(opts.only) - {m.id for m in mutants}
        if unknown:
            p.error(f"no such mutant: {', '.join(sorted(unknown))} (see --list)")
        chosen = [m for m in mutants if m.id in opts.only]
    elif opts.sample is not None and opts.sample < len(mutants):
        picked = set(random.Random(opts.seed).sample(range(len(mutants)), opts.sample))
        chosen = [m for i, m in enumerate(mutants) if i in picked]
    t0 = time.monotonic()
    results, baseline = run(root, opts.package, chosen, equivalent, opts)
    ids, module = {m.id for m in mutants}, opts.package.replace("-", "_")
    summary = summarize(
        results,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        tier=opts.tier,
        command="TRITON_INTERPRET=1 pytest -x -q -p no:cacheprovider " + " ".join(opts.tests),
        total=len(mutants),
        seed=opts.seed,
        jobs=opts.jobs,
        baseline_s=round(baseline, 1),
        wall_s=round(time.monotonic() - t0, 1),
        stale=sorted(k for k in equivalent if k.startswith(f"{module}/") and k not in ids),
    )
    section = markdown(opts.package, summary, results)
    print("\n" + section)
    if opts.out:
        write_markdown(opts.out, opts.package, section)
    if opts.json:
        opts.json.write_text(json.dumps({"summary": summary, "mutants": [asdict(r) for r in results]}, indent=1))


if __name__ == "__main__":
    main()
