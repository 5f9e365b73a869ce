"""The reference suites cannot pass empty: with LLAMAPROMPT_REQUIRE_REFERENCE set (as .ci/run
sets it), missing fixtures fail the run; without it they skip with the reason."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def _pytest(tmp_path, require: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLAMAPROMPT_REFERENCE_DIR": str(tmp_path / "nowhere")}
    env.pop("LLAMAPROMPT_REQUIRE_REFERENCE", None)
    if require:
        env["LLAMAPROMPT_REQUIRE_REFERENCE"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_reference.py",
            "tests/test_gguf.py::test_reference_model",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_missing_reference_fails_when_required(tmp_path):
    proc = _pytest(tmp_path, require=True)
    assert proc.returncode != 0, proc.stdout
    assert "LLAMAPROMPT_REQUIRE_REFERENCE is set" in proc.stdout


def test_missing_reference_skips_with_reason_otherwise(tmp_path):
    proc = _pytest(tmp_path, require=False)
    assert proc.returncode == 0, proc.stdout
    assert "skipped" in proc.stdout.splitlines()[-1]
    assert "no reference fixtures recorded from llama.cpp" in proc.stdout
