"""`kp env` and `kp check SCRIPT`."""

import json
import textwrap

import pytest

from kp import cli


def test_env_names_the_device_versions_and_what_can_run(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for line in ("torch:", "kp_norms:", "device:", "triton kernels:", "float8 matmul:"):
        assert line in out, out


def test_check_runs_kp_check_on_the_model_a_script_builds(tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build():
                torch.manual_seed(0)
                return nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)), (torch.randn(4, 32),)
            """
        )
    )
    assert cli.main(["check", str(script), "--mode", "infer", "--json", str(tmp_path / "report")]) == 0
    assert "kp_norms.LayerNorm" in capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    layer = next(layer for layer in report["layers"] if layer["name"] == "1")
    assert [(t["name"], t["status"]) for t in layer["tried"]] == [("kp_norms.LayerNorm", "checked")]
    assert (tmp_path / "report.md").read_text().startswith("# kp.check (infer)")


def test_check_says_what_a_script_must_define(tmp_path):
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="must define `model` and `example_inputs`, or `build"):
        cli.main(["check", str(script)])
