"""The Python examples in the docs run as written (in order, one namespace per file)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import llamaprompt
from conftest import load_reference

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("name", ["overrides.md", "datasets.md", "transformers.md"])
def test_doc_examples_run(name, capsys, caplog):
    if name == "datasets.md":
        pytest.importorskip("pyarrow", reason="docs/datasets.md's examples need the datasets extra (pyarrow)")
    text = (DOCS / name).read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    ns: dict = {}
    try:
        with caplog.at_level("WARNING", logger="llamaprompt"):
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
        # the fine-tuning example prints llama-server's renderings without and with --no-prefill-assistant
        ref = load_reference("apply_template.json")["variants"][0]["templates"]["Qwen-Qwen3-0.6B.jinja"]["cases"]
        other = load_reference("apply_template_server_args.json")["variants"]
        closed = next(v for v in other if v["server_args"] == ["--no-prefill-assistant"])["templates"]
        served, trained = ref["no_generation_prompt"], closed["Qwen-Qwen3-0.6B.jinja"]["cases"]["no_generation_prompt"]
        printed = [line for line in out.splitlines() if "Hello!" in line]
        assert printed == [repr([served["prompt"]]), repr([trained["prompt"]])]
        assert f"```text\n{printed[0]}\n{printed[1]}\n```" in text  # the page shows what runs
        assert "[None, \"Expected 'content' to be a string or an array\"]" in out
    if name == "transformers.md":  # the examples assert their own claims; the warning they mention:
        assert any("'enable_thinking'" in r.getMessage() for r in caplog.records)
    if name == "overrides.md":
        assert ns["t"].apply_template({"messages": [{"role": "user", "content": "x"}]}) == "x|none"
