"""Every kp package's kernel modules fix their functions' Triton cache keys at import (kp_core.jit_keys), so a
kernel compiled once is found in the on-disk cache by every later process."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

PACKAGES = ("kp_core", "kp_norms", "kp_attention", "kp_precision", "kp_sparsity", "kp_losses")

# Imported with Triton compiling, not interpreting (the interpreter's functions have no key); no GPU is needed.
SCRIPT = """
import importlib, pkgutil, sys
from triton.runtime.jit import JITFunction
unkeyed, count = [], 0
for package in sys.argv[1:]:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == info.name:
                count += 1
                if value.hash is None:
                    try:
                        value.cache_key  # keyable here (an older Triton cannot key a kernel using newer tl)
                    except Exception:
                        continue
                    unkeyed.append(info.name + "." + name)
print(count, unkeyed)
"""


def test_every_kernel_module_keys_its_functions_at_import():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, *PACKAGES], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    count, unkeyed = run.stdout.split(maxsplit=1)
    assert int(count) >= 90, run.stdout  # 95 JIT functions in 18 modules today
    assert unkeyed.strip() == "[]", f"JIT functions not keyed at import: {unkeyed}"
