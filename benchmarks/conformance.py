"""A scoreboard of real chat-template renderers against llama-server: regenerates
docs/conformance.md (and docs/conformance.json).

    python benchmarks/conformance.py                 # every installed renderer
    python benchmarks/conformance.py --renderers jinja2 minijinja

The reference is llama-server's prompt for every pinned template x request of the recorded
reference set (../shared/reference/apply_template.json's requests and model tokens: BOS
``<s>``, EOS ``</s>``, add_bos), rendered with llamaprompt (byte-identical to the recording
for its 50 templates, as the test suite proves; the other 20 pinned templates are rendered the
same way). Each renderer (llamaprompt.renderers: transformers' render_jinja_template, Jinja2,
minijinja, @huggingface/jinja) gets each request as its users give it -- raw OpenAI messages,
tools, bos/eos, add_generation_prompt, chat_template_kwargs -- and its prompts go through
``llamaprompt diff --explain``: templates fully agreeing, cases agreeing, and the cause of
each difference, found by experiment with llama.cpp's own stages.

Install the renderers with ``pip install transformers jinja2 minijinja`` and
``npm install --prefix ~/.cache/llamaprompt/npm @huggingface/jinja``. Not run by CI.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections import Counter
from pathlib import Path

import llamaprompt
from llamaprompt import fixtures as fx
from llamaprompt.renderers import available_renderers, request_context

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "reference" / "apply_template.json"


def reference_doc(progress: bool) -> dict:
    recorded = json.loads(SHARED.read_text(encoding="utf-8"))
    tok = recorded["model_tokens"]
    templates = {
        p.name: llamaprompt.ChatTemplate.from_file(
            p,
            bos_token=tok["bos_token"],
            eos_token=tok["eos_token"],
            add_bos=tok["add_bos"],
            add_eos=tok["add_eos"],
            media_marker=recorded["media_marker"],
        )
        for p in llamaprompt.pinned_templates()
    }
    return fx.render_fixtures(templates, recorded["requests"], progress=progress)


def run_renderer(renderer, doc: dict) -> dict:
    jobs, keys = [], []
    for tname, entry in doc["templates"].items():
        for rname in entry["cases"]:
            request = doc["requests"][rname]
            source = entry["chat_template"]
            if request.get("tools") and entry.get("chat_template_tool_use"):
                source = entry["chat_template_tool_use"]  # as transformers picks the tool_use template
            jobs.append((source, request_context(request, entry["bos_token"], entry["eos_token"])))
            keys.append((tname, rname))
    other: dict = {}
    for (tname, rname), result in zip(keys, renderer.render_many(jobs)):
        other.setdefault(tname, {})[rname] = None if isinstance(result, Exception) else result
    return other


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--renderers", nargs="*", help="names (default: every installed one)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "conformance.md"))
    args = ap.parse_args(argv)
    renderers = available_renderers()
    if args.renderers:
        renderers = {k: v for k, v in renderers.items() if k in args.renderers}
    if not renderers:
        print("no renderer installed (pip install transformers jinja2 minijinja)", file=sys.stderr)
        return 2
    doc = reference_doc(progress=sys.stderr.isatty())
    results = {}
    for name, r in renderers.items():
        print(f"rendering with {name} {r.version} ...", file=sys.stderr)
        report = fx.diff_fixtures(doc, run_renderer(r, doc), explain=True, mask=False)
        cases = sum(t["compared"] for t in report["templates"].values())
        agree = sum(t["agree"] for t in report["templates"].values())
        per_template = {n: [t["agree"], t["compared"]] for n, t in report["templates"].items()}
        failed_cases = sum(
            1 for t in report["templates"].values() for d in t["differences"] if d.get("other_status") is None
        )
        prompt_diffs = [d for t in report["templates"].values() for d in t["differences"] if "causes" in d]
        explained = sum(1 for d in prompt_diffs if "unknown" not in d["causes"])
        bos_only = sum(1 for d in prompt_diffs if d["causes"] == ["leading BOS"])
        results[name] = {
            "version": r.version,
            "templates_agree": report["templates_agree"],
            "templates": report["templates_total"],
            "cases_agree": agree,
            "cases": cases,
            "rejected_where_llama_server_renders": failed_cases,
            "prompt_differences": len(prompt_diffs),
            "cases_agree_but_bos": agree + bos_only,
            "explained": explained,
            "causes": report.get("causes", {}),
            "per_template": per_template,
        }
    meta = {
        "generated_on": dt.date.today().isoformat(),
        "llama_cpp_commit": llamaprompt.LLAMA_CPP_COMMIT,
        "llamaprompt_version": llamaprompt.__version__,
        "requests": len(doc["requests"]),
    }
    Path(args.out).with_suffix(".json").write_text(
        json.dumps({"meta": meta, "renderers": results}, indent=1) + "\n", encoding="utf-8"
    )
    Path(args.out).write_text(markdown(meta, results), encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def markdown(meta: dict, results: dict) -> str:
    names = list(results)
    lines = [
        "# Conformance: real chat-template renderers against llama-server",
        "",
        f"Generated by `python benchmarks/conformance.py` on {meta['generated_on']} (llama.cpp "
        f"{meta['llama_cpp_commit']}, llamaprompt {meta['llamaprompt_version']}); do not edit by hand.",
        "",
        "Every pinned template x the request set of the reference recordings "
        f"(../shared/reference/apply_template.json, {meta['requests']} requests: chat shapes, tools, "
        "reasoning, prefill, media, and requests llama-server rejects), BOS `<s>` / EOS `</s>` with "
        "add_bos, as recorded. The reference prompts are llamaprompt's, which equal the recorded "
        "llama-server prompts for the 50 recorded templates (the test suite proves it); the other 20 "
        "pinned templates were not recorded and are rendered the same way. Each renderer gets a request "
        "as its users give it (raw OpenAI messages, tools, bos/eos, add_generation_prompt, "
        "chat_template_kwargs); its prompt is compared with llama-server's, and each difference's cause "
        "is found by experiment with llama.cpp's own stages (`llamaprompt diff --explain`, see "
        "llamaprompt/explain.py). A case agrees when the prompts are equal, or when both reject the "
        "request. Most differences start with a leading BOS: these renderers are given `bos_token` and "
        "print it, llama-server strips it because its tokenizer adds the token (add_bos); the column "
        '"... or differing only by the leading BOS" counts those as agreeing.',
        "",
        "| renderer | version | templates fully agreeing | cases agreeing | ... or differing only by the "
        "leading BOS | rejects where llama-server renders | prompt differences | with a cause found |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in names:
        r = results[n]
        share = 100 * r["explained"] // max(1, r["prompt_differences"])
        lines.append(
            f"| {n} | {r['version']} | {r['templates_agree']} of {r['templates']} | "
            f"{r['cases_agree']} of {r['cases']} | {r['cases_agree_but_bos']} | "
            f"{r['rejected_where_llama_server_renders']} | "
            f"{r['prompt_differences']} | {r['explained']} ({share} %) |"
        )
    lines += ["", "## Why they differ (causes of the prompt differences, by count)", ""]
    causes: Counter = Counter()
    for r in results.values():
        causes.update(r["causes"])
    order = [c for c, _ in causes.most_common()]
    lines += ["| cause | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in order:
        lines.append(f"| {c} | " + " | ".join(str(results[n]["causes"].get(c, 0)) for n in names) + " |")
    lines += [
        "",
        'A difference can have several causes (e.g. leading BOS and dates); "unknown" means no single '
        "experiment reproduced the renderer's prompt — an engine difference or several stages at once. "
        "What each cause means: docs/oracle.md and the docstring of llamaprompt/explain.py.",
        "",
        "## Per template (cases agreeing)",
        "",
        "| template | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    templates = next(iter(results.values()))["per_template"]
    for t in templates:
        cells = []
        for n in names:
            a, c = results[n]["per_template"][t]
            cells.append(f"{a}/{c}" + (" ✓" if a == c else ""))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
