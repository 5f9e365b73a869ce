"""A ChatTemplate shared by many threads gives the same prompts as sequential calls."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import llamaprompt
from conftest import load_reference


def test_threads_give_sequential_prompts():
    ref = load_reference("apply_template.json")
    names = ["meta-llama-Llama-3.1-8B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "openai-gpt-oss-120b.jinja"]
    templates = [
        llamaprompt.ChatTemplate.from_file(
            llamaprompt.pinned_template(n), bos_token="<s>", eos_token="</s>", add_bos=True
        )
        for n in names
    ]
    requests = [r for k, r in ref["requests"].items() if not k.startswith("err_")]
    jobs = [(t, r) for t in templates for r in requests] * 4

    def render(job):
        t, r = job
        try:
            return t.apply_template(r)
        except llamaprompt.Error as e:
            return ("error", type(e).__name__, e.message)

    expected = [render(j) for j in jobs]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(render, jobs))
    assert got == expected
    assert sum(isinstance(x, str) for x in got) > len(jobs) // 2


def test_threads_on_a_template_whose_execution_changes_it():
    # older trees' Jinja execution changes the parsed template (filter_statement moves its filter
    # out of the node: concurrent renders crashed or raised "basic_string::substr"); renders of one
    # template are serialized there (llamaprompt.features["const_execution"] is False)
    t = llamaprompt.ChatTemplate(
        "{% for m in messages %}{% filter trim %}  <{{ m['role'] }}>{{ m['content'] }}  {% endfilter %}{% endfor %}"
    )
    reqs = [{"messages": [{"role": "user", "content": f"hello {i} " * 50}]} for i in range(16)]
    expected = [("<user>" + (f"hello {i} " * 50)).strip() for i in range(16)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(t.apply_template, reqs * 25))
    assert got == expected * 25
    assert t.apply_template_many(reqs * 10, threads=4) == expected * 10
