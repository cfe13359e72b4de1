"""`python -m kp ...`: the `kp` command where the package is on the path but not installed (a checkout)."""

from kp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
