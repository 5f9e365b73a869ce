"""The Python examples in the docs run as written (in order, one namespace per file)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import llamaprompt

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("name", ["overrides.md", "datasets.md"])
def test_doc_examples_run(name, capsys):
    text = (DOCS / name).read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    ns: dict = {}
    try:
        for block in blocks:
            exec(compile(block, f"{name}", "exec"), ns)
    finally:
        for hook, _ in llamaprompt.registered_hooks():
            llamaprompt.unregister_hook(hook)
    out = capsys.readouterr().out
    if name == "overrides.md":
        assert "Expected iterable" in out
    if name == "datasets.md":
        assert "['<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n', None]" in out
        assert "[None, \"Expected 'content' to be a string or an array\"]" in out
    if name == "overrides.md":
        assert ns["t"].apply_template({"messages": [{"role": "user", "content": "x"}]}) == "x|none"
