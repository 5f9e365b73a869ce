"""llamaprompt: llama.cpp's own chat-template code, importable from Python.

Get exactly the prompt llama-server's ``POST /apply-template`` returns, the
``chat_template_caps`` its ``GET /props`` reports and the messages its templates
receive -- with no model weights, no server and no GPU.

    >>> import llamaprompt
    >>> t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"))
    >>> t.apply_template({"messages": [{"role": "user", "content": "Hello"}]})
    '<|im_start|>user\\nHello<|im_end|>\\n<|im_start|>assistant\\n'
"""

import logging as _logging

from . import cores as _cores

_cores.load_from_env()  # LLAMAPROMPT_CORE: another core as the in-process one (before any use of _core)

# isort: split
from ._version import __version__
from .errors import CoreError, Error, FeatureError, GGUFError, RequestError, ServerArgsError, TemplateError
from .gguf import gguf_metadata
from .hf import apply_chat_template
from .hooks import register_hook, registered_hooks, unregister_hook
from .legacy import builtin_template_names, llama_chat_apply_template
from .options import DEFAULT_MEDIA_MARKER
from .params import ChatParams
from .pinned import pinned_template, pinned_templates
from .template import ChatTemplate, PromptTokens
from .tree import LLAMA_CPP_COMMIT, LLAMA_CPP_SOURCE, features, tree_info

# llama.cpp's log lines reach logging.getLogger("llamaprompt.llama_cpp"); silent unless the
# application configures logging (the library convention: a NullHandler on our logger)
_logging.getLogger("llamaprompt").addHandler(_logging.NullHandler())

__all__ = [
    "LLAMA_CPP_COMMIT",
    "LLAMA_CPP_SOURCE",
    "features",
    "tree_info",
    "FeatureError",
    "CoreError",
    "__version__",
    "ChatTemplate",
    "ChatParams",
    "PromptTokens",
    "apply_chat_template",
    "DEFAULT_MEDIA_MARKER",
    "Error",
    "RequestError",
    "TemplateError",
    "ServerArgsError",
    "GGUFError",
    "gguf_metadata",
    "builtin_template_names",
    "llama_chat_apply_template",
    "register_hook",
    "unregister_hook",
    "registered_hooks",
    "pinned_template",
    "pinned_templates",
]
