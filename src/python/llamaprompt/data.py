"""Render (and tokenize) whole conversation datasets in batches.

    from llamaprompt.data import render_table
    out = render_table(template, table, messages="messages", tools="tools", tokens=False, threads=2)

Every prompt is what llama-server's POST /apply-template returns for the request built
from one row; one bad row never fails the batch (its ``error`` column holds llama.cpp's
message). Needs ``pyarrow`` (the ``datasets`` extra). Threads share one ChatTemplate (the
GIL is released while llama.cpp renders); worker processes each rebuild it from a pickle.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

from .errors import Error
from .template import ChatTemplate, map_on_threads

__all__ = [
    "render_table",
    "render_rows",
    "render_file",
    "as_arrow_table",
    "build_request",
    "RenderBatch",
    "FileSummary",
]

#: the llama-server flag that renders a final assistant turn closed (not as a prefill)
NO_PREFILL = "--no-prefill-assistant"


def _pa():
    try:
        import pyarrow as pa
    except ImportError as e:  # pragma: no cover - depends on the extra
        raise ImportError('llamaprompt.data needs pyarrow: pip install "llamaprompt[datasets]"') from e
    return pa


def as_arrow_table(data: Any):
    """A ``pyarrow.Table`` from a Table, RecordBatch, list of dicts, dict of columns, pandas or
    polars DataFrame, Hugging Face ``datasets.Dataset`` or anything with ``__arrow_c_stream__``.
    Raises TypeError for anything else."""
    pa = _pa()
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, list):
        return _table_from_rows(data)
    if isinstance(data, Mapping):
        try:
            return pa.table(dict(data))
        except UnicodeEncodeError:  # a lone surrogate: the cells as rows do (_json_text)
            columns = {k: list(v) for k, v in data.items()}
            n = max((len(v) for v in columns.values()), default=0)
            return _table_from_rows([{k: v[i] for k, v in columns.items() if i < len(v)} for i in range(n)])
    hf = getattr(data, "data", None)  # datasets.Dataset keeps an Arrow table in .data.table
    if hf is not None and isinstance(getattr(hf, "table", None), pa.Table):
        return hf.table
    if hasattr(data, "to_arrow"):  # polars
        return data.to_arrow()
    if type(data).__module__.startswith("pandas"):
        return _table_from_rows(data.to_dict("records"))
    if hasattr(data, "__arrow_c_stream__"):
        return pa.table(data)
    raise TypeError(f"cannot make an Arrow table from {type(data).__name__}")


def _table_from_rows(rows: list[Any]):
    """Rows (dicts) as columns: every key of every row (pyarrow's from_pylist would take the
    first row's keys only). Nested values (lists, dicts) travel as JSON text: an Arrow struct
    type is shared by all rows, which would reorder keys and add null fields (a tools schema
    would then render differently from the request)."""
    pa = _pa()
    keys: dict[str, None] = {}
    for row in rows:
        if not isinstance(row, Mapping):
            raise TypeError(f"rows must be mappings, not {type(row).__name__}")
        keys.update(dict.fromkeys(row))
    columns = {}
    for k in keys:
        values = [row.get(k) for row in rows]
        if any(isinstance(v, (list, dict)) for v in values) or not _arrow_ok(pa, values):
            columns[k] = pa.array([_json_text(v) for v in values], pa.string())
        else:
            columns[k] = pa.array(values)
    return pa.table(columns) if columns else pa.table({"messages": pa.array([], pa.string())})


def _arrow_ok(pa: Any, values: list[Any]) -> bool:
    try:
        pa.array(values)
        return True
    except (pa.ArrowInvalid, pa.ArrowTypeError, UnicodeEncodeError):
        return False


def _json_text(v: Any) -> str | None:
    """A cell as Arrow text: nested values as JSON text, text as it is. A lone surrogate, which
    UTF-8 (and so Arrow) cannot carry, is written as its ``\\u`` escape: llama.cpp's JSON parser
    then refuses that row with its message, as llama-server refuses such a body."""
    if v is None or (isinstance(v, float) and v != v):  # None, or pandas' NaN for a missing cell
        return None
    if not isinstance(v, str):
        return _json_dump(v)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", v)
    return v


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_dump(v: Any) -> str:
    """``v`` as JSON text that UTF-8 (and so Arrow) can carry: non-ASCII kept, unless ``v``
    holds a lone surrogate, which is then written as a ``\\u`` escape."""
    text = json.dumps(v, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(v)
    return text


def _drop_nulls(value: Any) -> Any:
    """Arrow gives every struct every field (absent -> null); JSON requests leave them out.
    Null-valued keys are dropped, except an assistant message's null content (a tool-call-only
    turn)."""
    if isinstance(value, dict):
        out = {k: _drop_nulls(v) for k, v in value.items() if v is not None}
        if value.get("role") == "assistant" and "content" in value and value["content"] is None:
            out["content"] = None
        return out
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _json_or_value(value: Any) -> Any:
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except RecursionError:
            raise ValueError("nested too deeply") from None
    return _drop_nulls(value)


def build_request(
    messages: Any, tools: Any = None, kwargs: Any = None, *, add_generation_prompt: bool | None = None
) -> dict[str, Any]:
    """The request body for one row: ``messages`` (list or JSON text), optional ``tools``
    (list or JSON text) and ``chat_template_kwargs`` (dict or JSON text);
    ``add_generation_prompt`` is set in the body unless None (llama-server's default: true)."""
    body: dict[str, Any] = {"messages": _json_or_value(messages)}
    if add_generation_prompt is not None:
        body["add_generation_prompt"] = bool(add_generation_prompt)
    if tools is not None:
        t = _json_or_value(tools)
        if t:
            body["tools"] = t
    if kwargs is not None:
        k = _json_or_value(kwargs)
        if k:
            body["chat_template_kwargs"] = k
    return body


def _render_one(template: ChatTemplate, body: Any, tokens: bool) -> tuple[str | None, str | None, list[int] | None]:
    try:
        if isinstance(body, Exception):
            raise body
        if tokens:
            prompt, toks = template.apply_template(body, tokens=True)
            return prompt, None, toks.tolist()
        return template.apply_template(body), None, None
    except (Error, ValueError, TypeError, RecursionError) as e:
        return None, getattr(e, "message", None) or str(e) or type(e).__name__, None


class OptionalColumn(str):
    """A column name that may be absent from a table (then: no value for any row)."""


def _bodies(table, messages: str, tools: str | None, kwargs: Any, add_generation_prompt: bool | None) -> list[Any]:
    cols = table.column_names
    if messages not in cols:
        raise KeyError(f"no column {messages!r} (columns: {', '.join(cols)})")
    msgs = table.column(messages).to_pylist()
    tls = table.column(tools).to_pylist() if tools and tools in cols else [None] * len(msgs)
    if isinstance(kwargs, OptionalColumn):  # render_file's: absent from some inputs
        kws = table.column(kwargs).to_pylist() if kwargs in cols else [None] * len(msgs)
    elif isinstance(kwargs, str):  # a column name: a typo must not silently drop the kwargs
        if kwargs not in cols:
            raise KeyError(f"no kwargs column {kwargs!r} (columns: {', '.join(cols)})")
        kws = table.column(kwargs).to_pylist()
    elif kwargs is None or isinstance(kwargs, Mapping):
        kws = [kwargs] * len(msgs)
    else:
        raise TypeError(f"kwargs must be a dict, a column name or None, not {type(kwargs).__name__}")
    out: list[Any] = []
    for m, t, k in zip(msgs, tls, kws):
        try:
            out.append(build_request(m, t, k, add_generation_prompt=add_generation_prompt))
        except (ValueError, TypeError) as e:  # a row whose JSON text is broken
            out.append(ValueError(f"bad row: {e}"))
    return out


def training_template(template: ChatTemplate) -> ChatTemplate:
    """``template`` as llama-server with ``--no-prefill-assistant``: a conversation that ends
    with an assistant message is rendered with that turn closed (its end-of-turn text), not
    as a prefill for the model to continue (llama-server's default). ``template`` itself when
    it already has the flag."""
    return template.with_server_args(NO_PREFILL)


def render_rows(
    template: ChatTemplate, bodies: list[Any], *, tokens: bool = False, threads: int | None = None
) -> list[tuple[str | None, str | None, list[int] | None]]:
    """(prompt, error, tokens) for each request body, in order; ``threads`` > 1 renders on
    ``threads`` Python threads sharing ``template`` (a Ctrl-C drops the rows not started)."""
    if tokens and template.gguf_path is None:
        raise TypeError("tokens=True needs a GGUF-backed template (ChatTemplate.from_gguf)")
    if threads and threads > 1 and len(bodies) > 1:
        lib = getattr(template, "_lib", None)  # (its renders in progress stop on a Ctrl-C)
        return map_on_threads(lambda b: _render_one(template, b, tokens), list(bodies), threads, lib)
    return [_render_one(template, b, tokens) for b in bodies]


def render_table(
    template: ChatTemplate,
    table: Any,
    *,
    messages: str = "messages",
    tools: str | None = "tools",
    kwargs: Any = None,
    tokens: bool = False,
    threads: int | None = None,
    training: bool = False,
):
    """Render every row of a conversation table.

    Args:
        template: the ChatTemplate (a GGUF-backed one for ``tokens``).
        table: rows holding OpenAI-form conversations (see :func:`as_arrow_table`).
        messages: column of messages (list of message structs, or JSON text).
        tools: column of tools lists (optional; missing column -> no tools).
        kwargs: ``chat_template_kwargs`` for every row (a dict), or the name of a column
            (dicts or JSON text; KeyError when the table has no such column).
        tokens: add a ``tokens`` column (list<int32>): the prompt tokenized as llama-server
            feeds it to the model (``add_special=True``).
        threads: render with this many threads (default: one).
        training: render fine-tuning text: every row with ``add_generation_prompt: false``,
            by :func:`training_template` (``--no-prefill-assistant``), so a conversation
            ending in an assistant turn ends with that turn closed. Default (False): as
            llama-server serves the rows -- a generation prompt is added, and a final
            assistant message is an open prefill without its end-of-turn text.

    Returns:
        a ``pyarrow.Table``: the input columns plus ``prompt`` (string, null on error),
        ``error`` (null, or llama.cpp's message) and optionally ``tokens``.
    """
    pa = _pa()
    tbl = as_arrow_table(table)
    # output columns replace same-named input columns (a re-render of an earlier output)
    for name in ("prompt", "error", "tokens"):
        if name in tbl.column_names:
            tbl = tbl.drop_columns([name])
    if training:
        template = training_template(template)
    bodies = _bodies(tbl, messages, tools, kwargs, False if training else None)
    results = render_rows(template, bodies, tokens=tokens, threads=threads)
    tbl = tbl.append_column("prompt", pa.array([r[0] for r in results], pa.string()))
    tbl = tbl.append_column("error", pa.array([r[1] for r in results], pa.string()))
    if tokens:
        tbl = tbl.append_column("tokens", pa.array([r[2] for r in results], pa.list_(pa.int32())))
    return tbl


class RenderBatch:
    """A picklable callable ``batch -> batch`` (pyarrow Table/RecordBatch in and out) for
    worker processes and Ray's ``map_batches``: one ChatTemplate per worker."""

    def __init__(self, template: ChatTemplate, **options: Any) -> None:
        self.template = template
        self.options = options

    def __call__(self, batch: Any):
        return render_table(self.template, batch, **self.options)


# ---------------------------------------------------------------------------------------
# files (the render-dataset command): streaming, bounded memory


def _iter_input(path: str, batch_rows: int) -> Iterator[Any]:
    """Batches of an input file as Arrow tables: parquet by row groups, JSONL by lines
    (each JSONL record keeps its original text in a ``record`` column)."""
    pa = _pa()
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as f:
            for batch in f.iter_batches(batch_size=batch_rows):
                yield pa.Table.from_batches([batch])
        return
    rows: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                messages = _json_dump(rec.get("messages")) if isinstance(rec, dict) else None
                tools = rec.get("tools") if isinstance(rec, dict) else None
                kw = rec.get("chat_template_kwargs") if isinstance(rec, dict) else None
            except ValueError:
                messages = line.decode("utf-8", "replace")  # rendered as broken JSON: an error row
                tools = kw = None
            rows.append(
                {
                    "record": line.decode("utf-8", "replace").rstrip("\n"),
                    "messages": messages,
                    "tools": _json_dump(tools) if tools is not None else None,
                    "chat_template_kwargs": _json_dump(kw) if kw is not None else None,
                }
            )
            if len(rows) >= batch_rows:
                yield pa.Table.from_pylist(rows, schema=_JSONL_SCHEMA())
                rows = []
    if rows:
        yield pa.Table.from_pylist(rows, schema=_JSONL_SCHEMA())


def _JSONL_SCHEMA():  # noqa: N802 - a constant built lazily (pyarrow is optional)
    pa = _pa()
    return pa.schema(
        [
            ("record", pa.string()),
            ("messages", pa.string()),
            ("tools", pa.string()),
            ("chat_template_kwargs", pa.string()),
        ]
    )


def _bounded_map(pool: Any, items: Iterable[Any], window: int) -> Iterator[Any]:
    """pool.map in order, with at most ``window`` items in flight (bounded memory)."""
    from collections import deque

    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(_run_worker, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


_worker: RenderBatch | None = None


def _init_worker(fn: RenderBatch) -> None:
    global _worker
    _worker = fn


def _run_worker(table: Any):
    assert _worker is not None
    return _worker(table)


class FileSummary(NamedTuple):
    """What :func:`render_file` wrote."""

    #: rows written
    rows: int
    #: rows whose ``error`` is set (llama.cpp refused the request or the template raised)
    failed: int
    #: the first failed rows, as (row number from 0, llama.cpp's message)
    first_errors: list[tuple[int, str]]


def render_file(
    template: ChatTemplate,
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    tokens: bool = False,
    workers: int = 1,
    batch_rows: int = 2048,
    progress: bool | None = None,
    use_ray: bool = False,
    training: bool = False,
    keep_errors: int = 5,
) -> FileSummary:
    """Render ``src`` (``.jsonl`` or ``.parquet``) into ``dst`` (parquet), streaming in
    batches so memory stays bounded.

    ``workers`` > 1 uses worker processes; ``use_ray`` runs the batches on Ray Data instead
    (:func:`llamaprompt.ray.render_dataset`; a Parquet input is read by Ray's own reader).
    ``progress``: a tqdm bar on stderr (default: when stderr is a terminal); False also turns
    off Ray Data's progress output. ``training`` as for :func:`render_table`.

    Returns a :class:`FileSummary`: rows written, rows failed and the first ``keep_errors``
    failures. Raises OSError for unreadable files, ImportError without pyarrow (or ray).
    """
    import sys

    import pyarrow.parquet as pq

    src, dst = os.fspath(src), os.fspath(dst)
    kwargs_col = OptionalColumn("chat_template_kwargs")  # a Parquet input may not have it
    options: dict[str, Any] = {"tokens": tokens, "kwargs": kwargs_col, "training": training}
    fn = RenderBatch(template, **options)
    show = sys.stderr.isatty() if progress is None else progress
    batches = _iter_input(src, batch_rows)
    pool = None
    if use_ray:
        import ray.data

        from .ray import render_dataset

        if not show:
            ray.data.DataContext.get_current().enable_progress_bars = False
        # JSONL rows keep their line in "record" (and broken lines become error rows), as without Ray
        ds = ray.data.read_parquet(src) if src.endswith(".parquet") else ray.data.from_arrow(list(batches))
        out_ds = render_dataset(ds, template, workers=max(1, workers), **options)
        results: Iterable[Any] = out_ds.iter_batches(batch_format="pyarrow", batch_size=None)
    elif workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, initargs=(fn,))
        results = _bounded_map(pool, batches, window=2 * workers)
    else:
        results = map(fn, batches)
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(desc="render", unit="row", file=sys.stderr)
    writer = None
    rows = failed = 0
    first: list[tuple[int, str]] = []
    try:
        for out in results:
            if writer is None:
                writer = pq.ParquetWriter(dst, out.schema)
            writer.write_table(out)
            errors = out.column("error")
            n_failed = len(errors) - errors.null_count
            if n_failed and len(first) < keep_errors:
                for i, e in enumerate(errors.to_pylist()):
                    if e is not None and len(first) < keep_errors:
                        first.append((rows + i, e))
            failed += n_failed
            rows += out.num_rows
            if bar is not None:
                bar.update(out.num_rows)
        if writer is None:  # empty input
            empty = render_table(template, _JSONL_SCHEMA().empty_table(), **options)
            pq.write_table(empty, dst)
    finally:
        if writer is not None:
            writer.close()
        if pool is not None:
            pool.shutdown()
        if bar is not None:
            bar.close()
    return FileSummary(rows, failed, first)
