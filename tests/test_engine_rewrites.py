"""Edge cases of llamaprompt's engine rewrites (third_party/adapt_tree.py, docs/performance.md):
what a template can observe where a rewrite takes a shortcut. Each expected prompt is a fact
of the template language (Jinja's `loop` object, the request's date) or of llama.cpp's engine
as its code reads (which scope a statement runs in), so a rewrite that leaks one iteration's
state into another, lets a scope see a later change of its parent's variables, or prints a
stale date, fails here; the differential run
(tests/engine_differential.py) then compares the whole engine against the unmodified one."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest

import llamaprompt

HI = {"messages": [{"role": "user", "content": "hi"}]}


def _render(source: str, request: dict | None = None) -> str:
    return llamaprompt.ChatTemplate(source).apply_template(request or HI)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # the loop object of each iteration, read in it
        ("{% for x in [10, 20, 30] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}"
         "{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
         "1032TrueFalse3;2121FalseFalse3;3210FalseTrue3;"),
        ("{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }};{% endfor %}", "-2;1-3;2-;"),
        # an iteration's object kept past it: each keeps its own numbers
        ("{% set ns = namespace(first=none) %}{% for x in [1, 2, 3] %}{% if loop.first %}{% set ns.first = loop %}"
         "{% endif %}{% endfor %}{{ ns.first.index }}{{ ns.first.last }}",
         "1False"),
        ("{% set ns = namespace(all=[]) %}{% for x in ['a', 'b', 'c'] %}{% set ns.all = ns.all + [loop] %}{% endfor %}"
         "{% for l in ns.all %}{{ l.index }}{{ l.previtem }}{% endfor %}",
         "12a3b"),
        ("{% for x in [1, 2, 3] %}{% set kept = loop %}{{ kept.index }}{% endfor %}", "123"),
        # a key added to one iteration's object is not in the next one's
        ("{% for x in [1, 2, 3] %}{{ loop.extra is defined }}{% set loop.extra = x %}{{ loop.extra }};{% endfor %}",
         "False1;False2;False3;"),
        ("{% for x in [1, 2, 3] %}{{ loop.index }}{% set loop.index = 9 %}{{ loop.index }};{% endfor %}",
         "19;29;39;"),
        # `loop` rebound in the body, and a loop variable named `loop`
        ("{% for x in [1, 2] %}{{ loop.index }}{% set loop = 5 %}{{ loop }};{% endfor %}", "15;25;"),
        ("{% for loop in [7, 8] %}{{ loop }};{% endfor %}", "7;8;"),
        # nested loops: the inner one's object does not replace the outer one's
        ("{% for a in [1, 2] %}{% for b in ['x', 'y'] %}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}",
         "121;122;"),
        # a loop filter, `continue` and `break`
        ("{% for x in [1, 2, 3, 4] if x != 2 %}{{ loop.index }}/{{ loop.length }}{{ loop.last }};{% endfor %}",
         "1/3False;2/3False;3/3True;"),
        ("{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}"
         "{{ loop.index }}{{ loop.previtem }};{% endfor %}",
         "1;32;"),
        # a macro called in the body, and one given `loop`
        ("{% macro show(l) %}{{ l.index }}{% endmacro %}{% for x in [1, 2] %}{{ show(loop) }}{% endfor %}", "12"),
    ],
)
def test_each_iteration_has_its_own_loop_object(source, expected):
    assert _render(source) == expected


# llama.cpp's scopes (runtime.cpp): a `for` runs its body in one scope made from the enclosing
# one (what the body sets stays in it, for every later iteration, and is gone after the loop);
# its `else` block runs in the enclosing scope; a macro call's scope is made from the caller's;
# a call block's body runs in a scope made from the one at the `call` -- its variables as they
# were there, whenever `caller` is called. A scope that shared its parent's variables instead of
# having them as they were fails here
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # set in the body: seen by the next iteration, not after the loop
        ("{% set x = 1 %}{% for m in ['a', 'b'] %}{{ x }}{{ m }}{% set x = 2 %}{{ x }};{% endfor %}{{ x }}",
         "1a2;2b2;1"),
        # nested loops: the inner one reads the outer one's variable and shadows it for itself only
        ("{% for a in [1, 2] %}{% set t = a %}{% for b in [3, 4] %}{{ t }}{{ b }}{% set t = b %}{{ t }},{% endfor %}"
         "{{ t }}{{ loop.index }};{% endfor %}",
         "133,344,11;233,344,22;"),
        # the `else` block sets in the enclosing scope
        ("{% set x = 1 %}{% for i in [] %}{% else %}{% set x = 7 %}{% endfor %}{{ x }}", "7"),
        # a macro reads its caller's variables; what it sets stays in its call
        ("{% set x = 1 %}{% macro f(a) %}[{{ a }}{{ x }}{{ y }}]{% set x = 5 %}{{ x }}{% endmacro %}"
         "{% set y = 3 %}{{ f(0) }}{{ x }}{% set y = 4 %}{{ f(9) }}",
         "[013]51[914]5"),
        # recursion: each call has its own `k`
        ("{% macro r(n) %}{% if n > 0 %}{% set k = n %}{{ k }}{{ r(n - 1) }}{{ k }}{% endif %}{% endmacro %}{{ r(3) }}",
         "321123"),
        # a call block's body: the variables at the `call`, also when `caller` is called later
        ("{% set ns = namespace(f=none) %}{% macro keep() %}{% set ns.f = caller %}{% endmacro %}{% set x = 1 %}"
         "{% call keep() %}<{{ x }}>{% endcall %}{% set x = 2 %}{{ ns.f() }}{{ x }}",
         "<1>2"),
        # ... kept from a loop's first iteration: that iteration's item and `loop`
        ("{% set ns = namespace(f=none) %}{% macro keep() %}{% set ns.f = caller %}{% endmacro %}"
         "{% for i in [1, 2, 3] %}{% set j = i * 10 %}{% if loop.first %}{% call keep() %}"
         "<{{ i }}:{{ j }}:{{ loop.index }}:{{ loop.last }}>{% endcall %}{% endif %}{% endfor %}{{ ns.f() }}",
         "<1:10:1:False>"),
        ("{% macro m(n) %}{{ caller(n) }}{{ caller(n + 1) }}{% endmacro %}{% set z = 9 %}"
         "{% call(v) m(1) %}({{ v }}{{ z }}){% endcall %}",
         "(19)(29)"),
    ],
)
def test_each_scope_has_its_variables_as_they_were_when_it_was_made(source, expected):
    assert _render(source) == expected


# a call block whose body calls the `caller` kept by the previous one: each call's scopes are
# made from the previous call's, so without a bound the scopes would form a chain as long as the
# loop -- freed recursively (the process dies on a small stack) and kept alive by the cycle
# through the namespace (unbounded memory). Past 8 levels a scope copies its parent's variables
# (as upstream's every scope does), which releases the older ones as upstream does
KEPT_CALLERS = """{%- set ns = namespace(f=none) -%}
{%- macro store(ns) -%}{%- set ns.f = caller -%}{%- endmacro -%}
{%- macro g(a, g, store, ns) -%}{%- call(b, g, store, ns) store(ns) -%}{{ g(b, g, store, ns) }}{%- endcall -%}
{%- endmacro -%}
{{- g(0, g, store, ns) -}}
{%- for i in range(N) -%}{{- ns.f(i, g, store, ns) -}}{%- endfor -%}RELEASE done"""


def test_callers_kept_from_call_to_call_neither_crash_nor_keep_every_scope():
    code = """
import sys, llamaprompt
src = sys.argv[1]
req = {"messages": [{"role": "user", "content": "hi"}]}
def render(n, release):
    text = src.replace("N", str(n)).replace("RELEASE", release)
    return llamaprompt.ChatTemplate(text, timeout=300).apply_template(req)
# kept by the cycle (ns.f -> the caller's scopes -> ns) until the process ends
kept = render(8000, "")
# this process's peak RSS (getrusage's ru_maxrss would include the forking process's peak)
status = open("/proc/self/status").read() if sys.platform == "linux" else ""
rss_mib = next((int(line.split()[1]) // 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
# freed at the end of the render (a chain of 50,000 calls' scopes overflowed an 8 MiB stack)
freed = render(50000, "{%- set ns.f = none -%}")
print(kept, freed, rss_mib)
"""
    res = subprocess.run([sys.executable, "-c", code, KEPT_CALLERS], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    kept, freed, rss_mib = res.stdout.split()
    assert kept == freed == "done"
    # a chain of every call's scopes held 730 MB at 8,000 calls; a scope's copy, as upstream's: ~50 MB
    assert int(rss_mib) < 400


def test_the_date_is_todays_in_the_processs_time_zone():
    # common_chat_extra_context prints the date of each request (`date_string`, `datetime`); Llama
    # 3.x templates print it in the system prompt. Printed again when the day or the zone changes.
    src = "{{ date_string }}|{{ datetime }}"
    t = llamaprompt.ChatTemplate(src)
    before = datetime.datetime.now()
    out = t.apply_template(HI)
    after = datetime.datetime.now()
    expected = {d.strftime("%d %b %Y") + "|" + d.strftime("%b %d %Y") for d in (before, after)}
    assert out in expected
    assert t.apply_template(HI) in expected | {out}


@pytest.mark.skipif(not hasattr(time, "tzset"), reason="time.tzset is POSIX")
def test_the_date_follows_a_time_zone_change_in_the_same_second():
    # two zones 26 hours apart are on different dates at any instant: the second render, right
    # after the change, must print the other zone's date, not the one printed before it
    code = """
import os, time, datetime, llamaprompt
t = llamaprompt.ChatTemplate("{{ date_string }}")
req = {"messages": [{"role": "user", "content": "hi"}]}
out = []
for zone in ("Etc/GMT+12", "Etc/GMT-14", "Etc/GMT+12"):
    os.environ["TZ"] = zone
    time.tzset()
    want = datetime.datetime.now().strftime("%d %b %Y")
    got = t.apply_template(req)
    out.append((want, got))
print(repr(out))
"""
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    pairs = eval(res.stdout)  # noqa: S307  (our own repr of a list of string pairs)
    # (a day boundary between the two reads of a pair would make them differ once: retry-free
    # check on the pairs whose zone's day did not change)
    dates = [got for _, got in pairs]
    assert dates[0] != dates[1] and dates[1] != dates[2]
    assert sum(want == got for want, got in pairs) >= 2


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "GigaChat3.1-10B-A1.8B"])
def test_parallel_tool_calls_defaults_to_the_templates_caps(name):
    # oaicompat_chat_params_parse: a request without `parallel_tool_calls` takes the template's
    # caps["supports_parallel_tool_calls"] (True for Qwen3, False for GigaChat 3.1), and the tool
    # grammar of both templates depends on it
    from llamaprompt.fixtures import default_requests
    from llamaprompt.pinned import pinned_template

    t = llamaprompt.ChatTemplate.from_file(pinned_template(name))
    request = default_requests()["tools"]
    grammars = {value: t.apply({**request, "parallel_tool_calls": value}).grammar for value in (True, False)}
    assert grammars[True] != grammars[False]
    assert t.apply(request).grammar == grammars[t.caps["supports_parallel_tool_calls"]]
    assert t.caps["supports_parallel_tool_calls"] is (name == "Qwen-Qwen3-0.6B")


def test_typed_content_is_joined_for_a_string_only_template():
    # render_message_to_json's normalization (the messages moved, no longer copied): Qwen3 takes
    # string content only, so typed text parts are joined with a newline (concat_content_parts),
    # and its template prints a user message as <|im_start|>user, a newline, the content, <|im_end|>
    from llamaprompt.pinned import pinned_template

    t = llamaprompt.ChatTemplate.from_file(pinned_template("Qwen-Qwen3-0.6B"))
    assert t.caps["supports_string_content"] and not t.caps["supports_typed_content"]
    typed = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    plain = {"messages": [{"role": "user", "content": "a\nb"}]}
    for _ in range(2):  # the same request again: nothing of the first call's moved messages is left
        prompt = t.apply_template(typed)
        assert "<|im_start|>user\na\nb<|im_end|>" in prompt
        assert prompt == t.apply_template(plain)


def _schema_grammar_rules(*patterns: str) -> set[str]:
    """The names of the rules in Qwen3's grammar for a response_format of string properties
    with these patterns."""
    props = {f"p{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns)}
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": props}}}
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    grammar = t.apply({**HI, "response_format": fmt}).grammar
    return {line.split(" ::= ")[0] for line in grammar.splitlines() if " ::= " in line}


def test_an_unsupported_pattern_takes_back_only_the_rules_it_added(caplog):
    # json-schema-to-grammar converts a pattern piece by piece: `.` adds the rule `dot`, then `(?=`
    # is unsupported and the property accepts any string, the rules the pattern added taken back
    # (upstream: the table restored from a copy; rewritten: the keys inserted since erased)
    assert "dot" in _schema_grammar_rules("^a.b$")
    with caplog.at_level("WARNING", logger="llamaprompt.llama_cpp"):
        rules = _schema_grammar_rules("^a.b(?=c)$")
    # (older trees, 0.3.35's, neither say so nor take the rules back: upstream's behaviour there)
    if "is not supported (unsupported group syntax), accepting any string" in caplog.text:
        assert "dot" not in rules
    # a rule that was there before the pattern stays, though the pattern added it again
    assert "dot" in _schema_grammar_rules("^a.b$", "^a.b(?=c)$")
    assert "dot" in _schema_grammar_rules("^a.b(?=c)$", "^a.b$")


# String literals: every run must see the literal's text, whatever an earlier run did with its
# value -- kept in a namespace, a list or as an object key, concatenated, filtered, repeated,
# compared -- and a template freed and another parsed at the same addresses must see its own
# literals; two runs of one literal give two objects (`sameas`). Kept from a rewrite that shared a
# literal's value between runs (dropped: adapt_tree.py says why), for any later one. The expected
# prompts are the templates' text read as Jinja.
@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for x in [1, 2, 3] %}{{ 'a' }}{{ 'a' ~ x }}{{ 'a' * x }};{% endfor %}", "aa1a;aa2aa;aa3aaa;"),
        ("{% set ns = namespace(s='', l=[]) %}{% for x in [1, 2] %}{% set ns.s = ns.s ~ 'ab' %}"
         "{% set ns.l = ns.l + ['cd'] %}{% endfor %}{{ ns.s }}|{{ ns.l | join(',') }}|{{ 'cd' }}",
         "abab|cd,cd|cd"),
        ("{% set l = [] %}{% for x in [1, 2] %}{% set _ = l.append('v') %}{{ l | length }}{% endfor %}"
         "{{ l[0] is string }}{{ l[0] == l[1] }}", "12TrueTrue"),
        ("{% for x in [1, 2] %}{% set d = {'k': x} %}{{ d['k'] }}{{ d.k }}{{ 'k' in d }}{% endfor %}",
         "11True22True"),
        ("{% for x in ['abc', 'ABC'] %}{{ 'abc' | upper }}{{ 'abc' | title }}{{ x == 'abc' }}{{ 'abc' }};{% endfor %}",
         "ABCAbcTrueabc;ABCAbcFalseabc;"),
        ("{% macro m(s) %}{{ s ~ '!' }}{% endmacro %}{% for x in [1, 2] %}{{ m('hi') }}{{ 'hi' }}{% endfor %}",
         "hi!hihi!hi"),
        ("{% for x in [1, 2] %}{{ '' }}{{ ''|length }}{{ 'ab' | length }}{% endfor %}", "0202"),
    ],
)
def test_a_string_literal_always_gives_its_own_text(source, expected):
    t = llamaprompt.ChatTemplate(source)
    assert [t.apply_template(HI) for _ in range(3)] == [expected] * 3


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # llama.cpp's `sameas` compares string values by address: each run of a literal makes a
        # value of its own, so the two runs' values are not the same object (upstream's engine);
        # the same value compared with itself is
        ("{% set ns = namespace(l=[]) %}{% for i in [1, 2] %}{% set ns.l = ns.l + ['a'] %}{% endfor %}"
         "{{ ns.l[0] is sameas ns.l[1] }}{{ ns.l[0] is sameas ns.l[0] }}", "FalseTrue"),
        # a test named by a computed string given to select
        ("{% set ns = namespace(l=[]) %}{% for i in [1, 2, 3] %}{% set ns.l = ns.l + ['a'] %}{% endfor %}"
         "{{ ns.l | select('same' ~ 'as', ns.l[1]) | list | length }}", "1"),
        # ... and reached by a computed subscript, naming neither select nor sameas (a session's
        # trial: why string literals are not shared between runs)
        ("{% set l = [] %}{% for i in range(2) %}{% set _ = l.append('x') %}{% endfor %}"
         "{{ l['sel' ~ 'ect']('same' ~ 'as', l[0]) | length }}", "1"),
    ],
    ids=["sameas", "select-computed", "subscript-computed"],
)
def test_runs_of_one_literal_are_different_objects_where_a_template_can_tell(source, expected):
    try:
        llamaprompt.ChatTemplate("{{ 'a' is sameas 'a' }}").apply_template(HI)
    except llamaprompt.TemplateError as e:  # 0.3.35's engine: "sameas test not implemented"
        pytest.skip(f"this tree's engine has no sameas test: {e}")
    t = llamaprompt.ChatTemplate(source)
    assert [t.apply_template(HI) for _ in range(3)] == [expected] * 3


def test_literals_of_a_freed_template_are_not_seen_by_the_next_one():
    # templates of the same shape made and freed in turn: their nodes come back at the same
    # addresses with other text
    for i in range(200):
        word = f"w{i % 7}" * (i % 3 + 1)
        t = llamaprompt.ChatTemplate("{% for m in messages %}{{ '" + word + "' }}{{ m.content }}{% endfor %}")
        assert t.apply_template(HI) == word + "hi"
        del t


def test_string_literals_on_two_threads():
    from concurrent.futures import ThreadPoolExecutor

    t = llamaprompt.ChatTemplate(
        "{% for m in messages %}{{ '<' ~ m.role ~ '>' }}{{ m.content }}{{ '</>' }}{% endfor %}"
    )
    requests = [{"messages": [{"role": "user", "content": str(i)}] * (i % 4 + 1)} for i in range(200)]
    expected = ["<user>" + str(i) + "</>" for i in range(200)]
    expected = [e * (i % 4 + 1) for i, e in enumerate(expected)]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(t.apply_template, requests)) == expected
    assert t.apply_template_many(requests, threads=2) == expected


# llama.cpp trims message contents for a template whose source holds this text (StepFun's,
# common_chat_templates_apply_jinja); the search of the source is kept per template (the
# source_finds rewrite). Two templates of the same length, made and freed in turn (the second
# comes back where the first was): each gets its own answer.
STEPFUN_MARKER = "You have access to the following functions in JSONSchema format"


def test_each_template_answers_its_own_source_searches():
    body = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    marked = "{#- " + STEPFUN_MARKER + " -#}" + body
    unmarked = marked.replace("JSONSchema", "JSONSchemb")
    request = {"messages": [{"role": "user", "content": "  hi  "}]}
    for _ in range(50):
        for source, expected in ((marked, "[hi]"), (unmarked, "[  hi  ]")):
            t = llamaprompt.ChatTemplate(source)
            assert [t.apply_template(request) for _ in range(2)] == [expected] * 2
            del t
