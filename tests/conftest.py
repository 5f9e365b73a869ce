"""Shared test helpers: the reference fixtures (../shared/reference, recorded by an
unmodified llama-server from the pinned llama.cpp commit) and date masking."""

from __future__ import annotations

import datetime as _dt
import json
import os
from functools import cache
from pathlib import Path

import pytest

import llamaprompt

REPO = Path(__file__).resolve().parent.parent


def reference_dir() -> Path:
    env = os.environ.get("LLAMAPROMPT_REFERENCE_DIR")
    if env:
        return Path(env)
    # the clone sits next to shared/ (…/main and …/shared)
    for base in (REPO.parent, REPO):
        cand = base / "shared" / "reference"
        if cand.is_dir():
            return cand
    return REPO.parent / "shared" / "reference"


@cache
def load_reference(name: str) -> dict:
    path = reference_dir() / name
    if not path.exists():
        pytest.skip(f"reference fixtures not found: {path} (set LLAMAPROMPT_REFERENCE_DIR)")
    return json.loads(path.read_text(encoding="utf-8"))


# The date formats templates print (common_chat_extra_context's "%b %d %Y" and
# "%d %b %Y", and the strftime_now formats used by the pinned tree's templates).
DATE_FORMATS = ("%d %b %Y", "%b %d %Y", "%Y-%m-%d", "%B %d, %Y")


def mask_dates(prompt: str, rendered_on: str) -> str:
    """Put the fixture's rendering day in place of today's date, in every format that
    templates print (the reference README's rule for date-printing templates)."""
    ref = _dt.date.fromisoformat(rendered_on)
    today = _dt.date.today()
    if today == ref:
        return prompt
    for fmt in DATE_FORMATS:
        prompt = prompt.replace(today.strftime(fmt), ref.strftime(fmt))
    return prompt


def llama_cpp_models_dir() -> Path | None:
    """models/ of the llama.cpp tree the package was built from (the vocab GGUFs live there)."""
    env = os.environ.get("LLAMAPROMPT_LLAMA_CPP_DIR")
    for base in ([Path(env)] if env else []) + [REPO / "third_party" / "llama.cpp"]:
        if (base / "models").is_dir():
            return base / "models"
    return None


def vocab_gguf(name: str) -> Path:
    models = llama_cpp_models_dir()
    path = models / name if models else None
    if path is None or not path.exists():
        pytest.skip(f"{name} not found (third_party/llama.cpp is filled by the build)")
    return path


def template_path(name: str) -> Path:
    return llamaprompt.pinned_template(name)


@pytest.fixture(scope="session")
def qwen3() -> llamaprompt.ChatTemplate:
    return llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"))
