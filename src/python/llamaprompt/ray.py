"""Ray Data integration: the same per-batch rendering as llamaprompt.data, scaled by Ray.

    import ray
    from llamaprompt.ray import render_dataset
    out = render_dataset(ray.data.read_parquet("conversations/"), template, tokens=False)

Needs the ``ray`` extra (``pip install "llamaprompt[ray]"``).
"""

from __future__ import annotations

import math
from typing import Any

from .data import RenderBatch
from .template import ChatTemplate

__all__ = ["render_dataset", "actor_cpus"]


def actor_cpus(workers: int, cluster_cpus: float) -> float:
    """The CPUs each render actor asks Ray for: ``workers`` actors together leave one CPU of
    the cluster free (at most one each, at least 0.05) so that Ray Data's read and write
    tasks can always be scheduled. With every CPU taken by actors, the read task waits for
    a CPU that never frees and the pipeline never finishes."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    spare = max(0.0, float(cluster_cpus) - 1.0)
    return max(0.05, min(1.0, math.floor(100 * spare / workers) / 100))


def render_dataset(
    ds: Any, template: ChatTemplate, *, workers: int | None = None, batch_size: int | None = 1024, **options: Any
):
    """``ds.map_batches`` with one ChatTemplate per actor of a fixed-size actor pool
    (``ray.data.ActorPoolStrategy``; the template is pickled once per actor and rebuilt there).

    Each actor asks for :func:`actor_cpus` CPUs, so the pool never takes the CPUs Ray Data's
    read and write tasks need, whatever the cluster size.

    Args:
        ds: a ``ray.data.Dataset`` whose rows hold conversations.
        template: the ChatTemplate (picklable: rebuilt from its source or GGUF path).
        workers: actor pool size (default: the cluster's CPUs minus one, at least one).
        batch_size: rows per batch.
        options: as :func:`llamaprompt.data.render_table` (messages, tools, kwargs, tokens, threads,
            training).

    Returns the lazily rendered ``ray.data.Dataset`` (input columns + prompt, error[, tokens]).
    Raises ValueError for ``workers`` < 1, TypeError for ``tokens=True`` without a GGUF file. Ray's progress bars follow
    ``ray.data.DataContext.get_current().enable_progress_bars``.
    """
    if options.get("tokens") and template.gguf_path is None:  # here, not later inside an actor
        raise TypeError("tokens=True needs a GGUF-backed template (ChatTemplate.from_gguf)")
    import ray
    import ray.data

    if not ray.is_initialized():
        ray.init()
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    size = workers if workers is not None else max(1, int(cpus) - 1)
    return ds.map_batches(
        RenderBatch,
        fn_constructor_args=(template,),
        fn_constructor_kwargs=options,
        batch_format="pyarrow",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=size),
        num_cpus=actor_cpus(size, cpus),
    )
