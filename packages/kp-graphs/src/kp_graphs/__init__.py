"""kp-graphs: CUDA graphs with shape buckets (graphed), a shared memory pool, and eager fallback."""

from kp_graphs.graphed import CaptureError, Graphed, graphed
from kp_graphs.stats import report

__all__ = ["CaptureError", "Graphed", "graphed", "report"]
__version__ = "0.1.0"
