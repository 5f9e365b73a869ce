"""Ray Data integration: the same per-batch rendering as llamaprompt.data, scaled by Ray.

    import ray
    from llamaprompt.ray import render_dataset
    out = render_dataset(ray.data.read_parquet("conversations/"), template, tokens=False)

Needs the ``ray`` extra (``pip install "llamaprompt[ray]"``).
"""

from __future__ import annotations

import os
from typing import Any

from .data import RenderBatch
from .template import ChatTemplate

__all__ = ["render_dataset"]


def render_dataset(
    ds: Any, template: ChatTemplate, *, workers: int | None = None, batch_size: int | None = 1024, **options: Any
):
    """``ds.map_batches`` with one ChatTemplate per worker (an actor pool; the template is
    pickled once per actor and rebuilt there).

    Args:
        ds: a ``ray.data.Dataset`` whose rows hold conversations.
        template: the ChatTemplate (picklable: rebuilt from its source or GGUF path).
        workers: actor pool size (default: Ray's choice, up to the cluster's CPUs).
        batch_size: rows per batch.
        options: as :func:`llamaprompt.data.render_table` (messages, tools, kwargs, tokens, threads).

    Returns the lazily rendered ``ray.data.Dataset`` (input columns + prompt, error[, tokens]).
    """
    concurrency = workers if workers else max(1, os.cpu_count() or 1)
    return ds.map_batches(
        RenderBatch,
        fn_constructor_args=(template,),
        fn_constructor_kwargs=options,
        batch_format="pyarrow",
        batch_size=batch_size,
        concurrency=concurrency,
    )
