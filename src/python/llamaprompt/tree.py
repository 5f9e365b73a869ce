"""Which llama.cpp tree this module was built from, and what that tree has.

The build probes the tree it is given (third_party/adapt_tree.py, at configure time) and
compiles the bindings for what is there; this module reports the result:

- ``LLAMA_CPP_COMMIT`` -- the llama.cpp commit (from the lock for a llama-cpp-python sdist,
  from git for a checkout, ``"unknown"`` when neither says);
- ``LLAMA_CPP_SOURCE`` -- where the tree came from, e.g. ``"llama-cpp-python 0.3.35 sdist"``;
- ``features`` -- ``{name: present}`` for the upstream pieces that differ between trees;
- :func:`tree_info` -- the same with each feature's description, the rewrites applied or
  skipped and the configure notes;
- :func:`require` -- raise :class:`~llamaprompt.errors.FeatureError` when a feature is absent.
"""

from __future__ import annotations

import json
from typing import Any

from . import _core
from .errors import FeatureError

__all__ = ["LLAMA_CPP_COMMIT", "LLAMA_CPP_SOURCE", "features", "tree_info", "require"]

LLAMA_CPP_COMMIT: str = _core.LLAMA_CPP_COMMIT
LLAMA_CPP_SOURCE: str = _core.LLAMA_CPP_SOURCE

_INFO: dict[str, Any] = json.loads(_core.TREE_INFO_JSON)

#: ``{feature name: present}`` for the llama.cpp tree this module was built from.
features: dict[str, bool] = dict(_INFO["features"])


def tree_info() -> dict[str, Any]:
    """What the build found in its llama.cpp tree: ``commit``, ``source``, ``features``
    (name -> bool), ``feature_docs`` (name -> the upstream declaration it stands for),
    ``losses`` (the features whose absence means llamaprompt gives less on a tree; the others
    only say which shape of an upstream interface the bindings compile for),
    ``rewrites`` (each renamed call site: file, pattern, applied or skipped and what is
    lost), ``notes`` (the configure messages), ``tree_dir`` (the tree's folder when
    the module was built; it may be gone since) and ``caps_keys`` (the tree's
    chat_template_caps keys). A fresh dict each call."""
    info = json.loads(_core.TREE_INFO_JSON)
    info["commit"] = LLAMA_CPP_COMMIT
    info["source"] = LLAMA_CPP_SOURCE
    info["tree_dir"] = _core.LLAMA_CPP_DIR
    info["caps_keys"] = list(_core.CAPS_KEYS)
    return info


def require(feature: str, what: str, core: Any = None) -> None:
    """Raise FeatureError unless the tree has ``feature`` (``what``: the call that needs it;
    ``core``: the ``_core`` module or :class:`~llamaprompt.remote.RemoteCore` that will run
    it, default the in-process one)."""
    here = core is None or core is _core
    info = _INFO if here else json.loads(core.TREE_INFO_JSON)
    if not (features if here else info["features"]).get(feature, False):
        doc = info["feature_docs"].get(feature, feature)
        commit, source = (
            (LLAMA_CPP_COMMIT, LLAMA_CPP_SOURCE) if here else (core.LLAMA_CPP_COMMIT, core.LLAMA_CPP_SOURCE)
        )
        raise FeatureError(
            f"{what} is not available: the llama.cpp tree this module was built from "
            f"(commit {commit}, {source}) has no {doc}"
        )
