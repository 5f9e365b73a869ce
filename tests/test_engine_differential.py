"""The differential run's harness (tests/engine_differential.py; .ci/run runs it against a
module built with LLAMAPROMPT_ENGINE_REWRITES=OFF): its cases are fixed by a seed, budget
errors are compared by kind, and it refuses a reference that is not the unmodified engine."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine_differential as ed
import llamaprompt


def test_generated_requests_are_seeded_and_varied():
    a, b = ed.generated_requests(60), ed.generated_requests(60)
    assert a == b and len(a) == 60
    assert ed.generated_requests(60, seed=1) != a
    roles = {m["role"] for r in a.values() for m in r["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert any("tools" in r for r in a.values()) and any(r.get("add_generation_prompt") is False for r in a.values())
    assert any(isinstance(m.get("content"), list) for r in a.values() for m in r["messages"])


def test_mutants_are_seeded():
    names = [n for n, _, _ in ed.cases(0, 5)][-5:]
    again = [(n, s) for n, s, _ in ed.cases(0, 5)][-5:]
    assert names == [n for n, _ in again] and all(n.startswith("mutant_") for n in names)
    assert [s for _, s, _ in list(ed.cases(0, 5))[-5:]] == [s for _, s in again]


def test_outcomes_on_either_side_of_midnight_are_the_same():
    # the date llama.cpp gives a template (chat.cpp: "%d %b %Y" and "%b %d %Y") and the dates the
    # pinned templates print with strftime_now, on two days: the same digest; any other text differs
    def outcome(day: str, month: str) -> dict[str, object]:
        return {
            "prompt": f"Cutting Knowledge Date: December 2023\nToday Date: {day} {month} 2026\n\nHi",
            "inputs": {"date_string": f"{month} {day} 2026", "iso": f"2026-12-{day}"},
        }

    assert ed._digest(outcome("06", "Dec")) == ed._digest(outcome("07", "Dec"))
    assert ed._digest({"prompt": "December 06, 2026"}) == ed._digest({"prompt": "January 01, 2027"})
    assert ed._digest(outcome("06", "Dec")) != ed._digest({**outcome("06", "Dec"), "prompt": "Hi"})
    assert ed._digest({"prompt": "2026-12-06 at 10:00"}) != ed._digest({"prompt": "2026-12-06 at 11:00"})


def test_budget_errors_are_compared_by_kind_only():
    def recursion():
        raise llamaprompt.TemplateError(
            "While executing Identifier at line 3 ...\n"
            "Error: template nested too deeply (half of the thread's stack, or 8 MiB, used)",
            500,
        )

    def other():
        raise llamaprompt.TemplateError("While executing Identifier at line 3 ...\nError: unknown filter", 500)

    assert ed._outcome(recursion) == {"error": "TemplateError", "status": 500, "budget": ed.BUDGET_MARKS[1]}
    assert "budget" not in ed._outcome(other) and "unknown filter" in ed._outcome(other)["message"]
    assert ed._outcome(lambda: "prompt") == {"ok": "prompt"}


def test_a_reference_with_the_rewrites_is_refused():
    applied = [r for r in llamaprompt.tree_info()["rewrites"] if r.get("engine") and r["applied"]]
    if not applied:
        pytest.skip("this build has no engine rewrite applied (LLAMAPROMPT_ENGINE_REWRITES=OFF or another tree)")
    so = next(Path(llamaprompt.__file__).parent.glob("_core*.so"))
    with pytest.raises(SystemExit, match="LLAMAPROMPT_ENGINE_REWRITES=OFF"):
        ed.compare(so, 0, 0)


def test_a_race_between_budgets_is_not_a_difference():
    # the fuzz mutant with `{% for i in range(100000000) %}`: the size budget stops it after a
    # few seconds, the 5 s time budget first on a loaded machine -- which one fires is speed
    def raising(message):
        def fn():
            raise llamaprompt.TemplateError("While executing CallExpression ...\nError: " + message, 500)

        return fn

    timed_out = ed._outcome(raising("template execution exceeded the time budget (5.0 s)"))
    too_big = ed._outcome(raising("template execution exceeded the size budget (a value of 67239888 bytes ...)"))
    too_deep = ed._outcome(raising("template nested too deeply (half of the thread's stack, or 8 MiB, used)"))
    wrong = ed._outcome(raising("unknown filter"))
    assert ed._stopped_by([timed_out]) == ["time"] and ed._stopped_by([too_big]) == ["size"]
    assert ed._stopped_by([too_deep, too_big, {"ok": "x"}]) == ["size", "stack"] and ed._stopped_by([wrong]) == []
    assert ed._budget_race(["time"], ["size"]) and ed._budget_race(["stack"], ["time"])
    # not a race: a budget on one side only, or two deterministic budgets
    assert not ed._budget_race(["time"], []) and not ed._budget_race([], ["time"])
    assert not ed._budget_race(["size"], ["stack"])
