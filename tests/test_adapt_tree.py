"""third_party/adapt_tree.py, the configure-time probe: it adapts to what a tree has and fails
loudly -- naming the file and the text -- when a rewrite target moved or upstream logic that
llamaprompt restates changed. Exercised on a copy of the tree this module was built from,
edited the way upstream might edit it."""

from __future__ import annotations

import difflib
import json
import re
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
    shutil.copytree(src / "vendor" / "nlohmann", dst / "vendor" / "nlohmann")
    return dst


def _run(tree: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tree), str(tmp_path / "out")], capture_output=True, text=True
    )


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
    # the template analysis comes from llamaprompt's cache, read in place (the shared_analysis rewrite)
    chat = (tmp_path / "out" / "generated" / "chat.cpp").read_text()
    assert chat.count("llamaprompt_analyze_template(") == 0
    assert chat.count("const struct autoparser::autoparser & autoparser = *llamaprompt_analysis;") == 1


@pytest.mark.parametrize(
    ("rel", "old", "new", "expected"),
    [
        # a renamed call site
        (
            "common/chat.cpp",
            "autoparser.analyze_template(tmpl)",
            "autoparser.analyze_template(tmpl, 1)",
            ["common/chat.cpp", "'autoparser.analyze_template(tmpl)' not found"],
        ),
        # llama-server fills server_chat_params from another source
        (
            "tools/server/server-context.cpp",
            "/* media_path            */ params_base.media_path",
            "/* media_path            */ params_base.media_dir",
            ["server-context.cpp", "media_path=params_base.media_dir"],
        ),
        # a new input of the parser generation that the parser-inputs key does not cover
        (
            "common/chat-auto-parser.h",
            "    json                                  extra_context;",
            "    json                                  extra_context;\n    bool new_upstream_flag = false;",
            ["generation_params fields changed (new: ['new_upstream_flag']"],
        ),
        # a vocab assert whose condition src/cpp/model.cpp checks first
        (
            "src/llama-vocab.cpp",
            'word = "[EMPTY_" + std::to_string(i) + "]";',
            'word = "<EMPTY_" + std::to_string(i) + ">";',
            ["src/llama-vocab.cpp", "[EMPTY_"],
        ),
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
    _insert_before(
        tree / "common" / "arg.cpp",
        "    add_opt(common_arg(\n",
        '    add_opt(common_arg(\n        {"--print-something"},\n        "print and exit",\n'
        "        [](common_params &) {\n            exit(0);\n        }\n    ));\n",
    )
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
    out = subprocess.run(
        [sys.executable, "-c", "from llamaprompt.cli import main; main(['--version'])"], capture_output=True, text=True
    )
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
    _insert_before(
        schema,
        "    add((new field_",
        '    add((new field_str("new_token_field"))\n        ->set_handler([&](field_eval_context & ctx, '
        "const json & data) {\n            GGML_ASSERT(ctx.vocab != nullptr);\n        }));\n",
    )
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
    assert (
        "not in this tree: common/chat.cpp: common_chat_template_direct_apply_impl"
        in (tmp_path / "out" / "lp_tree.cmake").read_text()
    )
    _edit(
        tree / "common" / "chat.cpp",
        "jinja::global_from_json(ctx, inp, inputs.mark_input);",
        "jinja::global_from_json(ctx, inp, true);",
    )
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1
    assert "common/chat.cpp" in proc.stderr and "jinja::global_from_json(ctx, inp, inputs.mark_input);" in proc.stderr


def test_common_log_route_is_probed(tree, tmp_path):
    """lp_common_log.h restates common/log.h's LOG_TMPL with its call replaced: a LOG_TMPL written
    otherwise (here: a prefix argument added to its call) leaves common's log silent, and says so."""
    assert _run(tree, tmp_path).returncode == 0 and _features(tmp_path)["common_log"]
    assert "set(LP_COMMON_LOG_ROUTED ON)" in (tmp_path / "out" / "lp_tree.cmake").read_text()
    _edit(
        tree / "common" / "log.h",
        "common_log_add(common_log_main(), (level), __VA_ARGS__);",
        "common_log_add(common_log_main(), (level), LOG_PREFIX, __VA_ARGS__);",
    )
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _features(tmp_path)["common_log"] is False
    cmake = (tmp_path / "out" / "lp_tree.cmake").read_text()
    assert "set(LP_COMMON_LOG_ROUTED OFF)" in cmake and "not in this tree: common/log.h: LOG_TMPL" in cmake


def _info(tmp_path: Path) -> dict:
    header = (tmp_path / "out" / "generated" / "lp_tree.h").read_text()
    line = next(x for x in header.splitlines() if x.startswith("#define LP_TREE_INFO_JSON "))
    return json.loads(json.loads(line.split(" ", 2)[2]))


@pytest.fixture
def handler_tree(tree) -> Path:
    """The tree copy, when its specialized handlers live in common/parsers (after 0.3.35)."""
    if not (tree / "common" / "parsers" / "qwen3-coder.cpp").is_file():
        pytest.skip("this tree has no common/parsers handler files (its handlers are in chat.cpp)")
    return tree


def test_a_tree_without_handler_files_has_no_stop_points(tree, tmp_path):
    shutil.rmtree(tree / "common" / "parsers", ignore_errors=True)
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _info(tmp_path)["prompt_only_handlers"] == {}
    assert "none takes the prompt-only path" in (tmp_path / "out" / "lp_tree.cmake").read_text()


def test_handler_probe_reads_each_handler(handler_tree, tmp_path):
    tree = handler_tree
    # facts from reading common/parsers/*.cpp: ling3 and minimax-m3 read the generation prompt
    # after it is computed (by its render alone: they stop right after it, keyed on it);
    # gemma4 appends "<|turn>model\n" to a prompt that ends with "<turn|>\n", in an if block
    # right after the generation prompt (a prompt fix-up: it stops after a copy of that block);
    # every other handler's code after its prompt reads only non-message inputs
    assert _run(tree, tmp_path).returncode == 0
    verdicts = _info(tmp_path)["prompt_only_handlers"]
    after = {n for n, v in verdicts.items() if v == "prompt-only after its generation prompt"}
    assert after == {"common_chat_params_init_ling3", "common_chat_params_init_minimax_m3"}
    assert all(v == "prompt-only" for n, v in verdicts.items() if n not in after), verdicts
    copy = (tmp_path / "out" / "generated" / "mirror" / "common" / "parsers" / "kimi-k3.cpp").read_text()
    # the stop point, on the generation prompt's own line (line numbers kept by #line 1)
    assert copy.splitlines()[1] == "#line 1"
    original = (tree / "common" / "parsers" / "kimi-k3.cpp").read_text().splitlines()
    stop = [i for i, x in enumerate(copy.splitlines()[2:]) if PROMPT_READY in x]
    assert len(stop) == 1 and "data.generation_prompt" in original[stop[0]]
    ling3 = (tmp_path / "out" / "generated" / "mirror" / "common" / "parsers" / "ling3.cpp").read_text()
    assert "llamaprompt_prompt_ready(" not in ling3
    # its stop point: right after the generation prompt's statement, on that line
    stop = [x for x in ling3.splitlines() if "llamaprompt_prompt_ready_after(" in x]
    assert stop == [LING3_GEN.rstrip("\n") + " " + LING3_STOP]
    # gemma4's copy: on the generation prompt's line, the fix-up block's copy (comments removed,
    # literals kept) then the stop, when armed; the rest of the file as it was
    gemma4 = (tmp_path / "out" / "generated" / "mirror" / "common" / "parsers" / "gemma4.cpp").read_text()
    original = (tree / "common" / "parsers" / "gemma4.cpp").read_text().splitlines()
    lines = gemma4.splitlines()[2:]
    assert len(lines) == len(original)
    changed = [i for i, (a, b) in enumerate(zip(original, lines)) if a != b and "llamaprompt_prompt_stop" in b]
    assert len(changed) == 1
    line = lines[changed[0]]
    assert line.endswith(original[changed[0]].lstrip())
    assert "data.generation_prompt = common_chat_template_generation" in line
    assert line.startswith(
        "    if (llamaprompt_prompt_stop_armed(__func__)) { if (inputs.add_generation_prompt && "
        'string_ends_with(data.prompt, "<turn|>\\n")) { data.generation_prompt = "<|turn>model\\n"; '
        "data.prompt += data.generation_prompt; } llamaprompt_prompt_stop(); return data; } "
    )
    assert "llamaprompt_prompt_ready(" not in gemma4


LING3 = "common/parsers/ling3.cpp"
LING3_GEN = "    data.generation_prompt = common_chat_template_generation_prompt_impl(tmpl, inputs);\n"
LING3_STOP = "if (llamaprompt_prompt_ready_after(data.generation_prompt, __func__)) { return data; }"
# the stop point before the generation prompt: the handler returns its params there when it says so
PROMPT_READY = "if (llamaprompt_prompt_ready(__func__)) { return data; } "
# edits of ling3 after its generation prompt as upstream might write them; whether the probe
# keeps its stop point after the generation prompt, and the reason given when not
LING3_EDITS = [
    (True, LING3_GEN, LING3_GEN + '    if (data.generation_prompt.empty()) { throw std::runtime_error("x"); }\n', None),
    (True, LING3_GEN, LING3_GEN + "    data.preserved_tokens = { data.generation_prompt };\n", None),
    (False, LING3_GEN, LING3_GEN.replace(");", ') + "\\n";'), "not computed by its render alone"),
    (
        False,
        LING3_GEN,
        LING3_GEN.replace("(tmpl, inputs)", "(tmpl, inputs, std::nullopt, std::nullopt, std::nullopt)"),
        "not computed by its render alone",
    ),
    (False, LING3_GEN, LING3_GEN + '    if (inputs.messages.empty()) { throw std::runtime_error("x"); }\n', "messages"),
    (False, LING3_GEN, LING3_GEN + "    data.grammar = data.prompt;\n", "reads or changes the prompt"),
    (False, LING3_GEN, LING3_GEN + "    auto when = inputs.now;\n", "not in the key"),
]


@pytest.mark.parametrize(("kept", "old", "new", "reason"), LING3_EDITS)
def test_handler_probe_after_the_generation_prompt(handler_tree, tmp_path, kept, old, new, reason):
    tree = handler_tree
    _edit(tree / LING3, old, new)
    assert _run(tree, tmp_path).returncode == 0
    verdict = _info(tmp_path)["prompt_only_handlers"]["common_chat_params_init_ling3"]
    assert (verdict == "prompt-only after its generation prompt") == kept, verdict
    copy = tmp_path / "out" / "generated" / "mirror" / LING3
    assert (copy.exists() and LING3_STOP in copy.read_text()) == kept
    if reason:
        assert reason in verdict
        # a problem of the code after the generation prompt belongs to both stop points: said once
        problems = verdict.replace("after its generation prompt: ", "; ").split("; ")
        assert len(problems) == len(set(problems)), verdict


# edits of gemma4's prompt fix-up block (after its generation prompt) as upstream might write
# it; whether the probe must keep the prompt-only path
GEMMA4 = "common/parsers/gemma4.cpp"
GEMMA4_GEN = "    data.generation_prompt = common_chat_template_generation_prompt_impl(tmpl, inputs);\n"
GEMMA4_COND = '    if (inputs.add_generation_prompt && string_ends_with(data.prompt, "<turn|>\\n")) {\n'
GEMMA4_BODY = '        data.generation_prompt = "<|turn>model\\n";\n        data.prompt += data.generation_prompt;\n'
FIXUP_EDITS = [
    # (kept prompt-only?, old, new, the reason given when not)
    (True, GEMMA4_BODY, GEMMA4_BODY + '        data.prompt += "\\n" "x";\n', None),
    (True, GEMMA4_COND, GEMMA4_COND.replace("&&", "&& inputs.enable_thinking &&"), None),
    (False, GEMMA4_COND, GEMMA4_COND.replace("data.prompt", "data.generation_prompt"), "condition reads more"),
    (False, GEMMA4_COND, GEMMA4_COND.replace("string_ends_with", "ends_with_turn"), "condition reads more"),
    (False, GEMMA4_COND, GEMMA4_COND.replace("inputs.add_generation_prompt", "inputs.messages.empty()"),
     "condition reads more"),
    (False, GEMMA4_COND, GEMMA4_COND.replace("&&", "&& (n = 1) &&"), "condition reads more"),
    (False, GEMMA4_BODY, '        data.prompt += data.generation_prompt;\n' + GEMMA4_BODY, "does more than append"),
    (False, GEMMA4_BODY, GEMMA4_BODY + "        data.prompt += inputs.messages.dump();\n", "does more than append"),
    (False, GEMMA4_BODY, GEMMA4_BODY + '        data.generation_prompt = u8"x";\n', "does more than append"),
    (False, GEMMA4_BODY, GEMMA4_BODY + "        log_prompt(data.prompt);\n", "does more than append"),
    (False, GEMMA4_BODY + "    }\n", GEMMA4_BODY + '    } else {\n        data.prompt += "x";\n    }\n', "else branch"),
    (False, GEMMA4_GEN, GEMMA4_GEN.replace("(tmpl, inputs)", "(tmpl, inputs, data.prompt)"), "render alone"),
    (False, GEMMA4_GEN, GEMMA4_GEN + '    data.prompt += "x";\n', "reads or changes the prompt"),
    (False, GEMMA4_COND, GEMMA4_COND.replace("(data.prompt", "(&data.prompt"), "condition reads more"),
    (False, "common_chat_params common_chat_params_init_gemma4(",
     "bool string_ends_with(const std::string * s, const char * x);\n"
     "common_chat_params common_chat_params_init_gemma4(", "names string_ends_with"),
    # text the rules cannot read as the compiler does: a comment's line continuation hides the append
    # from the compiler, not from the copy; #if 0 hides code and braces; goto jumps past the rules
    (False, GEMMA4_BODY, GEMMA4_BODY + '        // a note \\\n        data.prompt += "X";\n', "line continuation"),
    (False, GEMMA4_BODY + "    }\n", GEMMA4_BODY + "    }\n#if 0\n    {\n#endif\n", "preprocessor lines"),
    (False, GEMMA4_BODY, GEMMA4_BODY + "        goto done;\n", "goto"),
    # before the stop: an alias of the prompt made by an initializer or a call
    (False, GEMMA4_GEN, "    std::string & alias{data.prompt};\n" + GEMMA4_GEN, "a call or an initializer"),
    (False, GEMMA4_GEN, "    auto * alias = std::addressof(data.prompt);\n" + GEMMA4_GEN, "a call or an initializer"),
    # after the block: the rules of every stop point
    (False, "    data.message_delimiters = {\n", '    data.prompt += "x";\n    data.message_delimiters = {\n',
     "reads or changes the prompt"),
    (False, "    data.message_delimiters = {\n",
     "    auto n = inputs.messages.size();\n    data.message_delimiters = {\n", "reads the messages"),
]


@pytest.mark.parametrize(("kept", "old", "new", "reason"), FIXUP_EDITS)
def test_handler_probe_on_edited_prompt_fixups(handler_tree, tmp_path, kept, old, new, reason):
    path = handler_tree / GEMMA4
    if old not in path.read_text():
        pytest.skip("this tree's gemma4 handler is written another way")
    _edit(path, old, new)
    assert _run(handler_tree, tmp_path).returncode == 0
    verdict = _info(tmp_path)["prompt_only_handlers"]["common_chat_params_init_gemma4"]
    assert (verdict == "prompt-only") == kept, verdict
    if reason:
        assert reason in verdict, verdict
    copy = tmp_path / "out" / "generated" / "mirror" / GEMMA4  # no copy: a file with no edit at all
    assert (copy.exists() and "llamaprompt_prompt_stop()" in copy.read_text()) == kept


# edits of a handler (Qwen3-Coder's) as upstream might write it: before its prompt, after its
# generation-prompt line, at file scope; whether the probe must keep the prompt-only path
QWEN3_CODER = "common/parsers/qwen3-coder.cpp"
BEFORE_PROMPT = "    data.prompt            = common_chat_template_direct_apply_impl(tmpl, inputs);\n"
AFTER_STOP = "    if (inputs.has_continuation()) {\n"
HANDLER_EDITS = [
    # (kept prompt-only?, file scope, before the prompt, after the stop point)
    (False, "", "", '    if (inputs.messages.empty()) { throw std::runtime_error("x"); }\n'),
    (False, "", "", '    if (data.prompt.empty()) { data.grammar = "x"; }\n'),
    (False, "", "", '    try { data.grammar = "x"; } catch (...) { }\n'),
    (False, "", "", "    auto n = helper( inputs );\n"),
    (False, "", "", "    auto k = inputs.continue_msg.content.size();\n"),
    (False, "", "", "    finalize(data);\n"),
    (False, "", "    const auto & in = inputs;\n", "    auto n = helper(in);\n"),
    (False, "", "    auto & p = data.prompt;\n", '    p += "!";\n'),
    (False, "", "    auto * d = &data;\n", '    d->prompt += "!";\n'),
    (False, "", '    auto finish = [&]() { data.prompt += "!"; };\n', "    finish();\n"),
    (
        False,
        "",
        "    auto n_msgs = inputs.messages.size();\n    auto many = n_msgs > 3;\n",
        '    if (many) { throw std::runtime_error("x"); }\n',
    ),
    (
        False,
        "",
        "    size_t n = 0;\n    count_into(inputs.messages, n);\n",
        '    if (n > 3) { throw std::runtime_error("x"); }\n',
    ),
    (
        False,
        "",
        "    size_t n = 1;\n    n *= inputs.messages.size();\n",
        '    if (n > 3) { throw std::runtime_error("x"); }\n',
    ),
    (
        False,
        "",
        "    json v = json::array();\n    for (const auto & m : inputs.messages) v.push_back(m);\n",
        '    if (v.size() > 3) { throw std::runtime_error("x"); }\n',
    ),
    (
        False,
        "",
        "    bool many = false;\n    if (inputs.messages.size() > 3) { many = true; }\n",
        '    if (many) { throw std::runtime_error("x"); }\n',
    ),
    (
        False,
        "#define LAST_MSG inputs.messages.back()\n",
        "",
        '    if (LAST_MSG.is_null()) { throw std::runtime_error("x"); }\n',
    ),
    (
        False,
        "",
        "    const size_t lim = 1'000'000;\n",
        "    if (inputs.messages.size() > lim) { throw std::runtime_error(\"x\"); }\n    char c = 'x';\n",
    ),
    (True, "", "", "    // messages are not read here; data.prompt neither; try { } catch\n"),
    (True, "", "", '    data.grammar = R"x(messages " data.prompt)x";\n'),
    (True, "", "    if (inputs.tools.size() > 100) {\n        data.grammar_lazy = true;\n    }\n", ""),
    (True, "", "", '    data.grammar = "a\\"messages\\"b";\n'),
    (True, "", "", '    if (inputs.tools.size() > 100) { throw std::runtime_error("x"); }\n'),
    (
        True,
        "",
        "    auto n_tools = inputs.tools.size();\n",
        '    if (n_tools > 100) { throw std::runtime_error("x"); }\n',
    ),
]


@pytest.mark.parametrize(("kept", "file_scope", "before", "after"), HANDLER_EDITS)
def test_handler_probe_on_edited_handlers(handler_tree, tmp_path, kept, file_scope, before, after):
    tree = handler_tree
    path = tree / QWEN3_CODER
    if file_scope:
        path.write_text(path.read_text().replace('#include "parsers.h"\n', '#include "parsers.h"\n' + file_scope, 1))
    if before:
        _insert_before(path, BEFORE_PROMPT, before)
    if after:
        _insert_before(path, AFTER_STOP, after)
    assert _run(tree, tmp_path).returncode == 0
    verdict = _info(tmp_path)["prompt_only_handlers"]["common_chat_params_init_qwen3_coder"]
    assert (verdict == "prompt-only") == kept, verdict
    copy = tmp_path / "out" / "generated" / "mirror" / QWEN3_CODER
    assert (copy.exists() and "llamaprompt_prompt_ready(" in copy.read_text()) == kept


def test_handler_that_returns_a_changed_copy_runs_in_full(handler_tree, tmp_path):
    tree = handler_tree
    _edit(
        tree / QWEN3_CODER,
        "    return data;\n}",
        '    common_chat_params res = data;\n    res.prompt += "!";\n    return res;\n}',
    )
    assert _run(tree, tmp_path).returncode == 0
    verdict = _info(tmp_path)["prompt_only_handlers"]["common_chat_params_init_qwen3_coder"]
    assert "passes its result on or copies it" in verdict


def test_tojson_rewrite_is_left_out_whole_when_one_of_its_patterns_is_missing(tree, tmp_path):
    # tojson's five edits (the helpers, the string loop, the key, indentation, line breaks) apply
    # together: a tree whose string loop differs keeps upstream's value_to_json_internal as it is
    _edit(tree / "common" / "jinja" / "value.cpp", "                        oss << c;\n",
          "                        oss.put(c);\n")
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = _info(tmp_path)
    tojson = [r for r in info["rewrites"] if r.get("engine", "").startswith("tojson")]
    assert len(tojson) == 5 and not any(r["applied"] for r in tojson)
    assert any("tojson" in n and "engine rewrite not applied" in n for n in info["notes"])
    copy = (tmp_path / "out" / "generated" / "jinja-value.cpp").read_text()
    assert "llamaprompt_json_escaped" not in copy and "oss.put(c);" in copy
    # a string value whose as_string() is not its own text: the helper joins the parts first
    _edit(tree / "common" / "jinja" / "value.cpp", "                        oss.put(c);\n",
          "                        oss << c;\n")
    _edit(tree / "common" / "jinja" / "value.h", "virtual string as_string() const override { return val_str; }",
          "virtual string as_string() const override { string s = val_str; return s; }")
    assert _run(tree, tmp_path).returncode == 0
    info = _info(tmp_path)
    assert all(r["applied"] for r in info["rewrites"] if r.get("engine", "").startswith("tojson"))
    copy = (tmp_path / "out" / "generated" / "jinja-value.cpp").read_text()
    assert "llamaprompt_json_escaped" in copy and "val->val_str.parts" not in copy
    assert any("tojson joins a string value's parts" in n for n in info["notes"])


def _rewrite_records(tree: Path, tmp_path: Path, engine: str) -> tuple[dict, list[dict]]:
    """Adapt ``tree`` (which must succeed): tree_info, and the records of the engine rewrites
    whose description begins with ``engine``."""
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = _info(tmp_path)
    return info, [r for r in info["rewrites"] if r.get("engine", "").startswith(engine)]


def test_loop_reuse_rewrite_needs_the_loop_object_rewrite(tree, tmp_path):
    # the loop object's refill replaces the loop_object rewrite's text: a tree where that rewrite
    # does not apply builds without both, the engine upstream's there
    _edit(tree / "common" / "jinja" / "runtime.cpp", 'loop_obj->insert("length", ', 'loop_obj->insert(("length"), ')
    info, loop = _rewrite_records(tree, tmp_path, "for loop: the loop object")
    assert len(loop) == 3 and not any(r["applied"] for r in loop)
    copy = (tmp_path / "out" / "generated" / "jinja-runtime.cpp").read_text()
    assert "llamaprompt_refill" not in copy and 'scope.set_val("loop", loop_obj);' in copy
    assert any("loop object refilled" in n for n in info["notes"])


def test_scope_chain_rewrite_is_left_out_whole_when_one_of_its_patterns_is_missing(tree, tmp_path):
    # the scope chain's six edits apply together, some to the text of other rewrites (the copy
    # constructor's, get_val's): a tree whose print_vars differs keeps the copied scopes, and the
    # loop object's refill then compiles without its check of the chain (#ifdef)
    runtime_h = tree / "common" / "jinja" / "runtime.h"
    _edit(runtime_h, "value_to_json(env, 2)", "value_to_json(env, 4)")
    info, chain = _rewrite_records(tree, tmp_path, "new scope (each for loop, macro call, call block): reads")
    assert len(chain) == 6 and not any(r["applied"] for r in chain)
    assert any("another edit of its group is not found" in r.get("skipped", "") for r in chain)
    mirrored = (tmp_path / "out" / "generated" / "mirror" / "common" / "jinja" / "runtime.h").read_text()
    assert "llamaprompt_scope_object" not in mirrored and "env(mk_val<value_object>(*parent.env))" in mirrored
    copy = (tmp_path / "out" / "generated" / "jinja-runtime.cpp").read_text()
    assert "#ifdef LLAMAPROMPT_SCOPE_CHAIN" in copy and "llamaprompt_refill" in copy
    # with the copy constructor's own rewrite missing, the chain (which rewrites its text) goes too
    _edit(runtime_h, "value_to_json(env, 4)", "value_to_json(env, 2)")
    _edit(runtime_h, "        current_time = parent.current_time;\n",
          "        this->current_time = parent.current_time;\n")
    info, chain = _rewrite_records(tree, tmp_path, "new scope (each")
    assert len(chain) == 7 and not any(r["applied"] for r in chain)  # the copy constructor's and the chain's
    assert "llamaprompt_scope_object" not in (tmp_path / "out" / "generated" / "mirror" / "common" / "jinja" /
                                               "runtime.h").read_text()


def test_date_rewrite_is_left_out_where_format_time_differs(tree, tmp_path):
    _edit(tree / "common" / "chat.cpp", "    auto res = ss.str();\n    return res;\n", "    return ss.str();\n")
    _, [date] = _rewrite_records(tree, tmp_path, "the request's date")
    assert not date["applied"]
    assert "llamaprompt_put_time" not in (tmp_path / "out" / "generated" / "chat.cpp").read_text()


def test_caps_lookup_rewrite_is_left_out_where_caps_is_used_otherwise(tree, tmp_path):
    # oaicompat_chat_params_parse reading another of the caps: the lookup would serve it from the
    # map anyway, but the probe asks that `caps` be named only where it was read: both files keep
    # upstream's code
    server = tree / "tools" / "server" / "server-common.cpp"
    _edit(server, '    inputs.grammar                = grammar;\n',
          '    inputs.grammar                = caps["supports_tools"] ? grammar : grammar;\n')
    info, caps = _rewrite_records(tree, tmp_path, "the request's parallel_tool_calls")
    assert not caps
    assert any("uses `caps` for more than the parallel_tool_calls default" in n for n in info["notes"])
    generated = tmp_path / "out" / "generated"
    assert "llamaprompt_templates_caps" not in (generated / "chat.cpp").read_text()
    server_copy = (generated / "server-common.cpp").read_text()
    assert "auto caps = common_chat_templates_get_caps(opt.tmpls.get());" in server_copy


def test_normalize_move_rewrite_is_left_out_where_normalize_reads_its_input_again(tree, tmp_path):
    # a normalize that read `messages` after its loop could see what the moving overload moved out
    _edit(tree / "common" / "chat.cpp", "        return normalized;\n    }\n",
          "        return messages.empty() ? messages : normalized;\n    }\n")
    info, normalize = _rewrite_records(tree, tmp_path, "the request's messages normalized")
    assert not normalize
    assert any("messages_inp_normalizer::normalize" in n for n in info["notes"])
    assert "normalize(json && messages)" not in (tmp_path / "out" / "generated" / "chat.cpp").read_text()


@pytest.mark.parametrize(
    ("use", "problem"),
    [
        ('        autoparser.user_start = "x";\n', "the analysis is used other than by reading its members"),
        ("        autoparser.collect_preserved_tokens();\n", "it calls autoparser.collect_preserved_tokens()"),
        ("        keep(autoparser);\n", "the analysis is used other than by reading its members"),
    ],
    ids=["assigned", "non-const-call", "passed-on"],
)
def test_shared_analysis_rewrite_is_left_out_where_the_analysis_is_changed(tree, tmp_path, use, problem):
    # the cached analysis is shared between requests: read in place only where the rest of the
    # function only reads it; else each request copies it, as before
    analyzed = "        autoparser.analyze_template(tmpl);\n"
    _edit(tree / "common" / "chat.cpp", analyzed, analyzed + use)
    info, shared = _rewrite_records(tree, tmp_path, "the template analysis")
    assert not shared
    assert any(problem in n and "common_chat_templates_apply_jinja" in n for n in info["notes"]), info["notes"]
    chat = (tmp_path / "out" / "generated" / "chat.cpp").read_text()
    assert "llamaprompt_shared_analysis" not in chat
    assert chat.count("llamaprompt_analyze_template(autoparser, tmpl);") == 1


def test_a_changed_trie_walk_in_the_schema_converter_fails_with_file_and_text(tree, tmp_path):
    # the stack guard of _not_strings' recursion is placed at its lambda's head, which differs
    # between trees; a tree with neither known head must not build without the guard
    schema = tree / "common" / "json-schema-to-grammar.cpp"
    text = schema.read_text()
    head = next(h for h in ("[&](size_t idx) {\n", "[&](const TrieNode & node) {\n") if h in text)
    schema.write_text(text.replace(head, head.replace("{", "{ ", 1)))
    proc = _run(tree, tmp_path)
    assert proc.returncode != 0
    assert "common/json-schema-to-grammar.cpp" in proc.stderr and "_not_strings's trie walk" in proc.stderr


def test_engine_rewrites_are_optional_and_can_be_left_out(tree, tmp_path):
    # a tree whose engine lacks a rewrite's pattern builds without it, with a message
    _edit(
        tree / "common" / "jinja" / "runtime.cpp",
        "    auto builtins = global_builtins();\n",
        "    auto builtins(global_builtins());\n",
    )
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = _info(tmp_path)
    engine = [
        r for r in info["rewrites"]
        if r.get("engine") and not r["engine"].startswith(("generation prompt", "the template source's marker"))
    ]
    assert len(engine) == 66
    skipped = [r for r in engine if not r["applied"]]
    # (and, on a tree whose schema converter never copied its rules -- 0.3.35's -- that group)
    schema = tree / "common" / "json-schema-to-grammar.cpp"
    never_copied = "auto rules_snapshot = _rules;" not in schema.read_text()
    expected = ["    auto builtins = global_builtins();\n"] + [
        r["pattern"] for r in engine if never_copied and r["engine"].startswith("JSON schema patterns: a revert")
    ]
    assert [r["pattern"] for r in skipped] == expected
    assert any("engine rewrite not applied" in n for n in info["notes"])
    # the mirrored headers: byte for byte but for the rewritten function bodies
    mirrored = tmp_path / "out" / "generated" / "mirror" / "common"
    assert (mirrored / "chat.h").read_bytes() == (tree / "common" / "chat.h").read_bytes()
    assert "scope->parent = parent.env;" in (mirrored / "jinja" / "runtime.h").read_text()
    # --no-engine-rewrites: upstream's engine as it is
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tree), str(tmp_path / "out"), "--no-engine-rewrites"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert not [r for r in _info(tmp_path)["rewrites"] if r.get("engine") and r["applied"]]
    # value.h keeps its robustness rewrites (not speed rewrites): the destruction worklist (a
    # helper added around value_t, value_t's destructor given a body) and the guards of deep
    # comparisons and hashes (HASH_DEPTH: lines added) -- nothing else
    off_value = (mirrored / "jinja" / "value.h").read_text().splitlines()
    upstream_value = (tree / "common" / "jinja" / "value.h").read_text().splitlines()
    ops = [op for op in difflib.SequenceMatcher(None, upstream_value, off_value, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    assert [op[0] for op in ops if op[0] != "insert"] == ["replace"], ops
    replaced = next(op for op in ops if op[0] == "replace")
    assert upstream_value[replaced[1]:replaced[2]] == ["    virtual ~value_t() = default;"]
    assert off_value[replaced[3]:replaced[4]] == [
        "    virtual ~value_t() { if (!val_arr.empty() || !val_obj.empty()) "
        "llamaprompt_release_children(val_arr, val_obj); }"
    ]
    added = [line for op in ops if op[0] == "insert" for line in off_value[op[3]:op[4]]]
    # the guard in a list's is_hashable and ==, the bounded depth in a list's and an object's hash
    assert sum(line.strip().startswith("::llamaprompt::jinja_guard_step();") for line in added) == 2
    assert sum(line.strip().startswith("llamaprompt_hash_level level;") for line in added) == 2
    # runtime.h keeps its stack guard and its syntax trees' worklist deleter (not speed
    # rewrites): only lines added -- the guard's two, and the deleter's specialization (between
    # the forward declaration of `statement` and its alias, namespace jinja closed and reopened
    # around it) and its worklist after `struct statement`
    guarded = (mirrored / "jinja" / "runtime.h").read_text().splitlines()
    upstream = (tree / "common" / "jinja" / "runtime.h").read_text().splitlines()
    ops = [op for op in difflib.SequenceMatcher(None, upstream, guarded, autojunk=False).get_opcodes()
           if op[0] != "equal"]
    assert {op[0] for op in ops} == {"insert"}, ops
    added = [guarded[op[3]:op[4]] for op in ops]
    assert sum("llamaprompt" in line for block in added for line in block) >= 4
    assert sum(len(block) for block in added if any("jinja_guard_step" in x or "llamaprompt_guard" in x
                                                      for x in block)) >= 2
    deleter = next(b for b in added if any("struct default_delete<jinja::statement>" in x for x in b))
    assert "}  // namespace jinja" in deleter and "namespace jinja {" in deleter
    assert any("inline void llamaprompt_release_statement(statement * p) noexcept {" in x for b in added for x in b)
    for rel in ("json.hpp", "json_fwd.hpp"):
        vendored = tree / "vendor" / "nlohmann" / rel
        assert (mirrored.parent / "vendor" / "nlohmann" / rel).read_bytes() == vendored.read_bytes()
    assert (
        "auto builtins = input->get_builtins();" in (tmp_path / "out" / "generated" / "jinja-runtime.cpp").read_text()
    )


NLOHMANN = ("vendor", "nlohmann", "json.hpp")
GROW = "llamaprompt_grow_by_moving(static_cast<Container &>(*this), t);"
OBJECT_GROWTH = "JSON object insert"  # the engine labels' beginnings (adapt_tree.py)
JSON_DESTRUCTION = "JSON destruction"


def _json_rows(tmp_path: Path, label: str) -> list[dict]:
    return [
        r
        for r in _info(tmp_path)["rewrites"]
        if r["file"] == "/".join(NLOHMANN) and r.get("engine", "").startswith(label)
    ]


def _json_group_left_out(tree: Path, tmp_path: Path, old: str, new: str, label: str, edits: int) -> str:
    """Change ``old`` to ``new`` in the tree's json.hpp and run the probe: the group ``label``
    (``edits`` edits) is applied nowhere, with the configure note; the mirrored header's text."""
    _edit(tree.joinpath(*NLOHMANN), old, new)
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = _json_rows(tmp_path, label)
    assert len(rows) == edits and not any(r["applied"] for r in rows)
    assert any("vendor/nlohmann/json.hpp: engine rewrite not applied" in n for n in _info(tmp_path)["notes"])
    return (tmp_path / "out" / "generated" / "mirror" / Path(*NLOHMANN)).read_text()


def test_json_object_growth_rewrite(tree, tmp_path):
    # nlohmann's ordered_map grows its vector of pair<const Key, T> (no noexcept move: copied) by
    # emplace_back in its two emplace overloads; both call sites get the move-growth first
    assert _run(tree, tmp_path).returncode == 0
    rows = _json_rows(tmp_path, OBJECT_GROWTH)
    assert len(rows) == 3 and all(r["applied"] for r in rows), rows
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*NLOHMANN)).read_text()
    original = tree.joinpath(*NLOHMANN).read_text()
    assert text.count(GROW) == 2
    assert text.index("inline void llamaprompt_grow_by_moving(") < text.index("struct ordered_map : std::vector")
    # nothing else changed: lines were only added, before ordered_map and before its two emplace_back
    # (and by the JSON destruction rewrite: its function before destroy, its one changed line)
    ops = difflib.SequenceMatcher(None, original.splitlines(), text.splitlines(), autojunk=False).get_opcodes()
    assert {op[0] for op in ops} == {"equal", "insert", "replace"}
    assert len([op for op in ops if op[0] == "insert"]) == 3 + 1
    replaced = [(original.splitlines()[a:b], text.splitlines()[c:d]) for op, a, b, c, d in ops if op == "replace"]
    assert replaced == [([DESTROY_IF], [DESTROY_IF_NEW])]


def test_json_object_growth_rewrite_is_all_or_nothing(tree, tmp_path):
    # one of the two emplace call sites changed upstream: neither is rewritten (a group), the
    # header is mirrored as it is, with a message
    text = _json_group_left_out(
        tree,
        tmp_path,
        "        Container::emplace_back(key, std::forward<T>(t));\n",
        "        this->emplace_back(key, std::forward<T>(t));\n",
        OBJECT_GROWTH,
        3,
    )
    mirrored = tmp_path / "out" / "generated" / "mirror" / Path(*NLOHMANN)
    assert GROW not in text and "llamaprompt_grow_by_moving" not in text
    # the other group (JSON destruction) applies on its own
    assert all(r["applied"] for r in _json_rows(tmp_path, JSON_DESTRUCTION))
    # a tree without the vendored header: nothing to rewrite or mirror, the build goes on
    shutil.rmtree(tree / "vendor")
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = _json_rows(tmp_path, OBJECT_GROWTH)
    assert rows and all(r["skipped"] == "the file is not in this tree" for r in rows)
    assert not mirrored.exists()


DESTROY_IF = "            if (t == value_t::array || t == value_t::object)"
DESTROY_IF_NEW = (
    "            if ((t == value_t::array || t == value_t::object) && !llamaprompt_release_elements(t, 64))"
)


def test_json_destruction_rewrite(tree, tmp_path):
    # facts from reading json.hpp: json_value::destroy moves the elements of an array or object
    # into a std::vector stack before freeing it; the stack is now reached only when the
    # elements could not all be destroyed in place (a tree deeper than 64 levels)
    assert _run(tree, tmp_path).returncode == 0
    rows = _json_rows(tmp_path, JSON_DESTRUCTION)
    assert len(rows) == 2 and all(r["applied"] for r in rows), rows
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*NLOHMANN)).read_text()
    assert text.count(DESTROY_IF_NEW) == 1 and DESTROY_IF + "\n" not in text
    helper = text.index("bool llamaprompt_release_elements(value_t t, int levels) noexcept")
    destroy = text.index("        void destroy(value_t t)\n")
    assert helper < destroy < text.index(DESTROY_IF_NEW)
    # the stack code itself is upstream's, unchanged, right after the changed condition
    original = tree.joinpath(*NLOHMANN).read_text()
    after = original.index(DESTROY_IF)
    stack = original[after + len(DESTROY_IF) : original.index("            switch (t)", after)]
    assert text[text.index(DESTROY_IF_NEW) + len(DESTROY_IF_NEW) :].startswith(stack)


def test_json_destruction_rewrite_is_all_or_nothing(tree, tmp_path):
    # upstream's destroy written another way (here: its stack comment changed): no helper left
    # unused, the header keeps its destroy as it is, with a message
    text = _json_group_left_out(
        tree,
        tmp_path,
        "                // flatten the current json_value to a heap-allocated stack\n",
        "                // flatten the current value to a heap-allocated stack\n",
        JSON_DESTRUCTION,
        2,
    )
    assert "llamaprompt_release_elements" not in text


VALUE_H = ("common", "jinja", "value.h")


def _specialized(tmp_path: Path, header: tuple[str, ...], trait: str) -> set[str]:
    """The types a mirrored header specializes ``trait`` for (the probed leaf types)."""
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*header)).read_text()
    return set(re.findall(rf"template <> struct {trait}<(\w+)>", text))


def _leaves(tmp_path: Path) -> set[str]:
    return _specialized(tmp_path, VALUE_H, "llamaprompt_leaf_value")


def test_type_tests_of_leaf_value_types(tree, tmp_path):
    # facts from reading value.h: value_tuple_t derives from value_array_t, the other value types
    # from value_t only, and nothing else in the tree derives from them
    assert _run(tree, tmp_path).returncode == 0
    leaves = _leaves(tmp_path)
    assert {"value_string_t", "value_object_t", "value_int_t", "value_undefined_t", "value_tuple_t"} <= leaves
    assert "value_array_t" not in leaves
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)).read_text()
    assert "dynamic_cast<const PointeeType*>" not in text and text.count("llamaprompt_cast_val<PointeeType>") == 4
    # value_array_t's family is closed: itself and value_tuple_t, a leaf defined next to it
    assert _families(tmp_path) == {"value_array_t": "value_tuple_t"}
    assert "dynamic_cast kept" not in " ".join(_info(tmp_path)["notes"])


def _families(tmp_path: Path) -> dict[str, str]:
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)).read_text()
    family = r"struct llamaprompt_value_family<(\w+)> \{ using derived = llamaprompt_value_types<([^>]*)>"
    found = re.findall(family, text)
    return dict(found)


def test_a_value_type_derived_from_outside_value_h_keeps_dynamic_cast(tree, tmp_path):
    # a server file deriving from value_array_t: its family is no longer known
    derived = "struct lp_list : jinja::value_array_t {};\n#include"
    _edit(tree / "tools" / "server" / "server-common.cpp", "#include", derived)
    assert _run(tree, tmp_path).returncode == 0
    assert _families(tmp_path) == {} and "value_tuple_t" in _leaves(tmp_path)
    assert "value_array_t (a base in common/jinja/value.h)" in " ".join(_info(tmp_path)["notes"])


def test_a_family_with_a_derived_non_leaf_is_not_closed(tree, tmp_path):
    # a type deriving from value_tuple_t (in value.h): value_array_t's family is no longer closed
    _edit(tree.joinpath(*VALUE_H), "struct value_tuple_t : public value_array_t {",
          "struct value_pair_t;\nstruct value_tuple_t : public value_array_t {")
    _edit(tree.joinpath(*VALUE_H), "\n} // namespace jinja",
          "\nstruct value_pair_t : public value_tuple_t {};\n} // namespace jinja")
    assert "struct value_pair_t : public value_tuple_t" in tree.joinpath(*VALUE_H).read_text()
    assert _run(tree, tmp_path).returncode == 0
    # value_tuple_t's family (itself and the new leaf) is closed, value_array_t's is not
    assert _families(tmp_path) == {"value_tuple_t": "value_pair_t"} and "value_tuple_t" not in _leaves(tmp_path)
    assert "value_array_t (a base in common/jinja/value.h)" in " ".join(_info(tmp_path)["notes"])


def test_a_derived_value_type_keeps_dynamic_cast(tree, tmp_path):
    # a server file deriving from value_string_t: that type is no leaf, the others still are
    derived = "struct lp_str : jinja::value_string_t {};\n#include"
    _edit(tree / "tools" / "server" / "server-common.cpp", "#include", derived)
    assert _run(tree, tmp_path).returncode == 0
    leaves = _leaves(tmp_path)
    assert "value_string_t" not in leaves and "value_object_t" in leaves
    assert "value_string_t (a base in tools/server/server-common.cpp)" in " ".join(_info(tmp_path)["notes"])


def test_a_class_template_deriving_from_its_parameter_keeps_every_dynamic_cast(tree, tmp_path):
    # `template <class B> struct mixin : public B` could derive from any value type
    mixin = "#pragma once\ntemplate <class B> struct lp_mixin : public B {};\n"
    _edit(tree / "common" / "chat.h", "#pragma once\n", mixin)
    assert _run(tree, tmp_path).returncode == 0
    mirrored = tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)
    assert mirrored.read_bytes() != tree.joinpath(*VALUE_H).read_bytes()  # its other rewrites
    assert not _leaves(tmp_path) and "dynamic_cast<const PointeeType*>(ptr.get()) != nullptr" in mirrored.read_text()
    assert "(a base in common/chat.h)" in " ".join(_info(tmp_path)["notes"])


BOOL_INT_CALL = "val = llamaprompt_bool_int(v);"


def test_boolean_integer_rewrite(tree, tmp_path):
    # facts from reading value.h: value_bool_t builds `val = mk_val<value_int>(val_int)` and reads
    # `val` only in unique_hash; the tree names value_bool only to build, test and declare one
    assert _run(tree, tmp_path).returncode == 0
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)).read_text()
    assert text.count(BOOL_INT_CALL) == 1 and "val = mk_val<value_int>(val_int);" not in text.split(
        "struct value_bool_t")[1].split("};")[0]
    assert text.index("inline value llamaprompt_bool_int(") < text.index("struct value_bool_t : public value_t")
    rows = [r for r in _info(tmp_path)["rewrites"] if r.get("engine", "").startswith("Boolean values")]
    assert len(rows) == 2 and all(r["applied"] for r in rows)


@pytest.mark.parametrize(
    "code, why",
    [
        (
            "static int lp_b(const jinja::value & v) "
            "{ return (int) jinja::cast_val<jinja::value_bool>(v)->val->val_int; }",
            "names value_bool",
        ),
        (
            "static void lp_b() { using namespace jinja; mk_val<value_bool>(true)->val->stats.used = true; }",
            "dereferences a new Boolean",
        ),
    ],
)
def test_a_boolean_integer_reached_from_outside_keeps_its_own(tree, tmp_path, code, why):
    # code that could reach a Boolean's integer: every Boolean keeps one of its own
    _insert_before(tree / "tools" / "server" / "server-common.cpp", "#include", code + "\n")
    assert _run(tree, tmp_path).returncode == 0
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)).read_text()
    assert BOOL_INT_CALL not in text and "llamaprompt_bool_int" not in text
    notes = " ".join(_info(tmp_path)["notes"])
    assert "each Boolean keeps an integer value of its own" in notes and "tools/server/server-common.cpp" in notes
    assert why in notes


def test_a_boolean_reading_its_integer_elsewhere_keeps_its_own(tree, tmp_path):
    # value_bool_t itself reading `val` outside its hash (here: its string form)
    _edit(
        tree.joinpath(*VALUE_H),
        'virtual string as_string() const override { return std::string(val_int ? "True" : "False"); }',
        'virtual string as_string() const override { return val->as_string(); }',
    )
    assert _run(tree, tmp_path).returncode == 0
    assert "llamaprompt_bool_int" not in (tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)).read_text()
    assert "uses its member `val` other than in its hash" in " ".join(_info(tmp_path)["notes"])


MAKE_SHARED = "    return std::make_shared<PointeeType>(std::forward<Args>(args)...);\n"


def test_value_pool_rewrite(tree, tmp_path):
    # fact from reading value.h: mk_val is `return std::make_shared<PointeeType>(...)`, the one
    # place values are allocated; it now allocates through the per-thread free lists, nothing else changes
    assert _run(tree, tmp_path).returncode == 0
    mirrored = (tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)).read_text()
    assert MAKE_SHARED not in mirrored
    assert "std::allocate_shared<PointeeType>(llamaprompt_value_pool::allocator<PointeeType>()," in mirrored
    assert mirrored.index("namespace llamaprompt_value_pool {") < mirrored.index("mk_val(Args&&... args)")
    # its lists found through the thread pointer (src/cpp/thread_slots.h), included at file scope
    assert mirrored.index('#include "thread_slots.h"') < mirrored.index("namespace jinja")
    rows = [r for r in _info(tmp_path)["rewrites"] if r.get("engine", "").startswith("values: allocated")]
    assert len(rows) == 3 and all(r["applied"] for r in rows)


def test_value_pool_rewrite_is_all_or_nothing(tree, tmp_path):
    # mk_val written another way: no pool (its block would be unused), a message
    by_new = "    return std::shared_ptr<PointeeType>(new PointeeType(std::forward<Args>(args)...));\n"
    _edit(tree.joinpath(*VALUE_H), MAKE_SHARED, by_new)
    assert _run(tree, tmp_path).returncode == 0
    mirrored = (tmp_path / "out" / "generated" / "mirror" / Path(*VALUE_H)).read_text()
    assert "llamaprompt_value_pool" not in mirrored and "thread_slots.h" not in mirrored
    rows = [r for r in _info(tmp_path)["rewrites"] if r.get("engine", "").startswith("values: allocated")]
    assert len(rows) == 3 and not any(r["applied"] for r in rows)
    assert any("values: allocated from per-thread free lists" in n for n in _info(tmp_path)["notes"])


RUNTIME_COPY = ("generated", "jinja-runtime.cpp")


def test_member_property_text_rewrite(tree, tmp_path):
    # facts from reading runtime.cpp: member_expression takes its property's text with
    # property->as_string().str() in four places (obj.name, and the object / array-or-string /
    # other branches); value_string_t::as_string() returns its val_str
    assert _run(tree, tmp_path).returncode == 0
    text = (tmp_path / "out").joinpath(*RUNTIME_COPY).read_text()
    assert "property->as_string().str()" not in text
    assert text.count("llamaprompt_value_text(property)") == 4
    helper = text.index("static std::string llamaprompt_value_text(")
    assert helper < text.index("value member_expression::execute_impl")


def test_member_property_text_needs_as_string_to_be_val_str(tree, tmp_path):
    _edit(
        tree.joinpath(*VALUE_H),
        "virtual string as_string() const override { return val_str; }",
        "virtual string as_string() const override { string s = val_str; s.mark_input(); return s; }",
    )
    assert _run(tree, tmp_path).returncode == 0
    text = (tmp_path / "out").joinpath(*RUNTIME_COPY).read_text()
    assert "llamaprompt_value_text" not in text and text.count("property->as_string().str()") == 4
    assert "member access copies its property's string value" in " ".join(_info(tmp_path)["notes"])


# the autoparser's generate_parser: its stop point before the parser is built (generator_rewrite)
GENERATOR = "common/chat-auto-parser-generator.cpp"
BUILD_PARSER = "    auto parser = autoparser.build_parser(inputs, parser_generation_prompt);\n"


def test_generator_probe_on_the_tree(tree, tmp_path):
    # facts from reading generate_parser: it renders the prompt and the generation prompt, appends
    # a continued message to both, then builds the parser from the inputs and
    # `parser_generation_prompt`, the generation prompt as it was before the continuation
    assert _run(tree, tmp_path).returncode == 0
    assert _info(tmp_path)["prompt_only_generator"] == "prompt-only"
    copy = (tmp_path / "out" / "generated" / "mirror" / GENERATOR).read_text().splitlines()
    original = (tree / GENERATOR).read_text().splitlines()
    assert copy[1] == "#line 1"
    ready = "if (llamaprompt_prompt_ready(nullptr)) { return data; }"
    stop = [i for i, x in enumerate(copy[2:]) if ready in x]
    assert len(stop) == 1 and original[stop[0]] + "\n" == BUILD_PARSER
    # compiled into _core, not again in llama-common
    assert GENERATOR in (tmp_path / "out" / "lp_tree.cmake").read_text()


GENERATOR_EDITS = [
    # (kept prompt-only?, before the parser is built, after it, the reason given)
    (False, "", '    data.prompt += "x";\n', "reads or changes the prompt"),
    (False, "", "    auto k = inputs.continue_msg.content.size();\n", "reads the messages"),
    (False, "", "    auto n = inputs.messages.size();\n", "reads the messages"),
    (False, "", '    try { data.grammar = "x"; } catch (...) { }\n', "catches exceptions"),
    (False, '    parser_generation_prompt += "x";\n', "", "is used other than as the parser's"),
    (False, "    auto n_msgs = inputs.messages.size();\n", "    data.grammar_lazy = n_msgs > 3;\n", "set before it"),
    (False, "", "    auto q = helper(inputs);\n", "passes the whole inputs on"),
    # text the rules would not read as the compiler does
    (False, "", '    // a note \\\n    data.prompt += "x";\n', "line continuation"),
    (False, "", "#if 0\n    {\n#endif\n", "preprocessor lines"),
    (False, "", "    goto done;\n", "goto"),
    (True, "", '    LOG_DBG("%s", "building the parser");\n', ""),
    (True, "", '    data.grammar = R"x(messages " data.prompt)x";\n', ""),
]


@pytest.mark.parametrize(("kept", "before", "after", "reason"), GENERATOR_EDITS)
def test_generator_probe_on_edited_generators(tree, tmp_path, kept, before, after, reason):
    path = tree / GENERATOR
    text = path.read_text()
    assert text.count(BUILD_PARSER) == 1
    path.write_text(text.replace(BUILD_PARSER, before + BUILD_PARSER + after))
    assert _run(tree, tmp_path).returncode == 0
    verdict = _info(tmp_path)["prompt_only_generator"]
    assert (verdict == "prompt-only") == kept, verdict
    assert reason in verdict
    copy = tmp_path / "out" / "generated" / "mirror" / GENERATOR
    assert (copy.exists() and "llamaprompt_prompt_ready(" in copy.read_text()) == kept
    if not kept:
        assert "generate_parser has no prompt-only stop point" in (tmp_path / "out" / "lp_tree.cmake").read_text()


def test_generator_probe_reads_the_other_autoparser_sources(tree, tmp_path):
    # the parser's own code reading the continued message: no stop point
    helpers = tree / "common" / "chat-auto-parser-helpers.cpp"
    helpers.write_text(
        helpers.read_text()
        + "\nstatic size_t lp_probe_test(const autoparser::generation_params & p) {\n"
        + "    return p.continue_msg.content.size();\n}\n"
    )
    assert _run(tree, tmp_path).returncode == 0
    assert "chat-auto-parser-helpers.cpp reads the continued message" in _info(tmp_path)["prompt_only_generator"]


# common_chat_try_specialized_template: a choice by the template source alone (handler_choice_problems)
def _choice_body_start(text: str) -> int:
    import re

    m = re.search(r"std::optional<common_chat_params>\s+common_chat_try_specialized_template\s*\([^)]*\)\s*\{\n", text)
    assert m, "common_chat_try_specialized_template not found"
    return m.end()


def test_handler_choice_is_by_source_on_the_tree(tree, tmp_path):
    # facts from reading common_chat_try_specialized_template: every branch tests src.find(...)
    # (or is_lfm2_template(src)) and returns a handler's result; it ends with std::nullopt
    assert _run(tree, tmp_path).returncode == 0
    assert _info(tmp_path)["handler_choice_by_source"] is True
    assert "#define LP_HANDLER_CHOICE_BY_SOURCE 1" in (tmp_path / "out" / "generated" / "lp_tree.h").read_text()


CHOICE_EDITS = [
    # (inserted at the top of the function, the reason given)
    (
        "    if (params.tools.is_array()) {\n        return common_chat_params_init_gpt_oss(tmpl, params);\n    }\n",
        "a branch tests is_array, params, tools, not only the source",
    ),
    ('    LOG_DBG("%s: choosing\\n", __func__);\n', "a statement other than a source test"),
    (
        '    if (src.find("<x>") != std::string::npos) {\n        LOG_DBG("x\\n");\n    }\n',
        "a branch does not end by returning a handler's result",
    ),
]


@pytest.mark.parametrize(("inserted", "reason"), CHOICE_EDITS)
def test_handler_choice_on_edited_trees(tree, tmp_path, inserted, reason):
    path = tree / "common" / "chat.cpp"
    text = path.read_text()
    at = _choice_body_start(text)
    path.write_text(text[:at] + inserted + text[at:])
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert reason in _info(tmp_path)["handler_choice_by_source"]
    assert "#define LP_HANDLER_CHOICE_BY_SOURCE 0" in (tmp_path / "out" / "generated" / "lp_tree.h").read_text()
    assert (
        "specialized-handler choice may depend on more than the template"
        in (tmp_path / "out" / "lp_tree.cmake").read_text()
    )


# the render without add_generation_prompt taken from the prompt's identical render (no_gen_reuse_*)
CHAT_COPY = ("generated", "chat.cpp")
NO_GEN_CALL = "llamaprompt_no_gen_render_first(&inputs, !inputs.add_generation_prompt, [&] { return "
GEN_CALL = "llamaprompt_gen_render(&inputs, inputs.add_generation_prompt, [&] { return "
NO_GEN_ONLY_CALL = "llamaprompt_no_gen_render(&inputs, !inputs.add_generation_prompt, [&] { return "
GUARD = "llamaprompt_rendered_prompt llamaprompt_rendered_prompt_guard(data.prompt, &inputs);"
# facts from reading common/parsers/*.cpp: the handlers whose prompt statement is directly
# followed by their generation-prompt statement with the same arguments (gpt-oss renders its
# prompt into a local and changes it first; muse-glimmer renders no generation prompt)
ADJACENT_HANDLERS = {"cohere2moe", "deepseek", "functionary-v3-2", "gemma4", "gigachat-v3", "kimi-k2", "kimi-k3",
                     "lfm2", "ling3", "minicpm5", "minimax-m3", "ministral3", "qwen3-coder"}


def _reuse_calls(tmp_path: Path) -> list[str]:
    """The render reuse calls in generation_prompt_impl's copy."""
    chat = (tmp_path / "out").joinpath(*CHAT_COPY).read_text()
    return [c for c in (NO_GEN_CALL, GEN_CALL, NO_GEN_ONLY_CALL) if c in chat]


def _guarded_files(tmp_path: Path) -> set[str]:
    mirror = tmp_path / "out" / "generated" / "mirror" / "common"
    return {p.stem for p in mirror.rglob("*.cpp") if GUARD in p.read_text()}


def test_no_generation_prompt_render_reuse_on_the_tree(handler_tree, tmp_path):
    tree = handler_tree
    assert _run(tree, tmp_path).returncode == 0
    chat = (tmp_path / "out").joinpath(*CHAT_COPY).read_text()
    assert chat.count(NO_GEN_CALL) == 1
    # inside generation_prompt_impl, in place of its first render
    impl = chat.index("std::string common_chat_template_generation_prompt_impl(")
    assert impl < chat.index(NO_GEN_CALL) < chat.index("params.add_generation_prompt = true;", impl)
    # and in place of its second render, for requests with add_generation_prompt
    assert chat.count(GEN_CALL) == 1
    assert chat.index("params.add_generation_prompt = true;", impl) < chat.index(GEN_CALL)
    assert NO_GEN_ONLY_CALL not in chat
    assert _guarded_files(tmp_path) == ADJACENT_HANDLERS | {"chat-auto-parser-generator"}
    # the guard on the prompt statement's last line, the stop point still on the next line
    copy = (tmp_path / "out" / "generated" / "mirror" / "common" / "parsers" / "kimi-k3.cpp").read_text().splitlines()
    at = next(i for i, x in enumerate(copy) if GUARD in x)
    assert copy[at].startswith("    data.prompt            = common_chat_template_direct_apply_impl(tmpl, inputs);")
    assert copy[at + 1].startswith("    " + PROMPT_READY + "data.generation_prompt")
    assert len(copy) == len((tree / "common" / "parsers" / "kimi-k3.cpp").read_text().splitlines()) + 2


def test_generation_prompt_render_reuse_needs_the_expected_second_render(handler_tree, tmp_path):
    # the render with add_generation_prompt written otherwise (here: without the overrides): only
    # the render without it takes the prompt's (and clears it for later renders)
    second = "    std::string gen_prompt       = common_chat_template_direct_apply_impl(tmpl, params, "
    _edit(handler_tree / "common/chat.cpp", second + "messages_override, tools_override, additional_context);",
          second + "std::nullopt, tools_override, additional_context);")
    assert _run(handler_tree, tmp_path).returncode == 0
    chat = (tmp_path / "out").joinpath(*CHAT_COPY).read_text()
    assert chat.count(NO_GEN_ONLY_CALL) == 1 and NO_GEN_CALL not in chat and GEN_CALL not in chat
    assert "render with add_generation_prompt is not written as expected" in " ".join(_info(tmp_path)["notes"])


@pytest.mark.parametrize(
    ("rel", "old", "new", "note"),
    [
        # the render reads the field the copy turns off: the two renders may differ
        ("common/chat.cpp", "    if (inputs.add_generation_prompt) {\n",
         "    if (inputs.continue_final_message != COMMON_CHAT_CONTINUATION_NONE) { inp[\"c\"] = true; }\n"
         "    if (inputs.add_generation_prompt) {\n", "reads inputs.continue_final_message"),
        # the copy changes one more field than the expected two
        ("common/chat.cpp", "    params.continue_final_message = COMMON_CHAT_CONTINUATION_NONE;\n",
         "    params.continue_final_message = COMMON_CHAT_CONTINUATION_NONE;\n    params.enable_thinking = false;\n",
         "does not begin with the expected copy and render"),
        # the render hands the whole inputs to another function
        ("common/chat.cpp", "    jinja::global_from_json(ctx, inp, inputs.mark_input);",
         "    jinja::global_from_json(ctx, inp, inputs.mark_input); (void) std::addressof(inputs);",
         "passes `inputs` on whole"),
    ],
)
def test_no_generation_prompt_render_reuse_needs_the_same_render(handler_tree, tmp_path, rel, old, new, note):
    _edit(handler_tree / rel, old, new)
    assert _run(handler_tree, tmp_path).returncode == 0
    assert not _reuse_calls(tmp_path)
    assert not _guarded_files(tmp_path)
    assert note in " ".join(_info(tmp_path)["notes"])


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # other arguments for the generation prompt
        ("    data.generation_prompt = common_chat_template_generation_prompt_impl(tmpl, inputs);\n",
         "    data.generation_prompt = common_chat_template_generation_prompt_impl(tmpl, inputs, json::array());\n"),
        # a statement between the two (it could change the prompt or its arguments)
        ("    data.prompt            = common_chat_template_direct_apply_impl(tmpl, inputs);\n",
         "    data.prompt            = common_chat_template_direct_apply_impl(tmpl, inputs);\n"
         "    data.prompt += \"\\n\";\n"),
        # the prompt statement as the body of an `if` without braces
        ("    data.prompt            = common_chat_template_direct_apply_impl(tmpl, inputs);\n",
         "    if (inputs.messages.empty()) data.prompt = common_chat_template_direct_apply_impl(tmpl, inputs);\n"),
    ],
)
def test_no_generation_prompt_render_reuse_needs_adjacent_equal_calls(handler_tree, tmp_path, old, new):
    _edit(handler_tree / QWEN3_CODER, old, new)
    assert _run(handler_tree, tmp_path).returncode == 0
    assert _guarded_files(tmp_path) == ADJACENT_HANDLERS - {"qwen3-coder"} | {"chat-auto-parser-generator"}


def test_no_generation_prompt_render_reuse_is_an_engine_rewrite(handler_tree, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(handler_tree), str(tmp_path / "out"), "--no-engine-rewrites"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert not _reuse_calls(tmp_path)
    assert not _guarded_files(tmp_path)


# syntax-tree node type tests (leaf_stmt_test_edits)
RUNTIME_H = ("common", "jinja", "runtime.h")


def _leaf_nodes(tmp_path: Path) -> set[str]:
    return _specialized(tmp_path, RUNTIME_H, "llamaprompt_leaf_stmt")


def test_type_tests_of_leaf_node_types(tree, tmp_path):
    # facts from reading runtime.h: every node type derives from statement or expression, and only
    # the node types derive from expression; the names also occur as tokens (`token::identifier`),
    # enum values and template arguments (`chk_type<identifier, call_expression>`), never as bases
    assert _run(tree, tmp_path).returncode == 0
    leaves = _leaf_nodes(tmp_path)
    assert {"identifier", "call_expression", "string_literal", "tuple_literal", "program", "for_statement"} <= leaves
    assert "expression" not in leaves and "statement" not in leaves
    text = (tmp_path / "out" / "generated" / "mirror" / Path(*RUNTIME_H)).read_text()
    helpers = text[text.index("bool is_stmt("):text.index("// End Helpers")]
    assert "dynamic_cast" not in helpers and helpers.count("llamaprompt_cast_stmt<") == 3


@pytest.mark.parametrize(
    "code",
    [
        "struct lp_id : public jinja::identifier {};\n",  # a class deriving from it
        "struct lp_id final : jinja::identifier, std::string {};\n",
        "using lp_id = jinja::identifier;\n",  # an alias another class could derive from
        "#define LP_NODE identifier\n",
    ],
)
def test_a_node_type_named_as_a_base_keeps_dynamic_cast(tree, tmp_path, code):
    _edit(tree / "tools" / "server" / "server-common.cpp", "#include", code + "#include")
    assert _run(tree, tmp_path).returncode == 0
    leaves = _leaf_nodes(tmp_path)
    assert "identifier" not in leaves and "call_expression" in leaves



def test_member_access_builtin_miss_rewrite_is_all_or_nothing(tree, tmp_path):
    # facts from reading runtime.cpp: `obj.name` calls try_builtin_func(ctx, prop, object, true)
    # and keeps its result only when it is not undefined
    assert _run(tree, tmp_path).returncode == 0
    text = (tmp_path / "out").joinpath(*RUNTIME_COPY).read_text()
    assert "value val = try_builtin_func(ctx, prop, object, true, true);\n        if (val && " in text
    assert text.count("llamaprompt_null_on_missing") == 2
    # the call site written another way: none of the three edits
    _edit(tree / "common" / "jinja" / "runtime.cpp",
          "        if (!is_val<value_undefined>(val)) {\n            return val;",
          "        if (!val->is_undefined()) {\n            return val;")
    assert _run(tree, tmp_path).returncode == 0
    assert "llamaprompt_null_on_missing" not in (tmp_path / "out").joinpath(*RUNTIME_COPY).read_text()


def _source_searches(chat: str) -> list[str]:
    """The `src.find("...")` calls of chat.cpp's handler choice and of the function that calls it
    (the source_finds rewrite), read off the tree's text: from the choice's definition to the end
    of common_chat_templates_apply_jinja, which follows it in both trees."""
    start = chat.index("common_chat_try_specialized_template(\n")
    end = chat.index("\n}\n", chat.index("common_chat_templates_apply_jinja(const struct"))
    return re.findall(r'(?<![\w.])src\.find\("(?:[^"\\\n]|\\.)*"\)', chat[start:end])


def _searched_elsewhere(chat: str, searches: list[str]) -> list[str]:
    """The searches whose text is also a `src.find` call outside those functions."""
    return [s for s in searches if len(re.findall(r"(?<![\w.])" + re.escape(s), chat)) > searches.count(s)]


def test_the_template_source_searches_are_rewritten_and_other_strings_searches_are_not(tree, tmp_path):
    chat_in = (tree / "common" / "chat.cpp").read_text()
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    chat_out = (tmp_path / "out" / "generated" / "chat.cpp").read_text()
    searches = _source_searches(chat_in)
    assert len(searches) > 15
    rewritten = chat_out.count("llamaprompt_source_find(tmpl, src, ")
    # a literal also searched outside those functions (0.3.35's is_lfm2_template) keeps its call
    shared = _searched_elsewhere(chat_in, searches)
    assert rewritten == len(searches) - len(shared)
    # `default_template_src.find("<|channel|>")` (common_chat_templates_init) is another string's
    # search: left as it is
    assert chat_out.count("default_template_src.find(") == chat_in.count("default_template_src.find(") > 0
    records = [r for r in _info(tmp_path)["rewrites"] if (r.get("engine") or "").startswith("the template source's")]
    assert records and all(r["applied"] for r in records)


def test_a_source_search_that_is_not_a_literal_is_left_with_a_note(tree, tmp_path):
    chat = tree / "common" / "chat.cpp"
    call = next(s for s in _source_searches(chat.read_text()) if "<|open|>" in s)
    _edit(chat, call, "src.find(std::string(\"<|open|>\"))")
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = _info(tmp_path)
    assert any("marker search" in n and "not `src.find(" in n for n in info["notes"]), info["notes"]
    chat_in = chat.read_text()
    chat_out = (tmp_path / "out" / "generated" / "chat.cpp").read_text()
    assert 'src.find(std::string("<|open|>"))' in chat_out
    # the other searches are still rewritten
    searches = _source_searches(chat_in)
    shared = _searched_elsewhere(chat_in, searches)
    assert chat_out.count("llamaprompt_source_find(tmpl, src, ") == len(searches) - len(shared) > 15


def _result_declared_otherwise(path: Path) -> None:
    # the same result, declared in a way the probe does not read as `common_chat_params data;`
    _edit(path, "    common_chat_params data;\n", "    common_chat_params data{};\n")


def _result_declared_in_a_block(path: Path) -> None:
    # the declaration and the code up to the stop point in a block of their own: `return data;`
    # at the stop point could not return it
    text = path.read_text()
    decl, stop = text.index("    common_chat_params data;\n"), text.index("    data.generation_prompt")
    path.write_text(text[:decl] + "    {\n" + text[decl:stop] + "    }\n" + text[stop:])


@pytest.mark.parametrize("change", [_result_declared_otherwise, _result_declared_in_a_block])
def test_a_handler_whose_result_the_stop_point_cannot_return_has_none(handler_tree, tmp_path, change):
    path = handler_tree / "common" / "parsers" / "kimi-k3.cpp"
    change(path)
    assert _run(handler_tree, tmp_path).returncode == 0
    verdict = _info(tmp_path)["prompt_only_handlers"]["common_chat_params_init_kimi_k3"]
    assert "common_chat_params data` declared at its top level" in verdict
    copy = tmp_path / "out" / "generated" / "mirror" / "common" / "parsers" / "kimi-k3.cpp"
    assert not copy.exists() or "llamaprompt_prompt_ready(" not in copy.read_text()


TOKENIZE_HEAD = "this->post_tokenize = [this](const server_http_req & req) {"
DETOKENIZE_HEAD = "this->post_detokenize = [this](const server_http_req & req) {"


def test_tokenize_handlers_are_copied_from_the_tree(tree, tmp_path):
    """serve's /tokenize and /detokenize run the bodies of llama-server's handlers, read from
    server-context.cpp: each generated file holds its body from the tree's line on, the vocab's
    calls renamed to the checked ones (src/cpp/server_tokenize.cpp)."""
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _features(tmp_path)["serve_tokenize"]
    source = (tree / "tools" / "server" / "server-context.cpp").read_text()
    for head, name in ((TOKENIZE_HEAD, "post_tokenize"), (DETOKENIZE_HEAD, "post_detokenize")):
        inc = (tmp_path / "out" / "generated" / f"lp_{name}.inc").read_text()
        line = source[: source.index(head)].count("\n") + 1
        assert f'#line {line} "tools/server/server-context.cpp"' in inc
        body = source[source.index(head) + len(head) :].split("\n    };\n", 1)[0]
        assert inc.split("\n", 2)[2].rstrip() == re.sub(
            r"\b(tokenize_mixed|common_token_to_piece|tokens_to_str)\(ctx_server", r"lp_vocab::\1(ctx_server", body
        ).rstrip()
        assert "ctx_server.vocab" in body and "lp_vocab::" in inc


@pytest.mark.parametrize(
    ("head", "old", "new", "says"),
    [
        # a handler reading more of the server than the vocab
        (
            TOKENIZE_HEAD,
            "const bool with_pieces = json_value(body, \"with_pieces\", false);",
            "const bool with_pieces = json_value(body, \"with_pieces\", ctx_server.params_base.verbose);",
            "uses 'ctx_server.params_base",
        ),
        # the vocab handed to a function server_tokenize.cpp does not check
        (
            DETOKENIZE_HEAD,
            "content = tokens_to_str(ctx_server.vocab, tokens);",
            "content = common_detokenize(ctx_server.vocab, tokens);",
            "calls found: common_detokenize",
        ),
        # a response made otherwise
        (
            DETOKENIZE_HEAD,
            "auto res = create_response();\n        const json body = json::parse(req.body);\n",
            "const json body = json::parse(req.body);\n        auto res = create_response();\n",
            "does not begin 'auto res = create_response();'",
        ),
    ],
    ids=["server-state", "unchecked-vocab-call", "response"],
)
def test_a_changed_tokenize_handler_fails_with_file_and_text(tree, tmp_path, head, old, new, says):
    path = tree / "tools" / "server" / "server-context.cpp"
    text = path.read_text()
    start = text.index(head)
    end = text.index("\n    };\n", start)
    assert old in text[start:end], f"{old!r} not in the handler"
    path.write_text(text[:start] + text[start:end].replace(old, new, 1) + text[end:])
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1
    name = "post_tokenize" if head == TOKENIZE_HEAD else "post_detokenize"
    assert f"tools/server/server-context.cpp: this->{name}" in proc.stderr and says in proc.stderr


def test_tokenize_handlers_absent_or_one_gone(tree, tmp_path):
    """Neither handler in that form: configure goes on without them (serve answers 501, the
    feature is False); one of the two gone fails, naming it."""
    path = tree / "tools" / "server" / "server-context.cpp"
    text = path.read_text()
    path.write_text(text.replace(DETOKENIZE_HEAD, "this->post_detokenize_v2 = [this](const server_http_req & req) {"))
    proc = _run(tree, tmp_path)
    assert proc.returncode == 1
    assert "'this->post_detokenize = [this](const server_http_req & req) {' not found" in proc.stderr
    path.write_text(
        text.replace(DETOKENIZE_HEAD, "this->post_detokenize_v2 = [this](const server_http_req & req) {").replace(
            TOKENIZE_HEAD, "this->post_tokenize_v2 = [this](const server_http_req & req) {"
        )
    )
    proc = _run(tree, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _features(tmp_path)["serve_tokenize"] is False
    assert "not in this tree: tools/server/server-context.cpp: llama-server's POST /tokenize" in (
        tmp_path / "out" / "lp_tree.cmake"
    ).read_text()
