"""Cores for other llama.cpp trees side by side: building, finding, rendering in a worker,
and diff-versions checked against the difference of two llama-server recordings.

The tests that need another core use the one for llama-cpp-python 0.3.35's tree
(``llamaprompt cores add 0.3.35``); they skip without it, and fail instead when
LLAMAPROMPT_REQUIRE_CORES lists it (CI builds it first)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llamaprompt
from conftest import (
    DATE_FORMATS,
    REPO,
    interrupt_next_receive,
    mask_dates,
    reference_template,
    run_forking_script,
    shared_reference_dir,
    template_path,
)
from llamaprompt import _core, cores
from llamaprompt.cli import main
from llamaprompt.versions import diff_versions, file_templates

OTHER = "0.3.35"
OTHER_COMMIT = "4df29be4f"
PIN_COMMIT = "0c1e57098"


def _require_core(name: str) -> cores.Core:
    try:
        return cores.find_core(name)
    except llamaprompt.CoreError as e:
        required = os.environ.get("LLAMAPROMPT_REQUIRE_CORES", "").split(",")
        if name in required:
            pytest.fail(f"core {name} is required (LLAMAPROMPT_REQUIRE_CORES): {e}", pytrace=False)
        pytest.skip(f"no core for llama.cpp {name}: build it with `llamaprompt cores add {name}`")


@pytest.fixture(scope="module")
def other_core() -> cores.Core:
    if llamaprompt.LLAMA_CPP_COMMIT != PIN_COMMIT:
        pytest.skip("the side-by-side tests run on a build of the pinned tree")
    core = _require_core(OTHER)
    assert not core.builtin and core.commit == OTHER_COMMIT
    return core


def _reference(folder: Path, name: str) -> dict:
    path = folder / name
    if not path.is_file():
        if os.environ.get("LLAMAPROMPT_REQUIRE_REFERENCE", "") not in ("", "0"):
            pytest.fail(f"{path} is missing (LLAMAPROMPT_REQUIRE_REFERENCE is set)", pytrace=False)
        pytest.skip(f"{path} is missing")
    return json.loads(path.read_text(encoding="utf-8"))


# -- without another core -------------------------------------------------------------------


def test_source_hash_is_the_builds():
    # the digest CMake compiled into the module, recomputed in Python from the same files
    if Path(_core.SOURCE_DIR).resolve() != REPO.resolve():
        pytest.skip("the module was built from another checkout")
    assert cores.source_hash(REPO) == _core.SOURCE_HASH
    assert len(_core.SOURCE_HASH) == 64


def test_a_core_built_by_another_python_is_not_usable(tmp_path, monkeypatch):
    # the per-user cache is shared by every Python: a core whose module has another ABI tag does
    # not load here, and naming it says so (session 55: a 3.9 interpreter got "the worker process
    # ... died (exit code 1)" for a core built by 3.11)
    import importlib.machinery

    here = importlib.machinery.EXTENSION_SUFFIXES[0]
    other = ".cpython-27-x86_64-linux-gnu.so" if "cpython-27" not in here else ".cpython-399-x86_64-linux-gnu.so"
    monkeypatch.setenv("LLAMAPROMPT_CACHE_DIR", str(tmp_path))
    folder = cores.cores_dir() / "abcdef123"
    folder.mkdir(parents=True)
    meta = {"name": "9.9.9", "commit": "abcdef123", "source": "llama-cpp-python 9.9.9 sdist"}
    meta["source_hash"] = cores.builtin_core().source_hash
    pypy = ".pypy310-pp73-x86_64-linux-gnu.so"
    for suffix, usable in ((here, True), (other, False), (pypy, pypy in importlib.machinery.EXTENSION_SUFFIXES)):
        (folder / "core.json").write_text(json.dumps({**meta, "path": str(folder / f"_core{suffix}")}))
        (core,) = cores.installed_cores()
        assert (core.for_this_python, core.usable) == (usable, usable)
    with pytest.raises(llamaprompt.CoreError, match=r"built for another Python \(_core\.pypy310"):
        cores.find_core("9.9.9")


def test_each_python_keeps_its_own_build_of_a_version(tmp_path, monkeypatch, capsys):
    # the cache is shared by every Python of the user: `cores add` by one replaces its own build of
    # the commit (the folder-per-commit layout's too), never another Python's, and naming the
    # version finds this Python's (session 55: the 3.9 and 3.11 builds replaced each other)
    import importlib.machinery
    import zipfile

    here = importlib.machinery.EXTENSION_SUFFIXES[0]
    other = ".cpython-27-x86_64-linux-gnu.so" if "cpython-27" not in here else ".cpython-399-x86_64-linux-gnu.so"
    monkeypatch.setenv("LLAMAPROMPT_CACHE_DIR", str(tmp_path))
    meta = {"name": "9.9.9", "commit": "abcdef123", "source": "llama-cpp-python 9.9.9 sdist"}
    meta["source_hash"] = cores.builtin_core().source_hash
    for name, suffix in (("abcdef123-cpython-27", other), ("abcdef123", here)):
        folder = cores.cores_dir() / name
        folder.mkdir(parents=True)
        (folder / "core.json").write_text(json.dumps({**meta, "path": str(folder / f"_core{suffix}")}))
    wheel = tmp_path / "llamaprompt.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"llamaprompt/_core{here}", b"a module")
    probed = {"commit": "abcdef123", "source": meta["source"], "features": {}, "source_hash": meta["source_hash"]}
    monkeypatch.setattr(cores, "_probe", lambda ext: probed)
    core = cores._install(wheel, "9.9.9", tmp_path)
    assert Path(core.path or "").parent.name == f"abcdef123-{sys.implementation.cache_tag}"
    assert sorted(p.name for p in cores.cores_dir().iterdir()) == sorted(
        ["abcdef123-cpython-27", f"abcdef123-{sys.implementation.cache_tag}"]
    )
    assert len(cores.installed_cores()) == 2 and cores.find_core("9.9.9") == core
    assert main(["cores", "list"]) == 0
    assert f"another Python's (_core{other})" in capsys.readouterr().out
    # removing it removes its build directories (any checkout; the untagged ones of the layout
    # before), not another Python's or another version's whose name starts the same
    tag = sys.implementation.cache_tag
    builds = ["9.9.9-0123abcd-" + tag, "9.9.9-89abcdef-" + tag, "9.9.9-0123abcd", "9.9.9-0123abcd-cpython-27"]
    builds += ["9.9.90-0123abcd-" + tag, "0.9.9.9-0123abcd-" + tag]
    for name in builds:
        (cores.cache_dir() / "core-builds" / name).mkdir(parents=True)
    assert core.build_key == "9.9.9"
    assert cores.remove_core("9.9.9") == core
    with pytest.raises(llamaprompt.CoreError, match="built for another Python"):
        cores.find_core("9.9.9")
    assert sorted(p.name for p in (cores.cache_dir() / "core-builds").iterdir()) == sorted(builds[3:])


def test_a_damaged_core_json_is_not_listed_and_removal_stays_in_its_folder(tmp_path, monkeypatch, capsys):
    # (the second trial of session 57) a core.json with fields of the wrong type failed `cores
    # list` for every core, and `cores remove` failed after deleting the folder; a relative
    # "path" made `cores remove` delete the working folder's contents
    monkeypatch.setenv("LLAMAPROMPT_CACHE_DIR", str(tmp_path / "cache"))
    meta = {"name": "9.9.1", "commit": "abcdef001", "source": "llama-cpp-python 9.9.1 sdist"}
    damaged = {"9.9.1": {"build_key": 5}, "9.9.2": {"name": 5}, "9.9.3": {"features": []}}
    for version, change in damaged.items():
        folder = cores.cores_dir() / f"d{version}-cpython-311"
        folder.mkdir(parents=True)
        (folder / "core.json").write_text(json.dumps({**meta, "name": version, "path": "/x/_core.so", **change}))
    good = cores.cores_dir() / "abcdef004-cpython-311"
    good.mkdir()
    (good / "core.json").write_text(json.dumps({**meta, "name": "9.9.4", "commit": "abcdef004", "path": "_core.so"}))
    (good / "_core.so").write_bytes(b"x")
    bystander = tmp_path / "work" / "keep.txt"
    bystander.parent.mkdir()
    bystander.write_text("mine")
    monkeypatch.chdir(bystander.parent)
    [core] = cores.installed_cores()
    assert core.name == "9.9.4" and core.path == str(good / "_core.so")
    assert main(["cores", "list"]) == 0 and "9.9.4" in capsys.readouterr().out
    assert main(["cores", "remove", "9.9.1"]) == 2  # not listed, not removed
    assert (cores.cores_dir() / "d9.9.1-cpython-311").is_dir()
    assert main(["cores", "remove", "9.9.4"]) == 0
    assert not good.exists() and bystander.read_text() == "mine"


def test_cores_list_counts_the_features_whose_absence_loses_something(capsys):
    # the other features only name the shape of an upstream interface (older trees': e.g.
    # server_task_params), which a new user read as the built-in core missing something
    losses = llamaprompt.tree_info()["losses"]
    assert "serve_tokenize" in losses and "parse" in losses and "server_task_params" not in losses
    assert main(["cores", "list"]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.endswith("built-in"))
    have = [k for k in losses if llamaprompt.features[k]]
    assert f"{len(have)}/{len(losses)}" in line
    assert not any(k in line for k in llamaprompt.features if k not in losses)


def test_builtin_core_is_found_by_name_and_commit():
    here = cores.builtin_core()
    assert here.builtin and here.commit == llamaprompt.LLAMA_CPP_COMMIT
    for spec in (None, "", "builtin", here.commit, here.name):
        assert cores.find_core(spec).builtin
    t = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"), llama_cpp=here.commit)
    assert t._lib is _core  # in-process, no worker
    assert t.llama_cpp_commit == llamaprompt.LLAMA_CPP_COMMIT


def test_unknown_core_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMAPROMPT_CACHE_DIR", str(tmp_path))
    with pytest.raises(llamaprompt.CoreError, match=r"llamaprompt cores add 0\.3\.31"):
        llamaprompt.ChatTemplate("{{ 'x' }}", llama_cpp="0.3.31")
    with pytest.raises(TypeError):
        cores.find_core(3)  # type: ignore[arg-type]


def test_core_from_other_sources_is_refused(tmp_path, monkeypatch):
    # a core.json whose source hash is not this package's: listed as stale, never loaded
    monkeypatch.setenv("LLAMAPROMPT_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "cores" / "e3a74b299"
    folder.mkdir(parents=True)
    (folder / "_core.so").write_bytes(b"not a module")
    meta = {
        "name": "0.3.30",
        "commit": "e3a74b299",
        "source": "llama-cpp-python 0.3.30 sdist",
        "path": str(folder / "_core.so"),
        "source_hash": "0" * 64,
    }
    (folder / "core.json").write_text(json.dumps(meta))
    [core] = cores.installed_cores()
    assert not core.usable
    with pytest.raises(llamaprompt.CoreError, match="other llamaprompt sources"):
        cores.find_core("0.3.30")
    with pytest.raises(llamaprompt.CoreError, match="other llamaprompt sources"):
        llamaprompt.ChatTemplate("{{ 'x' }}", llama_cpp="e3a74b2")
    assert main(["cores", "list"]) == 0
    assert cores.remove_core("0.3.30").commit == "e3a74b299"
    assert not folder.exists()
    with pytest.raises(llamaprompt.CoreError, match="built-in"):
        cores.remove_core(llamaprompt.LLAMA_CPP_COMMIT)


def test_cores_add_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["cores", "add"])
    assert info.value.code == 2
    assert "give a VERSION or --llama-cpp-dir" in capsys.readouterr().err
    with pytest.raises(ValueError):
        cores.add_core("0.3.35", llama_cpp_dir="/tmp")


def test_cores_add_unknown_version(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMAPROMPT_CACHE_DIR", str(tmp_path))
    assert main(["cores", "add", "9.9.9", "--source", str(REPO), "--no-progress"]) == 2
    assert "unknown llama-cpp-python version '9.9.9'" in capsys.readouterr().err


def test_failed_build_names_the_upstream_change(tmp_path, monkeypatch):
    """A tree where a call site llamaprompt renames has moved: the configure step stops, and
    add_core's CoreError carries adapt_tree's message (file and text)."""
    tree = Path(llamaprompt.tree_info()["tree_dir"])
    if not (tree / "common" / "chat.cpp").is_file() or Path(_core.SOURCE_DIR).resolve() != REPO.resolve():
        pytest.skip("needs the pinned llama.cpp tree and the sources the module was built from")
    monkeypatch.setenv("LLAMAPROMPT_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "llama.cpp"
    shutil.copytree(tree, copy, symlinks=True, ignore=shutil.ignore_patterns("models", ".git", "docs", "examples"))
    shutil.copytree(tree / "models" / "templates", copy / "models" / "templates")
    server = copy / "tools" / "server" / "server.cpp"
    text = server.read_text()
    # the n_parallel auto rule llamaprompt restates (adapt_tree's server_main_check)
    assert "n_parallel" in text
    server.write_text(text.replace("n_parallel", "n_parallel_renamed"))
    with pytest.raises(llamaprompt.CoreError) as info:
        cores.add_core(llama_cpp_dir=copy, source_dir=REPO, progress=False)
    message = str(info.value)
    assert "tools/server/server.cpp" in message and "llamaprompt: cannot build" in message
    assert not (tmp_path / "cache" / "cores").exists() or not list((tmp_path / "cache" / "cores").iterdir())


# -- with the 0.3.35 core -------------------------------------------------------------------


_template = reference_template


@pytest.mark.parametrize("fname", ["apply_template.json", "apply_template_server_args.json"])
def test_worker_core_reproduces_its_own_reference(other_core, fname):
    """ChatTemplate(llama_cpp="0.3.35") -- the other core in a worker process -- gives that
    tree's llama-server recording: every prompt, every error (class, status, message), caps."""
    ref = _reference(shared_reference_dir() / "versions" / OTHER, fname)
    assert ref["llama_cpp_commit"] == OTHER_COMMIT
    mismatches, n = [], 0
    for variant in ref["variants"]:
        for tname, expected in variant["templates"].items():
            t = _template(ref, variant["server_args"], tname, OTHER)
            assert t.llama_cpp_commit == OTHER_COMMIT
            if t.caps != expected["caps"]:
                mismatches.append(f"{tname}: caps {t.caps} != {expected['caps']}")
            for rname, case in expected["cases"].items():
                n += 1
                try:
                    prompt = t.apply_template(ref["requests"][rname])
                    got = {"status": 200, "prompt": mask_dates(prompt, ref["rendered_on"])}
                except llamaprompt.Error as e:
                    cls = llamaprompt.RequestError if e.status == 400 else llamaprompt.TemplateError
                    assert isinstance(e, cls)
                    got = {"status": e.status, "error": e.to_json()["error"]}
                if got != case:
                    mismatches.append(f"{tname} / {rname}: got {got!r}, want {case!r}")
    assert n > 1000
    assert not mismatches, "\n".join(mismatches[:20])


def _undated(case: dict, rendered_on: str) -> dict:
    if case.get("status") != 200:
        return case
    prompt, day = case["prompt"], _dt.date.fromisoformat(rendered_on)
    for fmt in DATE_FORMATS:
        prompt = prompt.replace(day.strftime(fmt), "<DATE>")
    return {**case, "prompt": prompt}


def _recorded_differences(old: dict, new: dict) -> tuple[set, dict]:
    """The cases and caps in which two recordings differ (dates aside): the expected diff."""
    cases, caps = set(), {}
    for vo, vn in zip(old["variants"], new["variants"]):
        assert vo["server_args"] == vn["server_args"]
        for tname, eo in vo["templates"].items():
            en = vn["templates"].get(tname)
            if en is None:
                continue
            changed = {
                k: [eo["caps"].get(k), en["caps"].get(k)]
                for k in sorted(set(eo["caps"]) | set(en["caps"]))
                if eo["caps"].get(k) != en["caps"].get(k)
            }
            if changed:
                caps[(tuple(vo["server_args"]), tname)] = changed
            for rname, co in eo["cases"].items():
                if _undated(co, old["rendered_on"]) != _undated(en["cases"][rname], new["rendered_on"]):
                    cases.add((tuple(vo["server_args"]), tname, rname))
    return cases, caps


@pytest.mark.parametrize("fname", ["apply_template.json", "apply_template_server_args.json"])
def test_diff_versions_reports_what_the_recordings_differ_in(other_core, fname):
    old = _reference(shared_reference_dir() / "versions" / OTHER, fname)
    new = _reference(shared_reference_dir(), fname)
    assert old["requests"] == new["requests"]
    want_cases, want_caps = _recorded_differences(old, new)
    if fname == "apply_template.json":
        # the figures the reference README states for the default configuration
        assert len(want_cases) == 88 and len(want_caps) == 15
    got_cases, got_caps = set(), {}
    for variant in old["variants"]:
        sargs = tuple(variant["server_args"])
        names = list(variant["templates"])
        tok = old["model_tokens"]
        templates = file_templates(
            [str(template_path(n)) for n in names],
            server_args=list(sargs),
            bos_token=tok["bos_token"],
            eos_token=tok["eos_token"],
            add_bos=tok["add_bos"],
            add_eos=tok["add_eos"],
            media_marker=old["media_marker"],
        )
        report = diff_versions(templates, from_core=OTHER, to_core=None, requests=old["requests"], progress=False)
        assert report["from"]["commit"] == OTHER_COMMIT and report["to"]["commit"] == PIN_COMMIT
        assert report["summary"]["templates"] == len(names)
        assert report["summary"]["cases"] == len(names) * len(old["requests"])
        for tname, entry in report["templates"].items():
            assert "load" not in entry
            if "caps" in entry:
                got_caps[(sargs, tname)] = entry["caps"]
            for rname in entry.get("cases", {}):
                got_cases.add((sargs, tname, rname))
    assert got_caps == want_caps
    assert got_cases == want_cases


def test_diff_versions_cli(other_core, tmp_path, capsys):
    name = "Qwen-Qwen3-0.6B.jinja"
    out = tmp_path / "diff.json"
    # the media requests render differently between these trees (typed content)
    status = main(
        [
            "diff-versions",
            "--from",
            OTHER,
            "--to",
            PIN_COMMIT,
            "-t",
            str(template_path(name)),
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    changed = report["summary"]["cases_changed"] + report["summary"]["caps_changed"]
    assert status == (1 if changed else 0)
    assert text.splitlines()[0] == f"llama.cpp {OTHER} ({OTHER_COMMIT}) -> {report['to']['name']} ({PIN_COMMIT})"
    assert f"caps changed for {report['summary']['caps_changed']}" in text.splitlines()[-1]
    # the same core on both sides: nothing changes, exit 0
    assert main(["diff-versions", "--from", OTHER, "--to", OTHER, "-t", str(template_path(name)), "--no-progress"]) == 0
    assert "0 of 1 templates render differently on 0 of" in capsys.readouterr().out
    # a core that is not installed: exit 2 with the message
    assert main(["diff-versions", "--from", "0.0.1", "--to", OTHER, "--no-progress"]) == 2
    assert "no llama.cpp core '0.0.1'" in capsys.readouterr().err


def test_worker_gets_json_text_not_pickled_dicts(other_core):
    """A request dict for another tree's core goes to its worker as JSON text (an in-process
    core takes the dict itself: test_request_tree.py): a value of a class only this process
    has, or one no pickle holds, gets the answer JSON text gives, not a dead worker or a
    pickling error (found by a trial)."""
    import enum

    class Level(enum.IntEnum):  # a local class: no worker could unpickle it
        HIGH = 3

    source = "{{ messages[0].content }}|{% if v is defined %}{{ v | tojson }}{% endif %}"
    t = llamaprompt.ChatTemplate(source, llama_cpp=OTHER)
    here = llamaprompt.ChatTemplate(source)
    request = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"v": Level.HIGH}}
    assert t.apply_template(request) == here.apply_template(request) == "hi|3"
    assert t.apply(request).prompt == "hi|3"
    unpicklable = {"messages": [], "chat_template_kwargs": {"v": (x for x in ())}}
    with pytest.raises(llamaprompt.RequestError, match="not JSON serializable"):
        t.apply_template(unpicklable)
    got = t.apply_template_many([request, unpicklable], return_exceptions=True)
    assert got[0] == "hi|3" and isinstance(got[1], llamaprompt.RequestError)


def test_worker_errors_pickling_and_parse(other_core):
    t = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"), llama_cpp=OTHER)
    with pytest.raises(llamaprompt.RequestError) as info:
        t.apply_template({"messages": "not a list"})
    assert info.value.status == 400 and info.value.message
    with pytest.raises(llamaprompt.ServerArgsError):
        llamaprompt.ChatTemplate("{{ 'x' }}", server_args=["--no-such-flag"], llama_cpp=OTHER)
    with pytest.raises(llamaprompt.TemplateError):
        llamaprompt.ChatTemplate("{% if %}", llama_cpp=OTHER)
    with pytest.raises(ValueError, match="unknown caps keys"):
        llamaprompt.ChatTemplate("{{ 'x' }}", caps={"no_such_cap": True}, llama_cpp=OTHER)
    again = pickle.loads(pickle.dumps(t))
    request = {"messages": [{"role": "user", "content": "Hi"}]}
    assert again.apply_template(request) == t.apply_template(request)
    assert again.llama_cpp_commit == OTHER_COMMIT
    params = t.apply(request)
    assert params.parse("Hello there")["content"] == "Hello there"
    assert t.describe()["llama_cpp_commit"] == OTHER_COMMIT
    many = t.apply_template_many([request, {"messages": 1}], return_exceptions=True)
    assert many[0] == t.apply_template(request) and isinstance(many[1], llamaprompt.RequestError)


def test_worker_logs_reach_the_callers_logging(other_core, caplog):
    # llama.cpp's lines logged by the worker's core (its warning about a tool schema it cannot
    # convert: json-schema-to-grammar.cpp, both trees) are logged here, at the levels enabled here
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string", "pattern": "^(?=a)b$"}}}
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    t = llamaprompt.ChatTemplate.from_file(template_path("Qwen-Qwen3-0.6B.jinja"), llama_cpp=OTHER)
    with caplog.at_level(logging.WARNING, logger="llamaprompt"):
        t.apply(body)
    lines = [r.getMessage() for r in caplog.records if r.name == "llamaprompt.llama_cpp"]
    assert any("JSON schema conversion was incomplete" in line for line in lines), lines
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="llamaprompt"):
        t.apply(body)
    assert not [r for r in caplog.records if r.name.startswith("llamaprompt")]


def test_worker_gguf_tokens(other_core):
    ref = _reference(shared_reference_dir() / "versions" / OTHER, "gguf.json")
    models = Path(llamaprompt.tree_info()["tree_dir"]) / "models"
    checked = 0
    for mname, entry in ref["models"].items():
        path = models / f"ggml-vocab-{mname}.gguf"
        if not path.is_file():
            continue
        t = llamaprompt.ChatTemplate.from_gguf(path, media_marker=ref["media_marker"], llama_cpp=OTHER)
        assert t.caps == entry["caps"] and t.bos_token == entry["bos_token"]
        for rname, case in entry["cases"].items():
            for key in ("tokens_add_special_false", "tokens_add_special_true"):
                if key in case:
                    tokens = t.tokenize(case["prompt"], add_special=key.endswith("true"))
                    assert tokens.tolist() == case[key], (mname, rname, key)
                    checked += 1
    assert checked


def test_worker_crash_is_a_core_error(other_core):
    from llamaprompt.remote import remote_core

    t = llamaprompt.ChatTemplate("{{ 'x' }}", llama_cpp=OTHER)
    remote = remote_core(other_core)
    remote._proc.kill()
    remote._proc.wait()
    with pytest.raises(llamaprompt.CoreError, match="died|gone"):
        t.apply_template({"messages": [{"role": "user", "content": "Hi"}]})
    # a new template starts a new worker
    t2 = llamaprompt.ChatTemplate("{{ 'y' }}", llama_cpp=OTHER)
    assert t2.apply_template({"messages": [{"role": "user", "content": "Hi"}]}) == "y"


EXIT_WHILE_THE_WORKER_RENDERS = """
import atexit, sys, threading, time
import llamaprompt
if sys.argv[2] == "atexit-first":
    # registered before the core's own handler: runs after the worker was stopped
    def last_render():
        try:
            t.apply_template({"messages": [{"role": "user", "content": "at exit"}]})
        except llamaprompt.CoreError:
            print("atexit: CoreError")
    atexit.register(last_render)
t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"), llama_cpp=sys.argv[1])
t.apply_template({"messages": [{"role": "user", "content": "main"}]})
def loop():
    while True:
        t.apply_template({"messages": [{"role": "user", "content": "x" * 20000}]})
for _ in range(3):
    threading.Thread(target=loop, daemon=True).start()
time.sleep(0.5)
print("exiting")
"""


@pytest.mark.parametrize("mode", ["plain", "atexit-first"])
def test_interpreter_exit_while_daemon_threads_wait_for_the_worker(other_core, mode):
    # at exit the worker is stopped (atexit); daemon threads whose calls were waiting for it
    # printed a CoreError traceback each ("the worker process ... died") as the process exited.
    # "atexit-first": a user's atexit handler that runs after the worker was stopped gets its
    # CoreError -- it hung for good when a daemon thread waited while holding the worker's lock
    expected = "exiting\natexit: CoreError" if mode == "atexit-first" else "exiting"
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_WHILE_THE_WORKER_RENDERS, OTHER, mode],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, expected, "")


def test_calls_after_close_still_raise(other_core):
    # the main thread (and any non-daemon thread) still gets its CoreError once the worker is gone
    from llamaprompt.remote import remote_core

    t = llamaprompt.ChatTemplate("{{ 'x' }}", llama_cpp=OTHER)
    remote = remote_core(other_core)
    remote._close_at_exit()
    with pytest.raises(llamaprompt.CoreError, match="was closed"):
        t.apply_template({"messages": [{"role": "user", "content": "Hi"}]})


def test_a_closed_workers_templates_never_reach_the_next_worker(other_core):
    # close() closed the pipes but kept their descriptor numbers; the next worker's pipes got the
    # same numbers, so the old template's calls went to it (raw KeyError, crossed answers)
    from llamaprompt.remote import remote_core

    old = llamaprompt.ChatTemplate("{{ 'old' }}", llama_cpp=OTHER)
    remote_core(other_core).close()
    new = llamaprompt.ChatTemplate("{{ 'new' }}", llama_cpp=OTHER)
    request = {"messages": [{"role": "user", "content": "Hi"}]}
    for _ in range(3):
        with pytest.raises(llamaprompt.CoreError, match="was closed"):
            old.apply_template(request)
        assert new.apply_template(request) == "new"


def test_worker_echoes_deep_results_or_refuses_them(other_core):
    # the worker pickles its answer (~2 frames per level): an echo of an unused field nested
    # >= ~500 levels raised a raw RecursionError; now it comes back or is the in-process
    # core's RequestError for a result too deep for Python
    t = llamaprompt.ChatTemplate.from_file(llamaprompt.pinned_template("Qwen-Qwen3-0.6B.jinja"), llama_cpp=OTHER)
    outcomes = set()
    for n in (100, 480, 600, 800, 990, 999):
        body = '{"messages":[{"role":"user","content":"a"}],"x":' + "[" * n + "]" * n + "}"
        try:
            x, depth = t.apply(body).llama_params["x"], 0
        except llamaprompt.RequestError as e:
            assert "nested too deeply" in e.message and e.status == 400
            outcomes.add("refused")
            continue
        while isinstance(x, list):
            x, depth = (x[0] if x else None), depth + 1
        assert depth == n
        outcomes.add("returned")
    assert outcomes == {"refused", "returned"}


def test_an_interrupted_call_never_hands_its_answer_to_the_next(other_core):
    # a KeyboardInterrupt (or a signal handler's exception) between a call's request and its
    # answer left that answer in the pipe: every later call got the previous call's answer
    from llamaprompt.remote import remote_core

    t = llamaprompt.ChatTemplate("{{ messages[0]['content'] }}", llama_cpp=OTHER)
    remote = remote_core(other_core)
    interrupt_next_receive(remote)
    with pytest.raises(KeyboardInterrupt):
        t.apply_template({"messages": [{"role": "user", "content": "first"}]})
    with pytest.raises(llamaprompt.CoreError, match="interrupted"):
        t.apply_template({"messages": [{"role": "user", "content": "second"}]})
    with pytest.raises(llamaprompt.CoreError, match="was stopped: a call to it was interrupted"):
        t.apply_template({"messages": [{"role": "user", "content": "later"}]})  # not "died (signal SIGTERM)"
    t2 = llamaprompt.ChatTemplate("{{ messages[0]['content'] }}", llama_cpp=OTHER)
    assert t2.apply_template({"messages": [{"role": "user", "content": "third"}]}) == "third"


def test_env_makes_another_core_the_in_process_one(other_core):
    code = "import llamaprompt; print(llamaprompt.LLAMA_CPP_COMMIT, llamaprompt.cores.builtin_core().name)"
    env = {**os.environ, "LLAMAPROMPT_CORE": OTHER}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [OTHER_COMMIT, OTHER]
    env["LLAMAPROMPT_CORE"] = "no-such-core"
    bad = subprocess.run([sys.executable, "-c", "import llamaprompt"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "LLAMAPROMPT_CORE=no-such-core" in bad.stderr


def test_cores_list_shows_the_other_core(other_core, capsys):
    assert main(["cores", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["builtin"] and rows[0]["commit"] == llamaprompt.LLAMA_CPP_COMMIT
    mine = [r for r in rows if r["commit"] == OTHER_COMMIT]
    assert mine and mine[0]["usable"] and mine[0]["size"] > 1_000_000 and mine[0]["date"] == "2026-08-16"
    assert set(mine[0]["features"]) == set(llamaprompt.features)


def test_fixtures_from_another_core(other_core, tmp_path):
    """`fixtures --llama-cpp 0.3.35` writes that tree's prompts: checked against its recording."""
    ref = _reference(shared_reference_dir() / "versions" / OTHER, "apply_template.json")
    name = "Qwen-Qwen3-0.6B.jinja"
    expected = ref["variants"][0]["templates"][name]
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps(ref["requests"]))
    out = tmp_path / "fx.json"
    tok = ref["model_tokens"]
    assert (
        main(
            [
                "fixtures",
                "--llama-cpp",
                OTHER,
                "-t",
                str(template_path(name)),
                "--requests",
                str(requests),
                "--bos-token",
                tok["bos_token"],
                "--eos-token",
                tok["eos_token"],
                "--add-bos",
                "--no-progress",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["llama_cpp_commit"] == OTHER_COMMIT and doc["llama_cpp_source"] == "llama-cpp-python 0.3.35 sdist"
    entry = doc["templates"][name]
    assert entry["caps"] == expected["caps"]
    for rname, case in expected["cases"].items():
        got = dict(entry["cases"][rname])
        if got["status"] == 200:
            got["prompt"] = mask_dates(got["prompt"], ref["rendered_on"])
        assert got == case, rname
    # and `check --llama-cpp` re-renders it with the same core: everything matches
    assert main(["check", str(out), "--llama-cpp", OTHER, "--no-progress"]) == 0


def test_diff_versions_does_not_hide_what_it_could_not_compare(tmp_path, capsys):
    """A template that loads on neither side, or a flag both refuse, is an error (exit 2) with the
    message, not "nothing changed"; an empty --templates folder is a usage error. Runs with the
    built-in core on both sides (no other core needed)."""
    here = cores.builtin_core().name
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for x in %}")
    good = str(template_path("Qwen-Qwen3-0.6B.jinja"))
    assert main(["diff-versions", "--from", here, "--to", here, "-t", str(bad), "--no-progress"]) == 2
    out = capsys.readouterr()
    assert "bad.jinja: fails to load on both" in out.out and "load on neither" in out.err
    assert main(["diff-versions", "--from", here, "--to", here, "-t", good, "--no-progress", "--", "--bogus-flag"]) == 2
    assert "fails to load on both" in capsys.readouterr().out
    assert main(["diff-versions", "--from", here, "--to", here, "-t", good, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "both sides are the same core" in text and "0 of 1 templates render differently" in text
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(SystemExit) as info:
            main(["diff-versions", "--from", here, "--to", here, "--templates", str(folder)])
        assert info.value.code == 2
    with pytest.raises(llamaprompt.CoreError, match="built-in core"):
        cores.add_core(here)


def test_installed_core_is_not_rebuilt(other_core):
    # a usable core for that version is returned at once (force=True would rebuild it)
    assert cores.add_core(OTHER, progress=False) == other_core


def test_stuck_worker_times_out(other_core, monkeypatch):
    import signal

    from llamaprompt import remote

    t = llamaprompt.ChatTemplate("{{ 'x' }}", llama_cpp=OTHER)
    worker = remote.remote_core(other_core)
    monkeypatch.setattr(remote, "CALL_TIMEOUT", 1.0)
    worker._proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(llamaprompt.CoreError, match="did not answer within 1 s"):
            t.apply_template({"messages": [{"role": "user", "content": "Hi"}]})
    finally:
        with contextlib.suppress(ProcessLookupError):
            worker._proc.send_signal(signal.SIGCONT)
    worker._proc.wait(10)  # stopped by the timeout
    assert (
        llamaprompt.ChatTemplate("{{ 'y' }}", llama_cpp=OTHER).apply_template(
            {"messages": [{"role": "user", "content": "Hi"}]}
        )
        == "y"
    )


FORK_WHILE_A_WORKER_STARTS = """
import sys, threading
import llamaprompt
from llamaprompt import remote
held, release = threading.Event(), threading.Event()
def start_a_worker():  # a thread inside remote_core(), holding its lock, at the fork
    with remote._REMOTES_LOCK:
        held.set()
        release.wait()
threading.Thread(target=start_a_worker).start()
held.wait()
pid = os.fork()
if pid == 0:
    t = llamaprompt.ChatTemplate("{{ messages[0]['content'] }}", llama_cpp=sys.argv[1])
    print("child:", t.apply_template({"messages": [{"role": "user", "content": "rendered"}]}), flush=True)
    os._exit(0)
release.set()
wait_for_child(pid)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_worker_starts_gets_its_own(other_core):
    # the lock that guards the process's workers stayed held in a child forked while another
    # thread of the parent was starting one: the child's first remote template hung for good
    proc = run_forking_script(FORK_WHILE_A_WORKER_STARTS, OTHER)
    assert (proc.returncode, proc.stdout.strip()) == (0, "child: rendered"), proc.stderr


CHILD_EXIT_WITH_THE_PARENTS_POPEN_BUSY = """
import os, sys
import llamaprompt
from llamaprompt import remote
from llamaprompt.cores import find_core
t = llamaprompt.ChatTemplate("{{ messages[0]['content'] }}", llama_cpp=sys.argv[1])
worker = remote.remote_core(find_core(sys.argv[1]))
worker._proc._waitpid_lock.acquire()  # a thread of the parent inside Popen.poll(), at the fork
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the atexit handlers run, the core's among them
worker._proc._waitpid_lock.release()
os.waitpid(pid, 0)
print(t.apply_template({"messages": [{"role": "user", "content": "still here"}]}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_childs_exit_leaves_the_parents_worker_alone(other_core):
    # the child's copy of the parent's worker saw Popen.poll() answer None (its lock held) and its
    # atexit handler sent SIGTERM to the parent's worker: the parent's next call raised CoreError
    proc = subprocess.run(
        [sys.executable, "-c", CHILD_EXIT_WITH_THE_PARENTS_POPEN_BUSY, OTHER],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "still here"), proc.stderr
