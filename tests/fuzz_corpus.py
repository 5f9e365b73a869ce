"""The template fuzz corpus: edits that turn a real template into a broken or hostile one
(unbalanced tags, unbounded recursion and loops, huge values, invalid UTF-8, truncations).
Used by tests/test_fuzz.py (edits drawn by hypothesis) and tests/engine_differential.py
(edits drawn from a seeded random generator)."""

from __future__ import annotations

import random
from collections.abc import Iterable

KINDS = ("insert", "delete", "truncate", "bytes")

SNIPPETS = [
    b"{{",
    b"}}",
    b"{%",
    b"%}",
    b"{% endfor %}",
    b"{% endif %}",
    b"{% for m in messages %}",
    b"{% if x %}",
    b"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    b"{{ 'ab' * 100000000 }}",
    b"{% for i in range(100000000) %}{% endfor %}",
    b"{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    b"{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    b"{{ messages[1000] }}",
    b"{{ raise_exception('fuzz') }}",
    b"{{ messages|tojson }}",
    b"{{ none.x.y }}",
    b"{{ 1 / 0 }}",
    b"{{ tools|map(attribute='x')|list }}",
    b"{{ (messages|length) * 99999999999 }}",
    # `loop` kept past its iteration, added to, rebound; an earlier iteration's read back
    # (the loop-object engine rewrite: tests/test_engine_rewrites.py)
    b"{% set kept = loop %}",
    b"{% set loop.extra = loop.index %}",
    b"{% set loop = 0 %}",
    b"{{ kept.index if kept is defined }}{{ loop.extra if loop.extra is defined }}",
    # a call block's `caller` kept and called after its variables changed (here, or in a later
    # iteration), a loop's `else` block setting a variable (the scope_chain engine rewrite)
    b"{% set ns_k = namespace(f=none) %}{% macro keep() %}{% set ns_k.f = caller %}{% endmacro %}{% set sx = 1 %}"
    b"{% call keep() %}{{ sx }}{{ loop.index if loop is defined }}{{ message is defined }}{% endcall %}"
    b"{% set sx = 2 %}",
    b"{{ ns_k.f() if ns_k is defined and ns_k.f }}{{ sx if sx is defined }}",
    b"{% for q in [] %}{% else %}{% set sx = 3 %}{% endfor %}",
    # one string literal run twice, its values compared as objects (`sameas`: by address), by name
    # and by a computed test name (a dropped rewrite that shared literal values: docs/performance.md)
    b"{% set ns_s = namespace(l=[]) %}{% for q in [1, 2] %}{% set ns_s.l = ns_s.l + ['lit'] %}{% endfor %}"
    b"{{ ns_s.l[0] is sameas ns_s.l[1] }}{{ ns_s.l|select('same' ~ 'as', ns_s.l[0])|list|length }}",
    b"\x00",
    b"\xff\xfe",
    b"\xc3",
    b"{{ '\xe2\x82' }}",
]


# (kind, where in [0, 1], snippet index, raw bytes)
Edit = tuple[str, float, int, bytes]


def mutate_template(src: bytes, ops: Iterable[Edit]) -> bytes:
    """``src`` with each edit applied in turn."""
    for kind, where, snippet, raw in ops:
        at = int(where * len(src))
        if kind == "insert":  # after a tag or an output, so that the result often still parses
            ends = [i + 2 for i in range(len(src) - 1) if src[i : i + 2] in (b"%}", b"}}")] or [at]
            at = ends[min(int(where * len(ends)), len(ends) - 1)]
            src = src[:at] + SNIPPETS[snippet] + src[at:]
        elif kind == "delete":
            src = src[:at] + src[at + 1 + snippet * 7 :]
        elif kind == "truncate":
            src = src[:at]
        else:
            src = src[:at] + raw + src[at:]
    return src


def random_edits(rng: random.Random, max_edits: int = 3) -> list[Edit]:
    """1..max_edits edits drawn from ``rng`` (the same seed gives the same edits)."""
    return [
        (rng.choice(KINDS), rng.random(), rng.randrange(len(SNIPPETS)), rng.randbytes(rng.randint(1, 8)))
        for _ in range(rng.randint(1, max_edits))
    ]
