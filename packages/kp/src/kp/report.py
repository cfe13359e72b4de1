"""What kp.optimize and kp.check found, per layer: a terminal table, JSON and markdown."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass
class Tried:
    """One candidate on one layer.

    Attributes:
        name: the candidate's name ("kp_norms.RMSNorm", "float8 rowwise", ...).
        status: "chosen", "slower", "refused", "not applicable", "reverted" or "checked".
        ms: its measured time, or None.
        peak_mib: its measured peak memory in MiB, or None.
        error: the check's worst line (error against float64, and the bound or budget).
        note: anything else said about it.

    Examples:
        >>> import torch
        >>> import kp
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
        >>> report = kp.check(model, (torch.randn(8, 64),), report=False)
        >>> [(t.name, t.status) for t in report.layers[1].tried]
        [('kp_norms.RMSNorm', 'checked')]
    """

    name: str
    status: str  # "chosen", "slower", "refused", "not applicable", "reverted", "checked"
    ms: float | None = None
    peak_mib: float | None = None
    error: str = ""  # the check's worst line (error against float64, bound or budget)
    note: str = ""


@dataclasses.dataclass
class Layer:
    """One layer kp has candidates for, in a Report.

    Attributes:
        name: the layer's name in the model ("model.layers.0.mlp").
        kind: what it is ("linear", "rms_norm", "layer_norm", "gated_mlp", "attention", ...).
        torch_ms: PyTorch's own layer's time, or None (kp.check times nothing).
        tried: a Tried per candidate.
        choice: the chosen candidate's name, or "torch".
        why: the reason for the choice.
        cached: whether the times came from the cache (kp.cache_path()).
        torch_peak_mib: PyTorch's layer's peak memory in MiB, or None.

    Examples:
        >>> import torch
        >>> import kp
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
        >>> report = kp.check(model, (torch.randn(8, 64),), report=False)
        >>> [(layer.name, layer.kind, layer.choice) for layer in report.layers]
        [('0', 'linear', 'torch'), ('1', 'rms_norm', 'torch')]
    """

    name: str
    kind: str
    torch_ms: float | None
    tried: list[Tried]
    choice: str  # a candidate's name, or "torch"
    why: str
    cached: bool = False  # the times came from the cache (kp.cache_path())
    torch_peak_mib: float | None = None


@dataclasses.dataclass
class Report:
    """What kp.optimize or kp.check did: per layer, every candidate tried and the choice, with the reasons.

    Attributes:
        mode: "train" or "infer".
        environment: kp.environment() of the run.
        action: "optimize" or "check".
        layers: a Layer per layer considered.
        step: the whole step's times (torch_ms, kp_ms, the layers reverted to keep it from being slower).
        seconds: the call's own time.
        chosen: layer name -> the candidate kept, for the layers changed.

    `text()` is the terminal table kp.optimize prints, `markdown()` the same as markdown, `to_dict()` /
    `to_json()` the data, `save(prefix)` writes prefix.json and prefix.md.

    Examples:
        >>> import torch
        >>> import kp
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
        >>> report = kp.check(model, (torch.randn(8, 64),), report=False)
        >>> report.action, report.mode, report.chosen
        ('check', 'train', {})
        >>> sorted(report.to_dict())
        ['action', 'environment', 'layers', 'mode', 'seconds', 'step']
    """

    mode: str
    environment: dict
    action: str = "optimize"  # or "check": nothing timed, nothing changed
    layers: list[Layer] = dataclasses.field(default_factory=list)
    step: dict = dataclasses.field(default_factory=dict)  # the whole step's times: torch, kp, reverted layers
    seconds: float = 0.0  # optimize's own time

    @property
    def chosen(self) -> dict[str, str]:
        """Layer name -> the candidate kept, for the layers changed."""
        return {layer.name: layer.choice for layer in self.layers if layer.choice != "torch"}

    def to_dict(self) -> dict:
        """The whole report as plain data (dataclasses.asdict)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """to_dict() as JSON."""
        return json.dumps(self.to_dict(), indent=1)

    def rows(self) -> list[list[str]]:
        """The table's rows: per layer, one per candidate tried, then PyTorch's own."""
        rows = []
        for layer in self.layers:
            for t in layer.tried:
                speed = f"{layer.torch_ms / t.ms:.2f}x" if t.ms and layer.torch_ms else "-"
                rows.append([layer.name, t.name, t.status, _num(t.ms), speed, _num(t.peak_mib, 0), t.error or t.note])
            kept = "kept" if layer.choice == "torch" else ""
            rows.append(
                [layer.name, "torch", kept, _num(layer.torch_ms), "1.00x", _num(layer.torch_peak_mib, 0), layer.why]
            )
        return rows

    def text(self) -> str:
        """The terminal table kp.optimize and kp.check print."""
        head = list(HEAD)
        rows = [head, *self.rows()]
        widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(head) - 1)]
        lines = [
            f"kp.{self.action} ({self.mode}) on {self.environment.get('device', '?')}: {len(self.layers)} layers, "
            f"{len(self.chosen)} changed, {self.seconds:.1f} s"
        ]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        if self.step:
            lines.append(_step_line(self.step))
        return "\n".join(lines)

    def markdown(self) -> str:
        """The table as a markdown page."""
        head = list(HEAD)
        lines = [
            f"# kp.{self.action} ({self.mode})",
            "",
            f"{self.environment}",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in self.rows()]
        if self.step:
            lines += ["", _step_line(self.step)]
        return "\n".join(lines) + "\n"

    def save(self, prefix: str | Path) -> None:
        """prefix.json and prefix.md."""
        prefix = Path(prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prefix.with_suffix(".json").write_text(self.to_json() + "\n")
        prefix.with_suffix(".md").write_text(self.markdown())


HEAD = ("layer", "candidate", "status", "ms", "vs torch", "peak MiB", "check / why")


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _step_line(step: dict) -> str:
    line = f"whole step: torch {step['torch_ms']:.3f} ms, kp {step['kp_ms']:.3f} ms"
    if step.get("reverted"):
        line += f"; reverted to keep it from being slower: {', '.join(step['reverted'])}"
    return line
