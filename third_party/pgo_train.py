"""The training run of the profile-guided build (CMakeLists.txt, LLAMAPROMPT_PGO).

Run by the build, with the build's Python, between its two compiles of the files a request runs:
it loads the instrumented twin of the module (``_core`` compiled with ``-fprofile-generate``),
renders every template of the tree's models/templates with the request set llamaprompt ships
(resources/requests.json), and lets the module write its profile at exit: ``.gcda`` files, one
per source file, named by the build after the source, the same for the twins and for ``_core``
and llama-common, which GCC compiles next with ``-fprofile-use``. Renders only: training the chat
parameters' grammar generation as well made the renders ~2% slower, and what is not trained is
optimized as without a profile.

Only what a build environment has is used: the standard library, the instrumented module and the
one file of the package the module imports (llamaprompt/errors.py; the package's __init__ needs
numpy). A request a template refuses is part of the training (llama.cpp's error paths run too);
the run fails (exit status 1, one line saying why) when an input is missing or unreadable, when
the module cannot be loaded, renders nothing, or writes no profile. PROFILE_DIR is the directory
the module was compiled with (-fprofile-generate=PROFILE_DIR, where it writes): the run deletes
an earlier profile there first and counts the new one.

Usage: pgo_train.py MODULE PACKAGE_DIR TEMPLATES_DIR REQUESTS_JSON PROFILE_DIR
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
import types
from pathlib import Path

ROUNDS = 2  # renders per template x request (the profile's counts, not its shape, grow with it)


def _train(module_path: str, package_dir: str, templates_dir: str, requests_json: str) -> None:
    """In the child process: load the twin as ``_core`` and run the requests."""
    # the module imports llamaprompt.errors (its exception classes) and nothing else of the
    # package: a bare package object whose path is the source's, without its __init__
    package = types.ModuleType("llamaprompt")
    package.__path__ = [package_dir]
    sys.modules["llamaprompt"] = package
    logging.disable(logging.CRITICAL)  # llama.cpp's log (routed to Python's logging) says nothing here
    spec = importlib.util.spec_from_file_location("_core", module_path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"pgo_train: cannot load {module_path}")
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    requests = json.loads(Path(requests_json).read_text(encoding="utf-8"))
    # as the package passes them: dicts (the core builds llama.cpp's JSON tree from their values)
    bodies = list(requests.values())

    def encode(request: object) -> bytes:  # the package's request_body, for what a tree cannot hold
        return json.dumps(request).encode()

    templates = sorted(Path(templates_dir).glob("*.jinja"))
    rendered = refused = 0
    for path in templates:
        try:
            tmpl = core.Template(
                source=path.read_bytes(), bos_token=b"<s>", eos_token=b"</s>", add_bos=False, add_eos=False,
                server_args=[], media_marker=b"<__media__>", fetch_remote_media=False, caps={},
                skip_specialized=False, fast_path=True, timeout=10.0, max_output_bytes=1 << 26, max_tools=4096,
            )
        except Exception:  # a template llama.cpp refuses: its error path is trained too
            refused += 1
            continue
        for body in bodies:
            for _ in range(ROUNDS):
                try:
                    tmpl.apply_template(body, 10.0, encode=encode)
                    rendered += 1
                except Exception:
                    refused += 1
    print(f"pgo_train: {len(templates)} templates x {len(bodies)} requests: "
          f"{rendered} renders, {refused} refused")
    if rendered == 0:
        raise SystemExit("pgo_train: nothing rendered; the instrumented module does not work")


def _inputs(templates_dir: str, requests_json: str) -> str | None:
    """What is wrong with the training's inputs, or None."""
    if not any(Path(templates_dir).glob("*.jinja")):
        return f"no *.jinja template in {templates_dir}"
    try:
        requests = json.loads(Path(requests_json).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"cannot read the requests {requests_json}: {e}"
    if not isinstance(requests, dict) or not requests or not all(isinstance(r, dict) for r in requests.values()):
        return f"{requests_json} is not a non-empty JSON object of request objects"
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[0] == "--child":
        _train(*argv[1:])
        return 0
    if len(argv) != 5:
        print(f"pgo_train: expected 5 arguments, got {len(argv)}", file=sys.stderr)
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    module, package, templates, requests, profile_dir = argv
    wrong = _inputs(templates, requests)
    if wrong is None and not Path(module).is_file():
        wrong = f"no module {module}"
    if wrong is None and not (Path(package) / "errors.py").is_file():
        wrong = f"no llamaprompt package (errors.py) in {package}"
    if wrong is not None:
        print(f"pgo_train: {wrong}", file=sys.stderr)
        return 1
    profile = Path(profile_dir)
    for old in profile.glob("*.gcda"):  # the profile of an earlier build
        old.unlink()
    # a child process: the module writes its profile when its process exits
    rc = subprocess.call([sys.executable, __file__, "--child", module, package, templates, requests])
    if rc != 0:
        print(f"pgo_train: the training run failed (exit status {rc}); LLAMAPROMPT_PGO=OFF builds without it",
              file=sys.stderr)
        return 1
    written = len(list(profile.glob("*.gcda")))
    if written == 0:
        print(f"pgo_train: the training run wrote no profile under {profile} (the directory the module was "
              "compiled with, -fprofile-generate=DIR); LLAMAPROMPT_PGO=OFF builds without it", file=sys.stderr)
        return 1
    print(f"pgo_train: profiles of {written} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
