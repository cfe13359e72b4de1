"""kp: every kp package in one install, and `kp.optimize(model, example_inputs)`, which puts the fastest kernel
that passes its check in each layer of the model, on this GPU, and never makes the step slower.

    import kp
    report = kp.optimize(model, (batch,))      # in place; kp.restore(model) undoes it
    kp.optimize(model, (batch,), timer=kp.graph_timer)   # for a model that will be compiled or graphed
    kp.optimize(model, (batch,), timer=kp.compiled_timer())  # ... and its whole step checked compiled
    kp.check(model, (batch,))                  # the checks alone
"""

from kp.cache import path as cache_path
from kp.decisions import check, optimize, restore
from kp.env import describe, environment
from kp.measure import compiled_timer, default_timer, graph_timer, rank0_timer
from kp.report import Layer, Report, Tried

__version__ = "0.1.0"

__all__ = [
    "Layer",
    "Report",
    "Tried",
    "cache_path",
    "check",
    "compiled_timer",
    "default_timer",
    "describe",
    "environment",
    "graph_timer",
    "optimize",
    "rank0_timer",
    "restore",
]
