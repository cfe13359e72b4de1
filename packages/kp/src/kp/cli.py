"""`kp env` and `kp check SCRIPT`: the machine, and kp.check on a model a script builds.

SCRIPT is a Python file that defines `model` and `example_inputs` (positional arguments, a tensor or a tuple), or
a function `build()` returning both; `--mode infer` checks the forward only.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from kp.decisions import MODES, check
from kp.env import describe


def _load(script: str) -> tuple:
    scope = runpy.run_path(script, run_name="kp_check")
    if "build" in scope:
        return scope["build"]()
    if "model" in scope and "example_inputs" in scope:
        return scope["model"], scope["example_inputs"]
    raise SystemExit(f"kp check: {script} must define `model` and `example_inputs`, or `build()` returning both")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="GPU, versions, what kp can run here")
    chk = sub.add_parser("check", help="kp.check on the model SCRIPT builds")
    chk.add_argument("script")
    chk.add_argument("--mode", choices=MODES, default="train")
    chk.add_argument("--json", help="write the report's JSON (and markdown beside it) to this path prefix")
    args = parser.parse_args(argv)
    if args.command == "env":
        print(describe())
        return 0
    model, example_inputs = _load(args.script)
    report = check(model, example_inputs, mode=args.mode)
    if args.json:
        report.save(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
