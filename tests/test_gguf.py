"""GGUF-backed templates: the template, tool_use variant, BOS/EOS and tokens from a model
file, compared with ../shared/reference/gguf.json (recorded from llama-server -m), and
GGUF files written here with the gguf package (llama.cpp's own writer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llamaprompt
from conftest import load_reference, mask_dates, reference_cases, vocab_gguf

gguf = pytest.importorskip("gguf")
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata  # noqa: E402

SPM = "ggml-vocab-llama-spm.gguf"


def _models():
    return sorted(load_reference("gguf.json")["models"])


@pytest.fixture(scope="module")
def gguf_ref():
    return load_reference("gguf.json")


@pytest.mark.parametrize("name", reference_cases(_models))
def test_reference_model(gguf_ref, name):
    expected = gguf_ref["models"][name]
    tmpl = llamaprompt.ChatTemplate.from_gguf(vocab_gguf(expected["vocab_file"]), media_marker=gguf_ref["media_marker"])
    assert tmpl.caps == expected["caps"]
    assert tmpl.bos_token == expected["bos_token"]
    assert tmpl.eos_token == expected["eos_token"]
    assert tmpl.source == expected["chat_template"]
    assert tmpl.tool_use_source == expected.get("chat_template_tool_use")
    props = tmpl.props()
    assert props.get("chat_template_tool_use") == expected.get("chat_template_tool_use")

    mismatches, n_tokens = [], 0
    for rname, case in expected["cases"].items():
        request = gguf_ref["requests"][rname]
        if case["status"] != 200:
            with pytest.raises(llamaprompt.Error) as info:
                tmpl.apply_template(request)
            if info.value.status != case["status"] or info.value.message != case["error"]["message"]:
                mismatches.append(f"{rname}: {info.value.status} {info.value.message!r} != {case['error']}")
            continue
        got = mask_dates(tmpl.apply_template(request), gguf_ref["rendered_on"])
        if got != case["prompt"]:
            mismatches.append(f"{rname}: prompt differs:\n got {got!r}\nwant {case['prompt']!r}")
            continue
        for add_special in (False, True):
            key = f"tokens_add_special_{str(add_special).lower()}"
            if key in case:
                n_tokens += 1
                ids = tmpl.tokenize(case["prompt"], add_special=add_special)
                assert ids.dtype == np.int32 and ids.ndim == 1
                if ids.tolist() != case[key]:
                    mismatches.append(f"{rname}: {key} differ")
                if add_special and tmpl.apply_template_tokens(request).tolist() != case[key]:
                    mismatches.append(f"{rname}: apply_template_tokens differs from the server's tokens")
    assert not mismatches, "\n".join(mismatches)
    assert n_tokens > 0


def test_tokens_roundtrip_and_ids():
    tmpl = llamaprompt.ChatTemplate.from_gguf(vocab_gguf(SPM))
    assert tmpl.vocab_size == 32000
    assert tmpl.bos_token_id == 1 and tmpl.eos_token_id == 2
    assert tmpl.token_to_piece(1) == b"<s>"
    ids = tmpl.tokenize("Hello world", add_special=True)
    assert ids[0] == 1  # SPM vocab adds BOS
    assert tmpl.detokenize(ids[1:]).strip() == "Hello world"
    # special-token text is parsed as one token unless parse_special is off
    assert tmpl.tokenize("</s>").tolist() == [2]
    assert 2 not in tmpl.tokenize("</s>", parse_special=False).tolist()
    with pytest.raises(ValueError, match="out of range"):
        tmpl.detokenize([tmpl.vocab_size])
    with pytest.raises(ValueError):
        tmpl.token_to_piece(-5)


def test_tokens_need_a_gguf(qwen3):
    with pytest.raises(TypeError, match="from_gguf"):
        qwen3.tokenize("x")


def _rewrite(src: Path, dst: Path, *, template=None, remove=(), set_bool=None) -> Path:
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    new = {}
    if template is not None:
        new[gguf.Keys.Tokenizer.CHAT_TEMPLATE] = MetadataDetails(gguf.GGUFValueType.STRING, template)
    for key, value in (set_bool or {}).items():
        new[key] = MetadataDetails(gguf.GGUFValueType.BOOL, value)
    copy_with_new_metadata(reader, writer, new, list(remove))
    return dst


PLAIN = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)
TOOLS = (
    "{{ bos_token }}{% if tools %}[TOOLS]{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)


def test_written_gguf_with_template(tmp_path):
    path = _rewrite(vocab_gguf(SPM), tmp_path / "t.gguf", template=PLAIN)
    tmpl = llamaprompt.ChatTemplate.from_gguf(path)
    assert tmpl.source == PLAIN
    assert tmpl.tool_use_source is None
    assert tmpl.bos_token == "<s>" and tmpl.eos_token == "</s>" and tmpl.add_bos is True
    assert tmpl.apply_template({"messages": [{"role": "user", "content": "hi"}]}) == "<user>hi<a>"
    meta = llamaprompt.gguf_metadata(path)
    assert meta["tokenizer.chat_template"] == PLAIN
    assert meta["tokenizer.ggml.tokens"] == {"type": "array", "element_type": "str", "length": 32000}


def test_written_gguf_without_template_falls_back_to_chatml(tmp_path):
    path = _rewrite(vocab_gguf(SPM), tmp_path / "t.gguf", remove=["tokenizer.chat_template"])
    assert "tokenizer.chat_template" not in llamaprompt.gguf_metadata(path)
    tmpl = llamaprompt.ChatTemplate.from_gguf(path)
    # common_chat_templates_init uses chatml when the model has no template
    assert tmpl.apply_template({"messages": [{"role": "user", "content": "hi"}]}) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_written_gguf_with_tool_use_variant(tmp_path):
    templates = [{"name": "default", "template": PLAIN}, {"name": "tool_use", "template": TOOLS}]
    path = _rewrite(vocab_gguf(SPM), tmp_path / "t.gguf", template=templates)
    meta = llamaprompt.gguf_metadata(path)
    assert meta["tokenizer.chat_template.tool_use"] == TOOLS
    tmpl = llamaprompt.ChatTemplate.from_gguf(path)
    assert tmpl.source == PLAIN and tmpl.tool_use_source == TOOLS
    assert tmpl.props()["chat_template_tool_use"] == TOOLS
    plain = tmpl.apply_template({"messages": [{"role": "user", "content": "hi"}]})
    assert plain == "<user>hi<a>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with_tools = tmpl.apply_template({"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    # the tool_use variant renders requests with tools; its leading BOS is stripped (add_bos)
    assert with_tools.startswith("[TOOLS]") and with_tools.endswith("<user>hi<a>")
    # --chat-template-file replaces the file's templates
    over = llamaprompt.ChatTemplate.from_gguf(path, chat_template="{{ messages[0]['content'] }}!")
    assert over.tool_use_source is None
    assert over.apply_template({"messages": [{"role": "user", "content": "hi"}]}) == "hi!"


def test_written_gguf_without_bos_and_add_bos_false(tmp_path):
    src = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    no_add = _rewrite(
        vocab_gguf(SPM), tmp_path / "a.gguf", template=src, set_bool={"tokenizer.ggml.add_bos_token": False}
    )
    tmpl = llamaprompt.ChatTemplate.from_gguf(no_add)
    assert tmpl.add_bos is False
    assert tmpl.apply_template({"messages": [{"role": "user", "content": "x"}]}) == "<s>x"  # not stripped
    assert tmpl.tokenize("x", add_special=True).tolist()[0] != 1

    no_bos = _rewrite(vocab_gguf(SPM), tmp_path / "b.gguf", template=src, remove=["tokenizer.ggml.bos_token_id"])
    meta = llamaprompt.gguf_metadata(no_bos)
    assert "tokenizer.ggml.bos_token_id" not in meta


@pytest.mark.parametrize("cut", [0, 3, 4, 8, 16, 24, 100, 1000, 50_000, -1])
def test_truncated_gguf_raises(tmp_path, cut):
    data = vocab_gguf(SPM).read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut] if cut >= 0 else data[: len(data) // 2])
    with pytest.raises(llamaprompt.GGUFError) as info:
        llamaprompt.ChatTemplate.from_gguf(bad)
    assert info.value.message
    with pytest.raises(llamaprompt.GGUFError):
        llamaprompt.gguf_metadata(bad)


def test_not_a_gguf_and_missing(tmp_path):
    txt = tmp_path / "x.gguf"
    txt.write_text("this is not a gguf file at all")
    with pytest.raises(llamaprompt.GGUFError):
        llamaprompt.ChatTemplate.from_gguf(txt)
    with pytest.raises(llamaprompt.GGUFError, match="cannot open"):
        llamaprompt.ChatTemplate.from_gguf(tmp_path / "missing.gguf")
    assert issubclass(llamaprompt.GGUFError, OSError)


def test_absurd_kv_count(tmp_path):
    data = bytearray(vocab_gguf(SPM).read_bytes())
    # header: magic(4) version(4) n_tensors(8) n_kv(8)
    data[16:24] = (2**62).to_bytes(8, "little")
    bad = tmp_path / "kv.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(llamaprompt.GGUFError):
        llamaprompt.ChatTemplate.from_gguf(bad)


def test_bad_template_in_gguf(tmp_path):
    path = _rewrite(vocab_gguf(SPM), tmp_path / "t.gguf", template="{% for %}")
    with pytest.raises(llamaprompt.TemplateError):
        llamaprompt.ChatTemplate.from_gguf(path)


def test_a_broken_tool_use_template_standing_in_for_the_default_says_why(tmp_path):
    # no tokenizer.chat_template: llama.cpp takes the tool_use template as the default, and its
    # parse error comes back sliced to "std::exception" (chat.cpp's `throw e;`); the message is
    # the parser's, as for a broken default template (the trial of session 54: "std::exception")
    broken = "{% for %}"
    with pytest.raises(llamaprompt.TemplateError) as default_broken:
        llamaprompt.ChatTemplate.from_gguf(_rewrite(vocab_gguf(SPM), tmp_path / "d.gguf", template=broken))
    path = _rewrite(
        vocab_gguf(SPM),
        tmp_path / "t.gguf",
        template=[{"name": "tool_use", "template": broken}],
        remove=["tokenizer.chat_template"],
    )
    meta = llamaprompt.gguf_metadata(path)
    assert "tokenizer.chat_template" not in meta and meta["tokenizer.chat_template.tool_use"] == broken
    with pytest.raises(llamaprompt.TemplateError) as tool_use_broken:
        llamaprompt.ChatTemplate.from_gguf(path)
    assert default_broken.value.message != "std::exception"
    assert tool_use_broken.value.message == default_broken.value.message


def test_llama_cpp_log_goes_to_logging(caplog, tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with caplog.at_level("DEBUG", logger="llamaprompt.llama_cpp"), pytest.raises(llamaprompt.GGUFError):
        llamaprompt.ChatTemplate.from_gguf(bad)
    assert any(r.name == "llamaprompt.llama_cpp" for r in caplog.records)


def test_cli_gguf(tmp_path):
    import subprocess
    import sys

    spm = str(vocab_gguf(SPM))
    proc = subprocess.run(
        [sys.executable, "-m", "llamaprompt.cli", "tokenize", "--gguf", spm, "Hello"], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr
    ids = json.loads(proc.stdout)
    assert ids == llamaprompt.ChatTemplate.from_gguf(spm).tokenize("Hello").tolist()
    proc = subprocess.run([sys.executable, "-m", "llamaprompt.cli", "inspect", spm], capture_output=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["general.architecture"] == "llama"
    proc = subprocess.run([sys.executable, "-m", "llamaprompt.cli", "caps", "--gguf", spm], capture_output=True)
    assert proc.returncode == 0 and "supports_tools" in json.loads(proc.stdout)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    proc = subprocess.run([sys.executable, "-m", "llamaprompt.cli", "inspect", str(bad)], capture_output=True)
    assert proc.returncode == 2 and b"GGUFError" in proc.stderr


def _rewrite_kv(src: Path, dst: Path, changes: dict) -> Path:
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, dict(changes), [])
    return dst


def test_vocab_conditions_llama_cpp_asserts_raise_instead(tmp_path):
    """Files that make llama.cpp abort (GGML_ASSERT / GGML_ABORT) while loading or
    tokenizing raise GGUFError; the process survives (each case would kill it otherwise)."""
    src = vocab_gguf(SPM)
    tokens = gguf.GGUFReader(src, "r").get_field("tokenizer.ggml.tokens").contents()
    dup = list(tokens)
    dup[200] = dup[100]
    S, A = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    cases = {
        "dup": {"tokenizer.ggml.tokens": MetadataDetails(A, dup, sub_type=S)},
        "bert": {"tokenizer.ggml.model": MetadataDetails(S, "bert")},
    }
    for name, change in cases.items():
        path = _rewrite_kv(src, tmp_path / f"{name}.gguf", change)
        with pytest.raises(llamaprompt.GGUFError):
            llamaprompt.ChatTemplate.from_gguf(path)
    none = _rewrite_kv(src, tmp_path / "none.gguf", {"tokenizer.ggml.model": MetadataDetails(S, "none")})
    t = llamaprompt.ChatTemplate.from_gguf(none)
    with pytest.raises(llamaprompt.GGUFError, match="no tokenizer"):
        t.tokenize("x")


def _field(src: Path, key: str):
    return gguf.GGUFReader(src, "r").get_field(key).contents()


def test_more_vocab_conditions_llama_cpp_asserts_raise_instead(tmp_path):
    """The crash paths an audit of the pinned llama-vocab.cpp found reachable from file data
    (each was confirmed to kill the process before it was guarded)."""
    S, A, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    spm, qwen, bert = vocab_gguf(SPM), vocab_gguf("ggml-vocab-qwen2.gguf"), vocab_gguf("ggml-vocab-bert-bge.gguf")

    # an empty token text becomes "[EMPTY_<id>]" before llama.cpp's uniqueness assert
    tokens = list(_field(spm, "tokenizer.ggml.tokens"))
    tokens[5], tokens[6] = "", "[EMPTY_5]"
    path = _rewrite_kv(spm, tmp_path / "empty.gguf", {"tokenizer.ggml.tokens": MetadataDetails(A, tokens, sub_type=S)})
    with pytest.raises(llamaprompt.GGUFError, match="same token text twice"):
        llamaprompt.ChatTemplate.from_gguf(path)
    tokens[6] = ""  # two empty texts are two different placeholders: llama.cpp loads it
    path = _rewrite_kv(spm, tmp_path / "empty2.gguf", {"tokenizer.ggml.tokens": MetadataDetails(A, tokens, sub_type=S)})
    assert llamaprompt.ChatTemplate.from_gguf(path).tokenize("hi", add_special=False).size > 0

    # BPE token texts decode in time and memory quadratic in their length
    tokens = list(_field(qwen, "tokenizer.ggml.tokens"))
    tokens[1000] = "中" * 28000
    path = _rewrite_kv(qwen, tmp_path / "long.gguf", {"tokenizer.ggml.tokens": MetadataDetails(A, tokens, sub_type=S)})
    with pytest.raises(llamaprompt.GGUFError, match="bytes long"):
        llamaprompt.ChatTemplate.from_gguf(path)

    # the test tokenizer divides by the number of tokens (trees before it existed refuse the
    # name with llama.cpp's "unknown tokenizer" message)
    path = _rewrite_kv(spm, tmp_path / "test.gguf", {"tokenizer.ggml.model": MetadataDetails(S, "test")})
    if llamaprompt.features["vocab_test_tokenizer"]:
        assert llamaprompt.ChatTemplate.from_gguf(path)  # with tokens it loads
    else:
        with pytest.raises(llamaprompt.GGUFError, match="unknown tokenizer: 'test'"):
            llamaprompt.ChatTemplate.from_gguf(path)
    path = tmp_path / "test-empty.gguf"
    reader = gguf.GGUFReader(spm, "r")
    writer = gguf.GGUFWriter(path, arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
    copy_with_new_metadata(
        reader,
        writer,
        {"tokenizer.ggml.model": MetadataDetails(S, "test")},
        ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"],
    )
    with pytest.raises(llamaprompt.GGUFError):
        llamaprompt.ChatTemplate.from_gguf(path)

    # no tokenizer, but a vocab_size that makes ids look valid: token_to_piece asserts a tokenizer
    arch = _field(spm, gguf.Keys.General.ARCHITECTURE)
    path = _rewrite_kv(
        spm,
        tmp_path / "none.gguf",
        {"tokenizer.ggml.model": MetadataDetails(S, "none"), f"{arch}.vocab_size": MetadataDetails(U32, 10)},
    )
    with pytest.raises(llamaprompt.GGUFError, match="no tokenizer"):
        llamaprompt.ChatTemplate.from_gguf(path).token_to_piece(0)

    # a bert (WPM) vocab adds [CLS] and [SEP] with add_special whatever add_bos says
    cut = {
        "tokenizer.ggml.tokens": MetadataDetails(A, list(_field(bert, "tokenizer.ggml.tokens"))[:100], sub_type=S),
        "tokenizer.ggml.token_type": MetadataDetails(
            A, list(_field(bert, "tokenizer.ggml.token_type"))[:100], sub_type=gguf.GGUFValueType.INT32
        ),
        "tokenizer.ggml.add_bos_token": MetadataDetails(gguf.GGUFValueType.BOOL, False),
    }
    for name, extra in (("no-bos", {}), ("no-sep", {"tokenizer.ggml.bos_token_id": MetadataDetails(U32, 0)})):
        path = _rewrite_kv(bert, tmp_path / f"{name}.gguf", {**cut, **extra})
        try:
            t = llamaprompt.ChatTemplate.from_gguf(path)
        except llamaprompt.GGUFError as e:
            # older trees' loaders refuse the cut vocab (a special-token id past its end) with a
            # C++ exception, which arrives typed with llama.cpp's message
            assert "range" in e.message
            continue
        assert t.tokenize("hello", add_special=False).size > 0
        with pytest.raises(llamaprompt.GGUFError, match="BOS|SEP"):
            t.tokenize("hello", add_special=True)


# Loads RWKV vocabs (their token texts escaped as llama.cpp's RWKV tokenizer reads them) in a
# process of its own, with 2 GiB of address space: a load or tokenize that never returns (it
# appends token 0 until memory runs out) ends there, not in the test run
RWKV_VOCABS = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
import llamaprompt
out = {}
for name, path in json.loads(sys.argv[1]).items():
    try:
        out[name] = llamaprompt.ChatTemplate.from_gguf(path).tokenize("ab\n\na").tolist()
    except llamaprompt.GGUFError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_rwkv_vocab_whose_tokenizer_never_returns_raises(tmp_path):
    # llm_tokenizer_rwkv_session::tokenize, at a byte that begins a token but is no token alone,
    # finds no token, goes back to where the last one ended and loops for ever; loading tokenizes
    # "\n", so a vocab with "\n\n" and no "\n" never loaded
    src = vocab_gguf(SPM)
    S, A = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    vocabs = {
        "ok": ["a", "b", "ab", "\\n", "\\n\\n"],  # the longest match: "ab", "\n\n", "a"
        "hex": ["\\x61b", "\\x61", "b", "\\n"],  # \x61 is "a": "ab", "\n", "\n", "a"
        "ab": ["ab", "b"],  # tokenize("a") never returned
        "newline": ["a", "\\n\\n"],  # the load never returned
        "hex-ab": ["\\x61b", "b"],
    }
    paths = {}
    for name, tokens in vocabs.items():
        paths[name] = str(tmp_path / f"{name}.gguf")
        reader = gguf.GGUFReader(src, "r")
        writer = gguf.GGUFWriter(paths[name], arch=reader.get_field(gguf.Keys.General.ARCHITECTURE).contents())
        changes = {
            "tokenizer.ggml.model": MetadataDetails(S, "rwkv"),
            "tokenizer.ggml.tokens": MetadataDetails(A, tokens, sub_type=S),
        }
        copy_with_new_metadata(reader, writer, changes, ["tokenizer.ggml.scores", "tokenizer.ggml.token_type"])
    proc = subprocess.run(
        [sys.executable, "-c", RWKV_VOCABS, json.dumps(paths)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["ok"] == [2, 4, 0] and out["hex"] == [0, 3, 3, 1]
    for name, byte in (("ab", "0x61"), ("newline", "0x0a"), ("hex-ab", "0x61")):
        assert "RWKV" in out[name] and f"byte {byte} but no token of that byte alone" in out[name], out[name]


def test_gguf_metadata_takes_an_int_array_limit():
    # an int (numpy's too; past 2**63 it is no limit); another type is a TypeError (the trial of
    # session 55: 1.5 was taken as 1, a 2**76 from `inspect --max-array-items` a pybind11
    # signature dump)
    path = vocab_gguf(SPM)
    assert llamaprompt.gguf_metadata(path, max_array_items=np.int64(1))["tokenizer.ggml.tokens"]["length"] == 32000
    assert len(llamaprompt.gguf_metadata(path, max_array_items=10**23)["tokenizer.ggml.tokens"]) == 32000
    for bad in (1.5, "3", True, None):
        with pytest.raises(TypeError, match="max_array_items must be an int"):
            llamaprompt.gguf_metadata(path, max_array_items=bad)


def test_a_vocab_without_a_byte_token_its_tokenizer_looks_up_is_a_gguf_error(tmp_path):
    # SPM falls back to byte tokens ("<0x0A>" for a newline) and looks them up with
    # unordered_map::at: a file whose "<0x0A>" is renamed loads, and tokenizing a newline is a
    # GGUFError with the lookup's message (the trial of session 55: TemplateError, the template's
    # class, saying only "unordered_map::at")
    S, A = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    src = vocab_gguf(SPM)
    tokens = list(_field(src, "tokenizer.ggml.tokens"))
    tokens[tokens.index("<0x0A>")] = "<0xZZ>"
    path = _rewrite_kv(src, tmp_path / "nobyte.gguf", {"tokenizer.ggml.tokens": MetadataDetails(A, tokens, sub_type=S)})
    t = llamaprompt.ChatTemplate.from_gguf(path)
    assert len(t.tokenize("hi")) > 0
    with pytest.raises(llamaprompt.GGUFError, match="unordered_map::at") as info:
        t.tokenize("a\nb")
    assert "vocab" in info.value.message
