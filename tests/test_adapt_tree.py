"""third_party/adapt_tree.py, the configure-time probe: it adapts to what a tree has and fails
loudly -- naming the file and the text -- when a rewrite target moved or upstream logic that
llamaprompt restates changed. Exercised on a copy of the tree this module was built from,
edited the way upstream might edit it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llamaprompt
from conftest import REPO

SCRIPT = REPO / "third_party" / "adapt_tree.py"


def _source_tree() -> Path:
    for cand in (llamaprompt.tree_info().get("tree_dir"), REPO / "third_party" / "llama.cpp"):
        if cand and (Path(cand) / "common" / "chat.cpp").is_file():
            return Path(cand)
    pytest.skip("no llama.cpp tree on disk (the build fills third_party/llama.cpp)")


@pytest.fixture
def tree(tmp_path) -> Path:
    src = _source_tree()
    dst = tmp_path / "tree"
    shutil.copytree(src / "common", dst / "common")
    (dst / "tools" / "server").mkdir(parents=True)
    for f in (src / "tools" / "server").glob("*.[ch]*"):
        if f.is_file():
            shutil.copy(f, dst / "tools" / "server" / f.name)
    (dst / "src").mkdir()
    shutil.copy(src / "src" / "llama-vocab.cpp", dst / "src")
    return dst


def _run(tree: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(tree), str(tmp_path / "out")],
                          capture_output=True, text=True)


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) >= count, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new))


def _insert_before(path: Path, anchor: str, text: str) -> None:
    """Add upstream-looking code before the first occurrence of anchor."""
    content = path.read_text()
    assert anchor in content, f"{anchor!r} not in {path}"
    path.write_text(content.replace(anchor, text + anchor, 1))


def test_unchanged_tree_configures_with_the_built_features(tree, tmp_path):
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    header = (tmp_path / "out" / "generated" / "lp_tree.h").read_text()
    info = json.loads(json.loads(header.split("LP_TREE_INFO_JSON ", 1)[1].strip()))
    # the module was built by this very probe from the same files
    assert info["features"] == llamaprompt.features
    assert all(r["applied"] or "skipped" in r for r in info["rewrites"])
    assert (tmp_path / "out" / "generated" / "chat.cpp").read_text().count("llamaprompt_analyze_template(") == 1


@pytest.mark.parametrize(
    ("rel", "old", "new", "expected"),
    [
        # a renamed call site
        ("common/chat.cpp", "autoparser.analyze_template(tmpl)", "autoparser.analyze_template(tmpl, 1)",
         ["common/chat.cpp", "'autoparser.analyze_template(tmpl)' not found"]),
        # llama-server fills server_chat_params from another source
        ("tools/server/server-context.cpp", "/* media_path            */ params_base.media_path",
         "/* media_path            */ params_base.media_dir",
         ["server-context.cpp", "media_path=params_base.media_dir"]),
        # a new input of the parser generation that the parser-inputs key does not cover
        ("common/chat-auto-parser.h", "    json                                  extra_context;",
         "    json                                  extra_context;\n    bool new_upstream_flag = false;",
         ["generation_params fields changed (new: ['new_upstream_flag']"]),
        # a vocab assert whose condition src/cpp/model.cpp checks first
        ("src/llama-vocab.cpp", 'word = "[EMPTY_" + std::to_string(i) + "]";',
         'word = "<EMPTY_" + std::to_string(i) + ">";', ["src/llama-vocab.cpp", "[EMPTY_"]),
    ],
    ids=["moved-call-site", "server-chat-params", "generation-params", "vocab-assert"],
)
def test_upstream_drift_fails_with_file_and_text(tree, tmp_path, rel, old, new, expected):
    _edit(tree / rel, old, new)
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1
    for text in expected:
        assert text in proc.stderr


def test_pattern_count_is_exact(tree, tmp_path):
    path = tree / "common" / "jinja" / "runtime.cpp"
    path.write_text(path.read_text() + "\n// res->val_str.append(str)\n")
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1
    assert "occurs 2 times, expected 1" in proc.stderr and "common/jinja/runtime.cpp" in proc.stderr


def test_rewrite_of_absent_code_is_skipped_with_what_is_lost(tree, tmp_path):
    path = tree / "common" / "arg.cpp"
    text = path.read_text()
    if "common_params_apply_system_config(" not in text:
        pytest.skip("this tree has no config.ini support to remove")
    path.write_text(text.replace("common_params_apply_system_config", "removed_upstream_function"))
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    cmake = (tmp_path / "out" / "lp_tree.cmake").read_text()
    assert "rewrite skipped (lost: nothing: this tree's argument parser reads no config.ini files)" in cmake


def test_flag_that_exits_must_be_refused(tree, tmp_path):
    _insert_before(tree / "common" / "arg.cpp", "    add_opt(common_arg(\n",
                   '    add_opt(common_arg(\n        {"--print-something"},\n        "print and exit",\n'
                   '        [](common_params &) {\n            exit(0);\n        }\n    ));\n')
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1
    assert "--print-something call exit()" in proc.stderr and "server_args_refused.inc" in proc.stderr


def test_missing_both_thinking_tag_shapes_fails(tree, tmp_path):
    path = tree / "common" / "chat.h"
    text = path.read_text().replace("thinking_end_tags;", "closing_tags;").replace("thinking_end_tag;", "closing_tag;")
    path.write_text(text)
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1 and "thinking_end_tag" in proc.stderr


def test_the_module_names_its_tree():
    info = llamaprompt.tree_info()
    assert info["commit"] == llamaprompt.LLAMA_CPP_COMMIT != ""
    assert info["caps_keys"] == sorted(info["caps_keys"]) and "supports_tools" in info["caps_keys"]
    assert ("supports_reasoning_effort" in info["caps_keys"]) == llamaprompt.features["caps_reasoning_effort"]
    described = llamaprompt.ChatTemplate("{{ messages[0].content }}").describe()
    assert described["llama_cpp_commit"] == llamaprompt.LLAMA_CPP_COMMIT
    assert described["llama_cpp_source"] == llamaprompt.LLAMA_CPP_SOURCE
    out = subprocess.run([sys.executable, "-c", "from llamaprompt.cli import main; main(['--version'])"],
                         capture_output=True, text=True)
    assert llamaprompt.LLAMA_CPP_COMMIT in out.stdout + out.stderr


def test_missing_feature_raises_feature_error(monkeypatch):
    from llamaprompt import tree

    monkeypatch.setitem(tree.features, "parse", False)
    template = llamaprompt.ChatTemplate("{{ messages[0].content }}")
    params = template.apply({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(llamaprompt.FeatureError, match=f"commit {llamaprompt.LLAMA_CPP_COMMIT}"):
        params.parse("hello")


def test_vocab_fields_are_read_from_the_tree(tree, tmp_path):
    fields = llamaprompt.tree_info()["vocab_fields"]
    assert {"preserved_tokens", "logit_bias"} <= set(fields)
    assert not set(fields) & {"chat_format", "chat_parser", "reasoning_format", "parse_tool_calls"}
    schema = tree / "tools" / "server" / "server-schema.cpp"
    if not schema.exists():
        pytest.skip("this tree's request schema is server_task::params_from_json_cmpl")
    _insert_before(schema, "    add((new field_",
                   '    add((new field_str("new_token_field"))\n        ->set_handler([&](field_eval_context & ctx, '
                   'const json & data) {\n            GGML_ASSERT(ctx.vocab != nullptr);\n        }));\n')
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    header = (tmp_path / "out" / "generated" / "lp_tree.h").read_text()
    assert '"new_token_field"' in header.split("LP_VOCAB_FIELDS", 1)[1].splitlines()[0]


def _features(tmp_path: Path) -> dict:
    header = (tmp_path / "out" / "generated" / "lp_tree.h").read_text()
    return json.loads(json.loads(header.split("LP_TREE_INFO_JSON ", 1)[1].strip()))["features"]


def test_template_inputs_capture_points_are_probed(tree, tmp_path):
    """template_inputs needs three things of the tree; one gone (here jinja::context's env member,
    renamed) makes the feature absent -- configure goes on, the module raises FeatureError --
    while the call site moving inside common_chat_template_direct_apply_impl fails with the text."""
    assert _run(tree, tmp_path).returncode == 0 and _features(tmp_path)["template_inputs"]
    _edit(tree / "common" / "jinja" / "runtime.h", "value_object env;", "value_object vars_;")
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _features(tmp_path)["template_inputs"] is False
    assert "not in this tree: common/chat.cpp: common_chat_template_direct_apply_impl" in (
        tmp_path / "out" / "lp_tree.cmake"
    ).read_text()
    _edit(tree / "common" / "chat.cpp", "jinja::global_from_json(ctx, inp, inputs.mark_input);",
          "jinja::global_from_json(ctx, inp, true);")
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1
    assert "common/chat.cpp" in proc.stderr and "jinja::global_from_json(ctx, inp, inputs.mark_input);" in proc.stderr
