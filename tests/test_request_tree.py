"""A request dict reaches llama.cpp as the JSON tree its text would parse to (request.h).

apply_template(dict) builds the tree json::parse would make of Python's JSON text of the
dict, without writing or parsing text, when every value is plain; otherwise the dict is
encoded and parsed as before. Either way the answer must be the one llama.cpp gives for the
text: every case below is compared with the same request sent as JSON text (llama.cpp's own
parser reading it) or through a read-only mapping (which always takes the text path), and
the core's counter shows which path the dict took -- a comparison of the text path with
itself would prove nothing.
"""

from __future__ import annotations

import collections
import json
import math
import subprocess
import sys
import textwrap
import types

import pytest

import llamaprompt
from conftest import load_reference

# every value the template sees, as llama.cpp's tojson writes it: kwargs are dumped and parsed
# again by llama-server (chat_template_kwargs), tools reach the template as they were parsed
SOURCE = (
    "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
    "{% if v is defined %}v={{ v | tojson }}{% endif %}"
    "{% if tools %}t={{ tools | tojson }}{% endif %}"
)


@pytest.fixture(scope="module")
def tmpl():
    return llamaprompt.ChatTemplate(SOURCE)


def _request(value, where="kwargs"):
    if where == "kwargs":
        return {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"v": value}}
    if where == "content":
        return {"messages": [{"role": "user", "content": value}]}
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"x": value}}}
    return {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}


class _Int(int):
    pass


class _Str(str):
    pass


class _Float(float):
    pass


class _Dict(dict):
    pass


def _nested(depth):
    v: list = []
    for _ in range(depth - 1):
        v = [v]
    return v


# (id, value, where): values JSON text carries unchanged -- taken as a tree
TREE = [
    ("none", None, "kwargs"),
    ("true", True, "kwargs"),
    ("false", False, "kwargs"),
    ("zero", 0, "kwargs"),
    ("minus-one", -1, "kwargs"),
    ("int64-max", 2**63 - 1, "kwargs"),
    ("int64-max-plus-one", 2**63, "kwargs"),
    ("uint64-max", 2**64 - 1, "kwargs"),
    ("int64-min", -(2**63), "kwargs"),
    ("float-zero", 0.0, "kwargs"),
    ("float-minus-zero", -0.0, "kwargs"),
    ("float-tenth", 0.1, "kwargs"),
    ("float-1e16", 1e16, "kwargs"),
    ("float-huge", 1.7976931348623157e308, "kwargs"),
    ("float-subnormal", 5e-324, "kwargs"),
    ("float-whole", 3.0, "tools"),
    ("empty-str", "", "content"),
    ("non-ascii", "héllo wörld", "content"),
    ("cjk", "日本語のテキスト", "content"),
    ("astral", "emoji 😀 and 𝔘", "content"),
    ("nul-and-controls", "a\x00b\x01c\x1f\x7f\n\t\r", "content"),
    ("line-separators", "\u2028\u2029\ufeff", "content"),
    ("quotes-and-slashes", '"\\/</script>', "content"),
    ("nested", {"a": [1, -2, 3.5, {"b": None, "c": [True, False]}], "é": {"k": "v"}}, "tools"),
    ("empty-containers", {"a": {}, "b": [], "c": [[]]}, "tools"),
    ("unicode-keys", {"ключ": 1, "鍵": 2, "🔑": 3}, "kwargs"),
    ("deep-200", _nested(200), "kwargs"),
]

# values whose JSON text is not the value itself (or may not be): encoded by Python and
# parsed as text, as before the tree existed
TEXT = [
    ("uint64-max-plus-one", 2**64, "kwargs"),
    ("int64-min-minus-one", -(2**63) - 1, "kwargs"),
    ("bigint", 10**30, "kwargs"),
    ("tuple", (1, "a", None), "kwargs"),
    ("int-subclass", _Int(7), "kwargs"),
    ("str-subclass", _Str("sub"), "content"),
    ("float-subclass", _Float(2.5), "kwargs"),
    ("dict-subclass", _Dict(a=1), "kwargs"),
    ("ordered-dict", collections.OrderedDict([("b", 1), ("a", 2)]), "tools"),
    ("lone-surrogate", "x\ud800y", "content"),
    ("surrogate-escape", "x\udcffy", "content"),
    ("int-key", {1: "a"}, "kwargs"),
    ("bool-and-none-keys", {True: 1, None: 2}, "kwargs"),
    ("keys-that-collide", {1: "int", "1": "str"}, "kwargs"),
    ("float-key", {1.5: "a"}, "kwargs"),
    ("deep-300", _nested(300), "kwargs"),
]

# values no JSON text can hold: the same RequestError either way
REFUSED = [
    ("nan", math.nan),
    ("infinity", math.inf),
    ("bytes", b"x"),
    ("set", {1}),
    ("tuple-key", {(1, 2): 3}),
    ("object", object()),
]


def _outcome(tmpl, request):
    try:
        return ("prompt", tmpl.apply_template(request))
    except llamaprompt.Error as e:
        return (type(e).__name__, e.status, e.message)


@pytest.mark.parametrize(("value", "where"), [pytest.param(v, w, id=i) for i, v, w in TREE])
def test_plain_values_are_taken_as_a_tree(tmpl, value, where):
    request = _request(value, where)
    before = tmpl._core.tree_bodies()
    got = _outcome(tmpl, request)
    assert tmpl._core.tree_bodies() == before + 1  # the tree path was taken
    want = _outcome(tmpl, json.dumps(request, ensure_ascii=False))  # llama.cpp parses the text
    assert tmpl._core.tree_bodies() == before + 1
    assert got == want
    assert got[0] == "prompt"


@pytest.mark.parametrize(("value", "where"), [pytest.param(v, w, id=i) for i, v, w in TEXT])
def test_other_values_take_the_text_path(tmpl, value, where):
    request = _request(value, where)
    before = tmpl._core.tree_bodies()
    got = _outcome(tmpl, request)
    assert tmpl._core.tree_bodies() == before  # declined: encoded and parsed as before
    assert got == _outcome(tmpl, types.MappingProxyType(request))


@pytest.mark.parametrize("value", [pytest.param(v, id=i) for i, v in REFUSED])
def test_values_no_json_holds_are_refused_alike(tmpl, value):
    request = _request(value)
    got = _outcome(tmpl, request)
    assert got[0] == "RequestError" and got[1] == 400
    assert got == _outcome(tmpl, types.MappingProxyType(request))


def test_facts_of_the_text_reach_the_template(tmpl):
    """What reading the template says the prompt holds: an int past 64 bits is a double (as
    json::parse reads its digits), keys Python converts to the same string keep the last value
    (as json::parse keeps it), a NUL stays in the content."""
    assert tmpl.apply_template(_request(-(2**63))) == "[user|hi]v=-9223372036854775808"
    assert "e+19" in tmpl.apply_template(_request(2**64))
    assert tmpl.apply_template(_request({1: "int", "1": "str"})) == '[user|hi]v={"1": "str"}'
    assert tmpl.apply_template(_request("a\x00b", "content")) == "[user|a\x00b]"


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        pytest.param({"messages": [], "x": {str(i): i for i in range(10001)}}, "more than 10000 members", id="members"),
        pytest.param(
            {"messages": [], **{f"x{j}": {str(i): i for i in range(10000)} for j in range(3)}},
            "too many members together",
            id="lookups",
        ),
        pytest.param({"messages": [], "x": _nested(1001)}, "nested too deeply", id="depth"),
    ],
)
def test_limits_answer_as_for_text(tmpl, request_, message):
    before = tmpl._core.tree_bodies()
    with pytest.raises(llamaprompt.RequestError, match=message) as info:
        tmpl.apply_template(request_)
    assert tmpl._core.tree_bodies() == before
    with pytest.raises(llamaprompt.RequestError) as text_info:
        tmpl.apply_template(types.MappingProxyType(request_))
    assert info.value.message == text_info.value.message


def test_many_mixes_trees_text_and_refusals(tmpl):
    requests = [_request(1), _request((1, 2)), _request(math.nan), json.dumps(_request("t")), _request("é", "content")]
    before = tmpl._core.tree_bodies()
    got = tmpl.apply_template_many(requests, threads=2, return_exceptions=True)
    assert tmpl._core.tree_bodies() == before + 2  # the first and the last
    assert [type(r) for r in got] == [str, str, llamaprompt.RequestError, str, str]
    for request, result in zip(requests, got):
        want = _outcome(tmpl, types.MappingProxyType(request) if isinstance(request, dict) else request)
        if isinstance(result, llamaprompt.Error):
            assert want == (type(result).__name__, result.status, result.message)
        else:
            assert want == ("prompt", result)


def test_reference_requests_as_trees_and_as_text():
    """Every reference request gives the same answer as a dict (tree) and as its JSON text, on
    each recorded template (the reference suite checks the answers themselves)."""
    from conftest import template_path

    ref = load_reference("apply_template.json")
    templates = ref["variants"][0]["templates"]
    tok = ref["model_tokens"]
    checked = 0
    for name in templates:
        t = llamaprompt.ChatTemplate.from_file(
            template_path(name), bos_token=tok["bos_token"], eos_token=tok["eos_token"],
            add_bos=tok["add_bos"], add_eos=tok["add_eos"], media_marker=ref["media_marker"],
        )
        for request in ref["requests"].values():
            if type(request) is not dict:
                continue
            before = t._core.tree_bodies()
            as_tree = _outcome(t, request)
            assert t._core.tree_bodies() == before + 1, name
            assert as_tree == _outcome(t, json.dumps(request, ensure_ascii=False)), name
            checked += 1
    assert checked >= 35 * len(templates) - 35


def test_apply_takes_the_tree_too():
    """apply(dict) gives every field apply(JSON text) gives, the dict taken as a tree."""
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B"))
    tool = {"type": "function", "function": {"name": "get", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 2**63}}}}}
    request = {"messages": [{"role": "user", "content": "héllo"}], "tools": [tool], "temperature": 0.25}
    before = t._core.tree_bodies()
    as_tree = t.apply(request)
    assert t._core.tree_bodies() == before + 1
    as_text = t.apply(json.dumps(request, ensure_ascii=False))
    assert t._core.tree_bodies() == before + 1
    assert as_tree.prompt == as_text.prompt and as_tree.grammar == as_text.grammar
    assert as_tree.llama_params == as_text.llama_params


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` (indented as in a test) after _SETUP, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-c", _SETUP + textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


_SETUP = f"""
import json, resource, sys, threading, types, llamaprompt
t = llamaprompt.ChatTemplate({SOURCE!r})
def nested(depth):
    v = []
    for _ in range(depth - 1):
        v = [v]
    return v
def request(v):
    return {{"messages": [{{"role": "user", "content": "hi"}}], "chat_template_kwargs": {{"v": v}}}}
def outcome(r):
    try:
        return t.apply_template(r)
    except llamaprompt.Error as e:
        return (type(e).__name__, e.status, e.message)
"""


def test_a_thread_with_a_small_stack_takes_the_text_path():
    """The tree is built on the caller's stack: a thread made with a small stack
    (threading.stack_size) gets the text path instead of a stack overflow (found by a trial:
    200 levels overflowed 64 KiB)."""
    proc = _run("""
    r = request(nested(200))
    out = {}
    def run():
        before = t._core.tree_bodies()
        out["got"] = outcome(r)
        out["trees"] = t._core.tree_bodies() - before
    threading.stack_size(64 * 1024)
    th = threading.Thread(target=run); th.start(); th.join()
    print(json.dumps([out["got"] == outcome(types.MappingProxyType(r)), out["trees"], out["got"][:9]]))
    """)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [True, 0, "[user|hi]"]


def test_a_request_that_holds_itself_is_refused_without_copying_it():
    """A cycle is refused as json.dumps refuses it ("Circular reference detected"), found before
    the tree copies the cycle level after level (4 MB x 256 levels, before the check)."""
    proc = _run("""
    big = ["x" * 4_000_000]
    big.append(big)
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = outcome(request(big))
    grew_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_rss) / 1024
    print(json.dumps([got, grew_mib < 100]))
    """)
    assert proc.returncode == 0, proc.stderr
    got, small = json.loads(proc.stdout)
    assert got[:2] == ["RequestError", 400] and "Circular reference detected" in got[2]
    assert small


def test_nesting_past_pythons_recursion_limit_answers_as_for_the_encoder():
    """Python's encoder raises RecursionError at the recursion limit ("request is nested too
    deeply"); the tree declines before that depth, so the dict gets the encoder's answer."""
    proc = _run("""
    r = request(nested(150))
    sys.setrecursionlimit(100)
    before = t._core.tree_bodies()
    got = outcome(r)
    trees = t._core.tree_bodies() - before
    want = outcome(types.MappingProxyType(r))
    sys.setrecursionlimit(1000)
    print(json.dumps([got, want, trees, outcome(r)[:9]]))
    """)
    assert proc.returncode == 0, proc.stderr
    got, want, trees, unlimited = json.loads(proc.stdout)
    assert got == want == ["RequestError", 400, "request is nested too deeply"]
    assert trees == 0
    assert unlimited == "[user|hi]"
