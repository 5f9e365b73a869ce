"""Probe a llama.cpp source tree and prepare what llamaprompt compiles from it.

Run by CMakeLists.txt at configure time (standard library only):

    python third_party/adapt_tree.py TREE OUT_DIR [--no-engine-rewrites]

It decides by what the tree *has* (files, declarations, exact call sites), never by a
version number, and fails loudly -- exit status 1, naming the file and the text -- rather
than let the build compile something that behaves differently:

* features: which optional upstream pieces exist (the `supports_reasoning_effort` cap,
  `thinking_end_tags` vs `thinking_end_tag`, `message_delimiters`, the server's request
  schema, llama.cpp's JSON wrapper ...). Written as macros to OUT_DIR/generated/lp_tree.h
  and as JSON (``llamaprompt.features``).
* rewrites: the few call sites renamed in build-tree copies of upstream files (the rest of
  each file is byte for byte upstream's). Each pattern must occur exactly as often as
  stated. A rewrite whose target is missing is skipped, with a message saying what is lost,
  only when the tree lacks what it guards altogether; if the guarded code is there but the
  pattern has moved, configuration fails.
* engine rewrites: behaviour-preserving edits of llama.cpp's Jinja engine, for speed only
  (docs/performance.md lists each with its measured gain). Each is optional -- a tree where
  its pattern is not found exactly as stated builds without it, with a message -- and
  ``--no-engine-rewrites`` (CMake: LLAMAPROMPT_ENGINE_REWRITES=OFF) leaves them all out:
  the unmodified engine, for the differential run (benchmarks/engine_differential.py).
* handler copies: the bodies of llama-server's POST /tokenize and /detokenize handlers
  (tools/server/server-context.cpp), copied to OUT_DIR/generated/lp_post_*.inc for
  src/cpp/server_tokenize.cpp, after checking that they use nothing of the server but the vocab
  (configuration fails naming the handler and the text otherwise).
* drift checks: upstream logic that llamaprompt's own code restates (how llama-server
  fills ``server_chat_params``, the flags whose handlers exit, the vocab conditions that
  llama.cpp asserts, the fields the parser-inputs key covers, the prompt-only path's
  first step). The restated text must still be in the tree, else configuration fails.

OUT_DIR/lp_tree.cmake receives the extra upstream sources to compile and the messages.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC_CPP = HERE.parent / "src" / "cpp"


class TreeError(Exception):
    """The tree cannot be built faithfully: the message names the file and the text."""


def norm(text: str) -> str:
    """Whitespace-insensitive form of C++ text (for comparing restated code)."""
    return re.sub(r"\s+", " ", text).strip()


@dataclass
class Tree:
    root: Path
    # every file of the tree a probe found or read: an offline sdist must carry them all, since
    # a file it lacked would change what the probes decide (third_party/sdist_tree.py)
    inputs: set[str] = field(default_factory=set)
    # _program_texts(): the sources that include common/jinja/value.h, comments and literals blanked
    program_texts: list[tuple[str, str]] | None = field(default=None, repr=False, compare=False)

    def has(self, rel: str) -> bool:
        found = (self.root / rel).is_file()
        if found:
            self.inputs.add(rel)
        return found

    def read(self, rel: str) -> str:
        path = self.root / rel
        if not path.is_file():
            raise TreeError(f"{rel}: missing from the llama.cpp tree at {self.root}")
        self.inputs.add(rel)
        return path.read_text(encoding="utf-8", errors="surrogateescape")

    def contains(self, rel: str, text: str) -> bool:
        return self.has(rel) and norm(text) in norm(self.read(rel))

    def search(self, rel: str, pattern: str) -> re.Match | None:
        return re.search(pattern, self.read(rel)) if self.has(rel) else None


# ---------------------------------------------------------------------------
# features
# ---------------------------------------------------------------------------


def probe_features(tree: Tree) -> dict[str, dict]:
    """Each feature: present (bool) and what it is, for llamaprompt.features."""
    f: dict[str, dict] = {}

    def add(name: str, present: bool, what: str) -> None:
        f[name] = {"present": bool(present), "what": what}

    add("common_json", tree.has("common/json.h"),
        "common/json.h: llama.cpp's JSON wrapper common_json (older trees use nlohmann::ordered_json)")
    add("caps_reasoning_effort", tree.search("common/jinja/caps.h", r"bool\s+supports_reasoning_effort\b"),
        "common/jinja/caps.h: jinja::caps::supports_reasoning_effort (the 9th chat_template_caps key)")
    tags = tree.search("common/chat.h", r"std::vector<std::string>\s+thinking_end_tags\s*;")
    tag = tree.search("common/chat.h", r"std::string\s+thinking_end_tag\s*;")
    if not tags and not tag:
        raise TreeError("common/chat.h: common_chat_params has neither 'std::vector<std::string> thinking_end_tags;' "
                        "nor 'std::string thinking_end_tag;'")
    add("thinking_end_tags", tags,
        "common/chat.h: common_chat_params::thinking_end_tags (a list; older trees have one thinking_end_tag)")
    add("message_delimiters", tree.search("common/chat.h", r"common_chat_msg_delimiters\s+message_delimiters\s*;"),
        "common/chat.h: common_chat_params::message_delimiters")
    schema = tree.has("tools/server/server-schema.cpp")
    add("server_schema", schema,
        "tools/server/server-schema.cpp: server_schema::eval_llama_cmpl_schema (request -> task parameters)")
    if schema:
        decl = tree.search("tools/server/server-schema.h", r"task_params\s+eval_llama_cmpl_schema\s*\(([^;]*)\)\s*;")
        if not decl:
            raise TreeError("tools/server/server-schema.h: no declaration 'task_params eval_llama_cmpl_schema(...);'")
        slot = "n_ctx_slot" in decl.group(1)
        task = False
    else:
        decl = tree.search("tools/server/server-task.h",
                           r"static\s+task_params\s+params_from_json_cmpl\s*\(([^;]*)\)\s*;")
        slot = bool(decl) and "n_ctx_slot" in decl.group(1)
        task = bool(decl)
    add("cmpl_schema_n_ctx_slot", slot, "the request-schema function takes an n_ctx_slot argument")
    add("server_task_params", task,
        "tools/server/server-task.h: server_task::params_from_json_cmpl (before server-schema.cpp existed)")
    parse_sources = ["tools/server/server-task.cpp", "tools/server/server-chat.cpp"]
    add("parse", (schema or task) and all(tree.has(s) for s in parse_sources),
        "parse of model output as llama-server does (request schema + task_result_state)")
    const_exec = tree.search("common/jinja/runtime.h",
                             r"virtual\s+value\s+execute_impl\s*\(\s*context\s*&\s*\w*\)\s*const")
    add("const_execution", const_exec,
        "common/jinja/runtime.h: const template execution (older trees' execution changes the parsed template, "
        "e.g. filter_statement moves its filter: renders of one template are then serialized)")
    add("vocab_test_tokenizer", tree.contains("src/llama-vocab.cpp", 'tokenizer_model == "test"'),
        "src/llama-vocab.cpp: the 'test' tokenizer")
    add("template_inputs", all(tree.contains("common/chat.cpp", t) for t in TEMPLATE_INPUTS_SITES)
        and tree.search("common/jinja/value.h", r"std::string\s+value_to_json\s*\(\s*const\s+value\s*&")
        and tree.search("common/jinja/runtime.h", r"\bvalue_object\s+env\s*;"),
        "common/chat.cpp: common_chat_template_direct_apply_impl sets the Jinja context (global_from_json) and "
        "renders it; common/jinja/value.h: value_to_json; common/jinja/runtime.h: jinja::context's "
        "'value_object env;' (the capture points of ChatTemplate.template_inputs)")
    add("common_log", common_log_routable(tree),
        "common/log.h: LOG_TMPL as `do { if ((verbosity) <= common_log_get_verbosity_thold()) { "
        "common_log_add(common_log_main(), (level), __VA_ARGS__); } } while (0)` (src/cpp/lp_common_log.h "
        "restates it with its call replaced: LOG_INF / LOG_WRN / LOG_ERR of the chat code reach Python's logging)")
    return f


# common/log.h's LOG_TMPL, the macro every LOG_* expands to, as src/cpp/lp_common_log.h restates
# it (whitespace aside): only then is the restatement's one difference its call
COMMON_LOG_TMPL = re.compile(
    r"#define\s+LOG_TMPL\(level,\s*verbosity,\s*\.\.\.\)\s*\\\s*do\s*\{\s*\\\s*"
    r"if\s*\(\(verbosity\)\s*<=\s*common_log_get_verbosity_thold\(\)\)\s*\{\s*\\\s*"
    r"common_log_add\(common_log_main\(\),\s*\(level\),\s*__VA_ARGS__\);\s*\\\s*"
    r"\}\s*\\\s*\}\s*while\s*\(0\)\s*\n")


def common_log_routable(tree: Tree) -> bool:
    """Whether common/log.h defines LOG_TMPL once, exactly as lp_common_log.h restates it, with
    the LOG_ATTRIBUTE_FORMAT and LOG_LEVEL_INFO it uses."""
    if not tree.has("common/log.h"):
        return False
    text = tree.read("common/log.h")
    return (len(COMMON_LOG_TMPL.findall(text)) == 1 and len(re.findall(r"#define\s+LOG_TMPL\b", text)) == 1
            and bool(re.search(r"#\s*define\s+LOG_ATTRIBUTE_FORMAT\(", text))
            and bool(re.search(r"#define\s+LOG_LEVEL_INFO\b", text)))


# where common_chat_template_direct_apply_impl hands its context to the Jinja engine, and
# where it has the render's output (before BOS/EOS stripping)
TEMPLATE_INPUTS_SITES = (
    "jinja::global_from_json(ctx, inp, inputs.mark_input);",
    "std::string result = parts->as_string().str();",
)


# features whose absence means llamaprompt gives less on this tree (the others only say which
# shape of an upstream interface the bindings compile for)
LOSSES = ["caps_reasoning_effort", "thinking_end_tags", "message_delimiters", "parse", "const_execution",
          "template_inputs", "common_log", "serve_tokenize"]


# ---------------------------------------------------------------------------
# rewrites
# ---------------------------------------------------------------------------


@dataclass
class Edit:
    old: str
    new: str
    count: int = 1
    # (file, text): the code this edit guards; when absent from the tree the edit is skipped
    requires: tuple[str, str] | None = None
    lost: str = ""  # what a tree without it loses (the configure message)
    # an engine rewrite (docs/performance.md): behaviour-preserving, for speed only -- what it
    # saves. Optional: a tree without the pattern (or with it a different number of times)
    # builds without it; LLAMAPROMPT_ENGINE_REWRITES=OFF builds without any (the differential run)
    speed: str = ""
    group: str = ""  # engine rewrites of one group apply together or not at all


@dataclass
class Rewrite:
    rel: str  # upstream file
    out: str  # generated copy's name ("": a header, in generated/mirror/<rel>)
    edits: list[Edit]


# jinja::context's copy constructor and get_val as the engine rewrites of runtime.h make them
# (the scope_chain rewrite applies to these texts)
CONTEXT_COPY = """    context(const context & parent)
        : src(parent.src), current_time(parent.current_time), is_get_stats(parent.is_get_stats),
          env(mk_val<value_object>(*parent.env)) {
        // inherit variables (for example, when entering a new scope): the parent's, in its order
        // (which begins with the constants every scope defines), copied without re-inserting each
        env->stats = value_t::stats_t();
    }
"""
CONTEXT_GET_VAL = """    value get_val(const std::string & name) {
        // the variable, or `undefined` (built only for a missing name): env is a plain object.
        // The key is the one-part string value that mk_val<value_string>(name) builds, kept per
        // thread and given the name's text (the lookup only hashes and compares it)
        static thread_local const value key = mk_val<value_string>(std::string());
        auto & parts = static_cast<value_string_t &>(*key).val_str.parts;
        parts.resize(1);
        parts[0].is_input = false;
        parts[0].val.assign(name);
        auto it = env->unordered.find(key);
        return it != env->unordered.end() ? it->second : mk_val<value_undefined>(name);
    }
"""


OBJECT_INSERT = "object insert: the key hashed once, not twice"
SCOPE_CHAIN = ("new scope (each for loop, macro call, call block): reads its parent's variables through it "
               "instead of copying them")
SCOPE_OBJECT = """// llamaprompt (the scope_chain engine rewrite, see its adapt_tree.py): a scope's variables --
// those it set itself, over those of the scope it was made from. Only jinja::context's env holds
// one: no template value is of this type (value.h's type tests by typeid never see it), and what
// prints the variables prints a plain object of them (llamaprompt_all_vars). The loop object's
// refill (runtime.cpp) checks for it
#define LLAMAPROMPT_SCOPE_CHAIN 1
struct llamaprompt_scope_object final : value_object_t {
    value_object parent;  // the variables of the scope this one was made from; null: none
    std::size_t depth = 0;  // how many scopes the chain from this one has (up to a plain object)
    // a longer chain would make each lookup of an outer variable walk it (deep recursion, call
    // blocks that call callers kept from earlier ones): a scope made there copies its parent's
    // variables instead, as upstream's every scope did, and starts a new chain
    static constexpr std::size_t max_depth = 8;
    // the scope object that `vars` is; null for a plain object (a first scope, or a context made
    // by code compiled without this rewrite): it has no parent
    static const llamaprompt_scope_object * of(const value_object_t & vars) {
        return typeid(vars) == typeid(llamaprompt_scope_object) ? static_cast<const llamaprompt_scope_object *>(&vars)
                                                                : nullptr;
    }
    // the variables a lookup reads after those of `vars`: its parent's; null: none
    static const value_object_t * up(const value_object_t & vars) {
        const auto * scope = of(vars);
        return scope ? scope->parent.get() : nullptr;
    }
#ifdef LLAMAPROMPT_INSERT_PLAIN
    // a plain object's insert (value.h's object_insert rewrite): this type overrides nothing else
    using value_object_t::insert;
    void insert(const value & key, const value & val) override {
        if (is_immutable()) {
            throw std::runtime_error("Attempting to modify immutable type");
        }
        llamaprompt_insert_plain(key, val);
    }
#endif
};

"""


# for_statement's `loop` object (the loop_object engine rewrite below)
LOOP_KEYS = ("index", "index0", "revindex", "revindex0", "first", "last", "length", "previtem", "nextitem")
LOOP_OBJECT = "for loop: the loop object's keys built once per loop, its entries reserved"
LOOP_OBJECT_INSERTS = """        value_object loop_obj = mk_val<value_object>();
        loop_obj->has_builtins = false; // loop object has no builtins
        loop_obj->insert("index", mk_val<value_int>(i + 1));
        loop_obj->insert("index0", mk_val<value_int>(i));
        loop_obj->insert("revindex", mk_val<value_int>(filtered_items.size() - i));
        loop_obj->insert("revindex0", mk_val<value_int>(filtered_items.size() - i - 1));
        loop_obj->insert("first", mk_val<value_bool>(i == 0));
        loop_obj->insert("last", mk_val<value_bool>(i == filtered_items.size() - 1));
        loop_obj->insert("length", mk_val<value_int>(filtered_items.size()));
        loop_obj->insert("previtem", i > 0 ? filtered_items[i - 1] : mk_val<value_undefined>("previtem"));
""" + (
    '        loop_obj->insert("nextitem", i < filtered_items.size() - 1 ? filtered_items[i + 1] : '
    'mk_val<value_undefined>("nextitem"));\n')


def _loop_object_inserts_with_keys() -> str:
    """LOOP_OBJECT_INSERTS with the keys taken from `loop_keys` and the entry list reserved."""
    text = LOOP_OBJECT_INSERTS.replace("// loop object has no builtins\n",
                                       "// loop object has no builtins\n        loop_obj->val_obj.reserve(9);\n")
    for n, key in enumerate(LOOP_KEYS):
        text = text.replace(f'loop_obj->insert("{key}", ', f"loop_obj->insert(loop_keys[{n}], ", 1)
    return text


LOOP_KEYS_BUILT = ("    std::vector<value> loop_keys;\n    if (!filtered_items.empty()) loop_keys = {"
                   + ", ".join(f'mk_val<value_string>("{k}")' for k in LOOP_KEYS) + "};\n")
LOOP_ITERATION = ("    for (size_t i = 0; i < filtered_items.size(); i++) {\n"
                  '        JJ_DEBUG("For loop iteration %zu/%zu", i + 1, filtered_items.size());\n')
LOOP_SET = '        scope.set_val("loop", loop_obj);\n'
# the loop_object rewrite's iteration head, from the keys to `loop` set in the scope: the text
# the loop_reuse rewrite replaces (after loop_object's edits, which it needs)
LOOP_REUSE_OLD = LOOP_KEYS_BUILT + LOOP_ITERATION + _loop_object_inserts_with_keys() + LOOP_SET
LOOP_REUSE = "for loop: the loop object refilled in place when nothing but the loop's scope holds it"


def _loop_reuse_new() -> str:
    """LOOP_REUSE_OLD with the previous iteration's loop object refilled when only the scope
    holds it (its `loop` entry: two references, and the loop's own), else built as before."""
    inserts = _loop_object_inserts_with_keys()
    values = [line.split(", ", 1)[1].rsplit(");", 1)[0] for line in inserts.splitlines() if "loop_obj->insert(" in line]
    assert len(values) == len(LOOP_KEYS)
    build = "".join("    " + line + "\n" for line in inserts.splitlines())
    build = build.replace("value_object loop_obj = mk_val<value_object>();", "loop_obj = mk_val<value_object>();", 1)
    declare = (
        "    // llamaprompt (an engine rewrite, see its adapt_tree.py): the previous iteration's loop\n"
        "    // object and where its map keeps each value, while it may be refilled\n"
        "    value_object llamaprompt_loop;\n"
        "    value * llamaprompt_loop_slots[9] = {};\n")
    refill = """        value_object loop_obj;
        // refilled only when no one else can see it: referenced by the scope's `loop` (its map and
        // list) and llamaprompt_loop alone, with its nine keys as built (objects only grow; a
        // template that added a key or rebound `loop` gets a new object, as every iteration did)
        bool llamaprompt_refill = llamaprompt_loop && !scope.is_get_stats && llamaprompt_loop.use_count() == 3 &&
                                  llamaprompt_loop->val_obj.size() == 9 && llamaprompt_loop->unordered.size() == 9;
        for (size_t k = 0; llamaprompt_refill && k < 9; ++k) {
            llamaprompt_refill = llamaprompt_loop->val_obj[k].first == loop_keys[k];
        }
#ifdef LLAMAPROMPT_SCOPE_CHAIN  // (runtime.h's scope_chain rewrite) nor a scope made from this one
        llamaprompt_refill = llamaprompt_refill && !scope.llamaprompt_vars_shared();
#endif
        if (llamaprompt_refill && scope.get_val("loop") == llamaprompt_loop) {
            loop_obj = llamaprompt_loop;
            value entries[9] = {VALUES};
            for (size_t k = 0; k < 9; ++k) {
                loop_obj->val_obj[k].second = entries[k];
                *llamaprompt_loop_slots[k] = std::move(entries[k]);
            }
        } else {
""".replace("VALUES", ", ".join(values))
    remember = """            llamaprompt_loop = nullptr;
            if (!scope.is_get_stats) {
                llamaprompt_loop = loop_obj;
                for (size_t k = 0; k < 9; ++k) {
                    llamaprompt_loop_slots[k] = &loop_obj->unordered.find(loop_keys[k])->second;
                }
            }
        }
"""
    return LOOP_KEYS_BUILT + declare + LOOP_ITERATION + refill + build + "    " + LOOP_SET + remember


# loops of value.cpp's built-ins that run long without a statement step (the Edits of value.cpp)
SLICE_PUSH = """        if (i >= 0 && i < len) {
            result.push_back(array[static_cast<size_t>(i)]);
"""
SPLIT_ERASE = "                str.erase(0, pos + delim.length());\n"
INDENT_LINE = """                if ((indented.empty() ? first : (!line.empty() || blank))) {
                    indented += indent;
"""


# the stack guard (jinja_guard.h) in the engine's recursions over values, which statement
# execution does not reach: a list that contains itself, or one nested ~10^5 deep
VALUE_RECURSION_GUARD = ("    ::llamaprompt::jinja_guard_step();"
                         "  // llamaprompt: values nested in themselves recurse here\n")
JSON_OF_VALUE = ("static void value_to_json_internal(std::ostringstream & oss, const value & val, int curr_lvl, "
                 "int indent, const std::string_view item_sep, const std::string_view key_sep) {\n")
REPR_OF_VALUE = "std::string value_to_string_repr(const value & val) {\n"
# json-schema-to-grammar.cpp's _visit_pattern copied the converter's whole rule table before each
# pattern, to put it back if the pattern turns out unsupported or invalid: a schema with n
# patterned properties copied ~n^2/2 rules (4,000 patterns: ~8 million string pairs, most of a
# request's 5.7 s). Between the copy and a revert only _add_rule writes to the table, and it
# either inserts a key that was missing or assigns a key the value it already holds: putting the
# table back is erasing the keys inserted since. _add_rule's two assignments now note the keys
# they insert while a pattern converts (llamaprompt_put_rule), and a revert erases them -- the same
# table after, key for key and value for value (a std::map: no order of insertion to keep).
SCHEMA_RULES_DECL = "    std::map<std::string, std::string> _rules;\n"
SCHEMA_RULES_JOURNAL = """    // llamaprompt (a speed rewrite, see its adapt_tree.py): the keys _add_rule inserts
    // while a pattern converts, so that a revert erases them instead of restoring a copy of
    // every rule
    std::vector<std::string> * llamaprompt_added = nullptr;
    void llamaprompt_put_rule(const std::string & key, const std::string & rule) {  // _rules[key] = rule
        auto inserted = _rules.try_emplace(key, rule);
        if (!inserted.second) {
            inserted.first->second = rule;
        } else if (llamaprompt_added != nullptr) {
            llamaprompt_added->push_back(key);
        }
    }
    struct llamaprompt_rules_journal {  // the keys inserted while it lives (a journal within one passes them on)
        common_chat_schema_converter & self;
        std::vector<std::string> * const outer;
        std::vector<std::string> added;
        explicit llamaprompt_rules_journal(common_chat_schema_converter & c) : self(c), outer(c.llamaprompt_added) {
            self.llamaprompt_added = &added;
        }
        ~llamaprompt_rules_journal() {
            self.llamaprompt_added = outer;
            if (outer != nullptr) {
                outer->insert(outer->end(), added.begin(), added.end());
            }
        }
        void revert() {  // the table as it was when the journal began
            for (const auto & key : added) {
                self._rules.erase(key);
            }
            added.clear();
        }
    };
"""
SCHEMA_SNAPSHOT = "        auto rules_snapshot = _rules;\n"
SCHEMA_JOURNAL = ("        llamaprompt_rules_journal llamaprompt_journal(*this);"
                  "  // llamaprompt: not a copy of every rule\n")
SCHEMA_RESTORE = "            _rules = std::move(rules_snapshot);\n"
SCHEMA_REVERT = "            llamaprompt_journal.revert();\n"
SCHEMA_SNAPSHOT_SPEED = ("JSON schema patterns: a revert erases the rules the pattern added, not a copy of the "
                         "whole rule table per pattern")
SCHEMA_ADD_RULE = "    std::string _add_rule(const std::string & name, const std::string & rule) {\n"
SCHEMA_VISIT_PATTERN = "    std::string _visit_pattern(const std::string & pattern, const std::string & name) {\n"
SCHEMA_GUARD = "        llamaprompt_schema_step();  // llamaprompt: the call's time budget\n"
# _pattern_to_rule's loop over the pattern's characters: `^a****...$` rebuilds the sequence's last
# item at each `*` (quadratic: 600,000 took 45 s against a 1 s budget); every 256 characters
SCHEMA_PATTERN_LOOP = "            while (i < length) {\n                char c = sub_pattern[i];\n"
SCHEMA_PATTERN_TICK = ("            while (i < length) {\n                llamaprompt_schema_tick();"
                       "  // llamaprompt: the call's time budget\n                char c = sub_pattern[i];\n")
# the optional properties of an object: each of the n suffixes recursed n levels deep, each level
# copying the names left (1,024 names of 10,000 bytes: 16 s past a 2 s budget, 5 GB)
SCHEMA_RECURSIVE_REFS = ("get_recursive_refs = [&](const std::vector<std::string> & ks, bool first_is_optional) {\n"
                         "                std::string res;\n")
SCHEMA_RECURSIVE_REFS_STEP = SCHEMA_RECURSIVE_REFS.replace(
    "                std::string res;\n",
    "                llamaprompt_schema_step();  // llamaprompt: the call's time budget\n"
    "                std::string res;\n")
# The same, rewritten (an engine rewrite, a group): each level took a copy of the names left, and
# each of the n suffixes recomputed the rules of every shorter suffix, which the first suffix had
# already added -- _add_rule gives a name and text it already holds the same name back, and nothing
# else adds rules between -- so the work and memory were O(n^2) names. Now a level reads the
# optional properties from an index, and the text for the suffix from index i (with its first
# property optional) is kept the first time it is made and returned after: the same rules, names
# and text. The time budget's step stays at each level run.
OPTIONAL_REFS = "an object's optional properties: each suffix's rules made once, no copies of the names left"
OPTIONAL_REFS_HEAD = ("std::function<std::string(const std::vector<std::string> &, bool)> get_recursive_refs = "
                      "[&](const std::vector<std::string> & ks, bool first_is_optional) {\n")
OPTIONAL_REFS_HEAD_NEW = ("std::vector<std::string> llamaprompt_rest_refs(optional_props.size());"
                          "  // llamaprompt: an engine rewrite (adapt_tree.py)\n"
                          "            std::function<std::string(size_t, bool)> get_recursive_refs = "
                          "[&](size_t llamaprompt_from, bool first_is_optional) {\n")
OPTIONAL_REFS_FIRST = ("                if (ks.empty()) {\n                    return res;\n                }\n"
                       "                const std::string& k = ks[0];\n")
OPTIONAL_REFS_FIRST_NEW = """                if (llamaprompt_from >= optional_props.size()) {
                    return res;
                }
                if (first_is_optional && !llamaprompt_rest_refs[llamaprompt_from].empty()) {
                    return llamaprompt_rest_refs[llamaprompt_from];
                }
                const std::string& k = optional_props[llamaprompt_from];
"""
OPTIONAL_REFS_REST = """                if (ks.size() > 1) {
                    res += " " + _add_rule(
                        name + (name.empty() ? "" : "-") + k + "-rest",
                        get_recursive_refs(std::vector<std::string>(ks.begin() + 1, ks.end()), true)
                    );
                }
                return res;
"""
OPTIONAL_REFS_REST_NEW = """                if (optional_props.size() - llamaprompt_from > 1) {
                    res += " " + _add_rule(
                        name + (name.empty() ? "" : "-") + k + "-rest",
                        get_recursive_refs(llamaprompt_from + 1, true)
                    );
                }
                if (first_is_optional) {
                    llamaprompt_rest_refs[llamaprompt_from] = res;
                }
                return res;
"""
OPTIONAL_REFS_CALL = ("get_recursive_refs(std::vector<std::string>(optional_props.begin() + i, optional_props.end()), "
                      "false)")
# rule names: regex_replace(name, "[^a-zA-Z0-9-]+", "-") -- libstdc++'s matcher recurses once per
# character of a match, so a tool, property or $ref name of ~30,000 such characters overflowed the
# stack (SIGSEGV, found by the fresh-user trial); llamaprompt_rule_chars replaces each maximal run
# of those characters by "-" in a loop: the same text
SCHEMA_RULE_NAME = "regex_replace(name, INVALID_RULE_CHARS_RE, \"-\")"
# visit() recursed once per level of the schema -- and once more per $ref it resolves: a chain of
# 5,000 $defs, each an array of the next (6 levels of JSON, under the request's nesting limit),
# overflowed the stack (SIGSEGV, found by the fresh-user trial). The stack guard at each visit, before
# its rule name (the pinned tree's visit takes a parsed schema, older trees' the JSON: that line is
# in both)
SCHEMA_VISIT_LINE = ('        std::string rule_name = is_reserved_name(name) ? name + "-" : '
                     'name.empty() ? "root" : name;\n')
SCHEMA_BUILD_NODE = "    common_chat_schema_ptr build_node(const common_json & schema, const std::string & path) {\n"
SCHEMA_NESTING_GUARD = "        llamaprompt_schema_nesting();  // llamaprompt: the stack guard\n"
SCHEMA_VISIT_GUARD = "        llamaprompt_schema_visit();  // llamaprompt: the stack guard and the time budget\n"
SCHEMA_REF_NAME = "std::regex_replace(ref_fragment, nonalphanumeric_regex, \"-\")"
TOJSON_INDENT_GUARD = ("    llamaprompt_json_indent_guard(oss, curr_lvl, indent);"
                       "  // llamaprompt: the size budget, before the indentation is written\n")
MARK_USED = "void value_t::stats_t::mark_used(value & val, bool deep) {\n"  # the capability probes' usage marks
OUTPUT_OF_VALUE = "static void gather_string_parts_recursive(const value & val, value_string & parts) {\n"
# destroying a value released its elements recursively (each shared_ptr's last release runs the
# element's destructor, which releases its own): a list nested ~10^5 deep -- a loop of
# `{% set ns.l = [ns.l] %}` -- overflowed the stack when the render's values were destroyed, where
# no guard can throw. ~value_t now hands its elements to one worklist per thread, drained by the
# outermost destruction: the same values released, iteratively.
VALUE_DTOR = "    virtual ~value_t() = default;\n"
VALUE_DECL = "struct value_t {\n"
VALUE_DTOR_BODY = ("    virtual ~value_t() { if (!val_arr.empty() || !val_obj.empty()) "
                   "llamaprompt_release_children(val_arr, val_obj); }\n")
RELEASE_CHILDREN_DECL = """// llamaprompt (a robustness rewrite, see its adapt_tree.py): value_t's destructor hands the
// elements of a value to llamaprompt_release_children (defined after value_t)
inline void llamaprompt_release_children(std::vector<value> & arr,
                                         std::vector<std::pair<value, value>> & obj) noexcept;

"""
AFTER_VALUE_T = "const func_builtins & global_builtins();\n"  # the first declaration after struct value_t
RELEASE_CHILDREN = """// llamaprompt (a robustness rewrite, see its adapt_tree.py): the elements of a value that would
// release elements of their own when released here (the last owner of a non-empty list or object)
// go through one worklist per thread, drained by the outermost destruction, not recursively
inline bool llamaprompt_releases_more(const value & v) noexcept {
    return v && v.use_count() == 1 && (!v->val_arr.empty() || !v->val_obj.empty());
}
inline void llamaprompt_release_children(std::vector<value> & arr,
                                         std::vector<std::pair<value, value>> & obj) noexcept {
    std::size_t nested = 0;
    for (const auto & v : arr) {
        nested += llamaprompt_releases_more(v);
    }
    for (const auto & kv : obj) {
        nested += llamaprompt_releases_more(kv.first) + llamaprompt_releases_more(kv.second);
    }
    if (nested == 0) {
        return;  // the members release their elements as before: none of them goes deeper
    }
    static thread_local std::vector<value> * draining = nullptr;
    std::vector<value> own;
    std::vector<value> & work = draining ? *draining : own;
    try {
        work.reserve(work.size() + nested);
    } catch (...) {
        return;  // no memory for the worklist: the members release their elements as before
    }
    for (auto & v : arr) {
        if (llamaprompt_releases_more(v)) {
            work.push_back(std::move(v));
        }
    }
    for (auto & kv : obj) {
        if (llamaprompt_releases_more(kv.first)) {
            work.push_back(std::move(kv.first));
        }
        if (llamaprompt_releases_more(kv.second)) {
            work.push_back(std::move(kv.second));
        }
    }
    if (draining) {
        return;  // the outermost destruction releases them
    }
    draining = &own;
    while (!own.empty()) {
        value v = std::move(own.back());
        own.pop_back();
        v.reset();  // may hand its own elements to `own`
    }
    draining = nullptr;
}

"""

# A syntax tree is released node by node through std::unique_ptr<statement>, each node's destructor
# releasing its children: a recursion as deep as the tree, which no guard can stop. The parser
# builds a chain of binary operators (`1 + 1 + ...`), filters or member accesses iteratively, so
# a template of 20,000 terms in a branch never taken parsed and rendered, then killed the process
# when it was freed (SIGSEGV; 10^6 terms on an 8 MiB stack, and llama-server too). The deleter of
# `statement` (std::default_delete<jinja::statement>, specialized right after the forward
# declaration: an empty class as before, so no layout changes) now hands a node to one worklist
# per thread, drained by the outermost release: the same nodes deleted, iteratively.
STATEMENT_FWD = "struct statement;\nusing statement_ptr = std::unique_ptr<statement>;\n"
STATEMENT_DELETER = """struct statement;
// llamaprompt (a robustness rewrite, see its adapt_tree.py): a syntax tree is released through
// one worklist per thread (llamaprompt_release_statement, defined after struct statement)
void llamaprompt_release_statement(statement * p) noexcept;
}  // namespace jinja
namespace std {
template <> struct default_delete<jinja::statement> {
    constexpr default_delete() noexcept = default;
    template <typename U, typename = std::enable_if_t<std::is_convertible_v<U *, jinja::statement *>>>
    default_delete(const default_delete<U> &) noexcept {}
    void operator()(jinja::statement * p) const noexcept { jinja::llamaprompt_release_statement(p); }
};
}  // namespace std
namespace jinja {
using statement_ptr = std::unique_ptr<statement>;
"""
STATEMENT_END = """    [[noreturn]] void throw_exec_error() const {
        throw std::runtime_error("cannot exec " + type());
    }
};
"""
RELEASE_STATEMENT = """
// llamaprompt (a robustness rewrite, see its adapt_tree.py): the nodes that deleting `p` releases
// (its children, through this deleter) go through one worklist per thread, drained by the
// outermost release, not recursively
inline void llamaprompt_release_statement(statement * p) noexcept {
    static thread_local std::vector<statement *> * draining = nullptr;
    if (p == nullptr) {
        return;
    }
    if (draining) {
        try {
            draining->push_back(p);
            return;
        } catch (...) {
            delete p;  // no memory for the worklist: released here, as before
            return;
        }
    }
    std::vector<statement *> own;
    draining = &own;
    delete p;  // may hand its children to `own`
    while (!own.empty()) {
        statement * q = own.back();
        own.pop_back();
        delete q;
    }
    draining = nullptr;
}
"""
# values compared or hashed recursed once per nesting level (is_hashable, ==, a dict key's hash),
# unguarded: a tuple nested ~5,000 deep -- a loop of `{% set ns.t = ({'a': ns.t}.items()|first) %}`
# -- compared with `==` or used as a dict key killed the process on a 256 KiB thread, and each
# comparison level re-walked the whole tuple (quadratic) with no time check in between. is_hashable
# and equality of lists and tuples pass the stack guard (stack and time budget); a hash, which is
# noexcept, leaves out what lies deeper than HASH_DEPTH levels below the value hashed -- a function of
# the value alone, so equal values still hash equal: the same keys found, the same order of entries
# (kept in the object's ordered list), only the buckets of such deep keys differ.
HASH_DEPTH = 256
VALUE_COMPARE_LOST = ("a tuple nested ~5,000 deep compared with == or used as a dict key overflows the stack "
                      "(the process dies)")
VALUE_H_TOP = "#pragma once\n"
VALUE_H_GUARD_DECL = f"""#pragma once
namespace llamaprompt {{ void jinja_guard_step(); }}  // llamaprompt: jinja_guard.h
// llamaprompt (a robustness rewrite, see its adapt_tree.py): unique_hash of a list, tuple or object
// counts its levels on this thread and leaves out what lies more than {HASH_DEPTH} levels below
struct llamaprompt_hash_level {{
    static int & depth() noexcept {{ static thread_local int d = 0; return d; }}
    llamaprompt_hash_level() noexcept {{ ++depth(); }}
    ~llamaprompt_hash_level() {{ --depth(); }}
    llamaprompt_hash_level(const llamaprompt_hash_level &) = delete;
    llamaprompt_hash_level & operator=(const llamaprompt_hash_level &) = delete;
    bool too_deep() const noexcept {{ return depth() > {HASH_DEPTH}; }}
}};
"""
ARRAY_IS_HASHABLE = """    virtual bool is_hashable() const override {
        if (std::all_of(val_arr.begin(), val_arr.end(), [&](auto & val) -> bool {
"""
ARRAY_EQUIVALENT = """    virtual bool equivalent(const value_t & other) const override {
        return typeid(*this) == typeid(other) && is_hashable() && other.is_hashable() && std::equal(val_arr.begin(),"""
ARRAY_HASH = """    virtual hasher unique_hash() const noexcept override {
        auto hash = hasher(typeid(*this));
        for (const auto & val : val_arr) {
"""
OBJECT_HASH = """    virtual hasher unique_hash() const noexcept override {
        auto hash = hasher(typeid(*this));
        for (const auto & [key, val] : val_obj) {
"""
HASH_LEVEL = ("        llamaprompt_hash_level level;  // llamaprompt: deep values hashed to a bounded depth\n"
              "        if (level.too_deep()) {\n"
              "            return hash;\n"
              "        }\n")

METHOD_GUARD = "        ::llamaprompt::jinja_guard_step();  // llamaprompt: deeply nested values recurse here\n"


def _after_first_line(text: str, insert: str) -> str:
    head, rest = text.split("\n", 1)
    return head + "\n" + insert + rest


STATEMENT_LOST = "a syntax tree ~10^5 deep (a long operator chain) overflows the stack when freed (the process dies)"

# Not rewritten: a string literal builds a new string value each time it runs. Returning the value
# the node made last (values are immutable) saved 1-2% of a request, but llama.cpp's `sameas` test
# compares string values by address, and a template can reach it without naming it (a list's
# built-ins by a computed subscript, `l['sel' ~ 'ect']('same' ~ 'as', x)`, or names from the
# request): two runs of one literal would compare as the same object where upstream says they are
# not (found by a session's trial; tests/test_engine_rewrites.py keeps those cases).

STRING_APPEND = "string append: the other string's parts inserted as one range, not pushed one by one"
BUILTIN_MISS = "member access by name: no undefined value built and dropped when the name is no built-in"

REWRITES = [
    # get_media_marker() is per template (src/cpp/shim_server.cpp), not once per process
    Rewrite("tools/server/server-common.cpp", "server-common.cpp", [
        Edit("const char * get_media_marker() {", "const char * llamaprompt_upstream_get_media_marker() {"),
    ]),
    # handler choice, analysis cache, prompt-only path, debug-only parser load (src/cpp/shim_chat.cpp)
    Rewrite("common/chat.cpp", "chat.cpp", [
        Edit("if (auto result = common_chat_try_specialized_template(tmpl, src, params)) {",
             "if (auto result = llamaprompt_try_specialized_template(tmpl, src, params)) {"),
        Edit("autoparser.analyze_template(tmpl)", "llamaprompt_analyze_template(autoparser, tmpl)"),
        Edit("autoparser::peg_generator::generate_parser(tmpl, params, autoparser)",
             "llamaprompt_generate_parser(tmpl, params, autoparser)"),
        Edit("arena.load(auto_params.parser)", "llamaprompt_load_parser(arena, auto_params.parser)"),
        # the date of each request's extra context (common_chat_extra_context, two per request)
        # was printed through a new std::ostringstream each time; now the same text is kept per
        # thread for the last (broken-down time, format, locale) printed
        Edit("""    std::ostringstream ss;
    ss << std::put_time(&local_time, format.c_str());
    auto res = ss.str();
    return res;
}
""", """    return llamaprompt_put_time(local_time, format);  // llamaprompt: an engine rewrite (adapt_tree.py)
}
""", speed="the request's date: the text printed last for the same time, format and locale, not a new stream per call"),
        # ChatTemplate.template_inputs: the context and output of each render (src/cpp/shim_chat.cpp)
        Edit(TEMPLATE_INPUTS_SITES[0],
             TEMPLATE_INPUTS_SITES[0] + " llamaprompt_capture_inputs(tmpl, ctx, inp, inputs.mark_input);",
             requires=("common/chat.cpp", "common_chat_template_direct_apply_impl("),
             lost="ChatTemplate.template_inputs and render_inputs (FeatureError)"),
        Edit(TEMPLATE_INPUTS_SITES[1],
             "std::string result = llamaprompt_capture_output(parts->as_string().str());",
             requires=("common/chat.cpp", "common_chat_template_direct_apply_impl("),
             lost="ChatTemplate.template_inputs and render_inputs (FeatureError)"),
    ]),
    # execution budgets of the Jinja engine (src/cpp/jinja_guard.h)
    Rewrite("common/jinja/runtime.cpp", "jinja-runtime.cpp", [
        Edit("return execute_impl(ctx)", "return llamaprompt::jinja_guard_step(), execute_impl(ctx)"),
        Edit("res->val_str.append(str)", "llamaprompt_repeat_append(res->val_str, str, repeat)"),
        Edit("auto output = left_val->as_string().append(right_val->as_string())",
             "auto output = (llamaprompt_concat_guard(left_val, right_val), "
             "left_val->as_string().append(right_val->as_string()))"),
        Edit("auto output = left_str.append(right_str)",
             "auto output = (llamaprompt_concat_guard(left_str, right_str), left_str.append(right_str))"),
        Edit("auto & right_arr = right_val->as_array()",
             "auto & right_arr = (llamaprompt_list_concat_guard(left_arr, right_val->as_array()), "
             "right_val->as_array())"),
        # engine rewrites: the built-in tables are static maps (of std::function); a variable
        # lookup and each filter / method call copied the whole table to look one name up
        Edit("    auto builtins = global_builtins();\n",
             "    const auto & builtins = global_builtins();\n",
             speed="identifier lookup: a copy of the global built-ins map (~40 std::function) per lookup"),
        Edit("    auto builtins = input->get_builtins();\n",
             "    const auto & builtins = input->get_builtins();\n",
             speed="filter / method call: a copy of the type's built-ins map per call"),
        # `obj.name` first looks `name` up among obj's built-ins (a built-in wins over a key of the
        # same name) and, when there is none, built an undefined value only to test it and drop it;
        # that call now gets a null value instead (three edits: all or none)
        Edit("static value try_builtin_func(context & ctx, const std::string & name, value & input, "
             "bool undef_on_missing = false) {",
             "static value try_builtin_func(context & ctx, const std::string & name, value & input, "
             "bool undef_on_missing = false, bool llamaprompt_null_on_missing = false) {",
             speed=BUILTIN_MISS, group="builtin_miss"),
        Edit("    if (undef_on_missing) {\n        return mk_val<value_undefined>(name);\n",
             "    if (llamaprompt_null_on_missing) { return nullptr; } if (undef_on_missing) {\n"
             "        return mk_val<value_undefined>(name);\n",
             speed=BUILTIN_MISS, group="builtin_miss"),
        Edit("        value val = try_builtin_func(ctx, prop, object, true);\n"
             "        if (!is_val<value_undefined>(val)) {\n",
             "        value val = try_builtin_func(ctx, prop, object, true, true);\n"
             "        if (val && !is_val<value_undefined>(val)) {\n",
             speed=BUILTIN_MISS, group="builtin_miss"),
        # `for`: a scope per item, used only by a loop filter (`for x in xs if cond`); built
        # only where that filter runs (two edits: both or neither, see apply_rewrites)
        Edit("    for (size_t i = 0; i < items.size(); ++i) {\n        context loop_scope(scope);\n",
             "    for (size_t i = 0; i < items.size(); ++i) {\n",
             speed="for loop without a filter: no scope copied per item", group="loop_scope"),
        Edit("        if (select_expr && test_expr) {\n            scope_update_fn(loop_scope);\n",
             "        if (select_expr && test_expr) {\n            context loop_scope(scope);\n"
             "            scope_update_fn(loop_scope);\n",
             speed="for loop without a filter: no scope copied per item", group="loop_scope"),
        # `for`: the loop object's nine keys were built (a string value each) on every iteration,
        # and its entry list grew one reallocation at a time; now the keys are built once per loop
        # that iterates (immutable strings, shared by its iterations' objects), the list reserved
        Edit("""    bool noIteration = true;
    for (size_t i = 0; i < filtered_items.size(); i++) {
""", """    bool noIteration = true;
    // the loop object's keys: immutable strings, built once per loop that iterates, not per insert
""" + LOOP_KEYS_BUILT + """    for (size_t i = 0; i < filtered_items.size(); i++) {
""", speed=LOOP_OBJECT, group="loop_object"),
        Edit(LOOP_OBJECT_INSERTS, _loop_object_inserts_with_keys(), speed=LOOP_OBJECT, group="loop_object"),
        # `for`: a new loop object (nine inserts: each key hashed, a map node allocated) and `loop`
        # set in the scope (a string value built, a search of the scope's list) on every
        # iteration; now the previous iteration's object is refilled in place when nothing but
        # the scope's `loop` holds it. Applies to loop_object's text (after it, or not at all)
        Edit(LOOP_REUSE_OLD, _loop_reuse_new(), speed=LOOP_REUSE),
        # `for`: each item's variable setter (a std::function holding the variable's name: on the
        # heap) was copied into the list of setters; the item and its setter, last used there, move
        Edit("""        filtered_items.push_back(current);
        scope_update_fns.push_back(scope_update_fn);
    }
""", """        filtered_items.push_back(std::move(current));
        scope_update_fns.push_back(std::move(scope_update_fn));
    }
""", speed="for loop: each item's variable setter moved into the list, not copied"),
    ]),
    # the capability probes render the template with llama.cpp's own messages at load: compiled
    # from a copy (src/cpp/shim_jinja_caps.cpp) so that they see the mirrored runtime.h, whose
    # value printing passes through the stack guard (OUTPUT_OF_VALUE)
    Rewrite("common/jinja/caps.cpp", "jinja-caps.cpp", []),
    # a string's parts appended to another's: one insert of the range (the vector grows once, to
    # at least twice its size as push_back would) instead of a push_back per part, which grew it
    # part by part -- printing a macro's or a loop's output appends its many parts
    Rewrite("common/jinja/string.cpp", "jinja-string.cpp", [
        Edit("""    for (const auto & part : other.parts) {
        parts.push_back(part);
    }
    return *this;
""", """    parts.insert(parts.end(), other.parts.begin(), other.parts.end());  // llamaprompt: an engine rewrite
    return *this;
""", speed=STRING_APPEND),
    ]),
    Rewrite("common/jinja/parser.cpp", "jinja-parser.cpp", [
        Edit("return parse_jinja_statement()", "return llamaprompt::jinja_guard_step(), parse_jinja_statement()"),
        Edit("return parse_if_expression()", "return llamaprompt::jinja_guard_step(), parse_if_expression()"),
        Edit("auto false_expr = parse_if_expression()",
             "auto false_expr = (llamaprompt::jinja_guard_step(), parse_if_expression())"),
        Edit("op, parse_logical_negation_expression())",
             "op, (llamaprompt::jinja_guard_step(), parse_logical_negation_expression()))"),
        # `f()()()...`: parse_call_expression calls itself once per argument list
        Edit("? parse_call_expression(std::move(member)) // foo.x()()",
             "? (llamaprompt::jinja_guard_step(), parse_call_expression(std::move(member))) // foo.x()()",
             requires=("common/jinja/parser.cpp", "statement_ptr parse_call_expression("),
             lost="a chain of calls `f()()()...` ~10^5 long overflows the stack while the template loads"),
        Edit("op, parse_unary_expression())",
             "op, (llamaprompt::jinja_guard_step(), parse_unary_expression()))",
             requires=("common/jinja/parser.cpp", "statement_ptr parse_unary_expression()"),
             lost="nothing: this tree's Jinja parser has no unary-expression rule (unary +/- chains), "
                  "so there is no such recursion to guard"),
    ]),
    Rewrite("common/jinja/value.cpp", "jinja-value.cpp", [
        Edit("out->push_back(mk_val<value_int>(i))", "llamaprompt_range_push(out, i)", count=2),
        # a value nested in itself (`l.append(l)`) or very deeply: its JSON and its repr (print,
        # `string`, `trim`, error messages) recurse without end -- the stack guard stops them
        Edit(JSON_OF_VALUE, JSON_OF_VALUE + VALUE_RECURSION_GUARD,
             requires=("common/jinja/value.cpp", "value_to_json_internal("),
             lost="a value nested in itself overflows the stack in tojson (the process dies)"),
        # tojson(indent=N): the size budget on the output so far plus the indentation of the
        # value's lines, before they are written (indent=10**8 wrote 100 MB per line, 11 GB and
        # minutes before the result's own size check)
        Edit(JSON_OF_VALUE + VALUE_RECURSION_GUARD, JSON_OF_VALUE + VALUE_RECURSION_GUARD + TOJSON_INDENT_GUARD,
             requires=("common/jinja/value.cpp", "value_to_json_internal("),
             lost="tojson(indent=N) with a huge N runs past the time and size budgets (GBs of memory)"),
        Edit(REPR_OF_VALUE, REPR_OF_VALUE + VALUE_RECURSION_GUARD,
             requires=("common/jinja/value.cpp", "value_to_string_repr("),
             lost="a value nested in itself overflows the stack when printed (the process dies)"),
        Edit(MARK_USED, MARK_USED + VALUE_RECURSION_GUARD,
             requires=("common/jinja/value.cpp", "stats_t::mark_used("),
             lost="a value nested in itself overflows the stack in the load-time capability probes"),
        Edit("result += val_arr->as_string().str()",
             "result += llamaprompt_sized(result.size(), val_arr->as_string().str())"),
        Edit("str.replace(pos, old_str.length(), new_str)",
             "str.replace(pos, old_str.length(), llamaprompt_sized(str.size(), new_str))"),
        Edit("new_res.reserve(str.length() + new_str.length() * (str.length() + 1))",
             "new_res.reserve(llamaprompt_sized(0, str.length() + new_str.length() * (str.length() + 1)))"),
        Edit("    return mk_val<value_string>(json_str)",
             "    return mk_val<value_string>(llamaprompt_sized(0, json_str))"),
        # slice(): a step of -2**63 overflowed its index and the loop never ended (memory grew
        # until the process was killed); split(): each piece moves the rest of the string
        # (quadratic: a 4.8 MB message ran 18-36 s against a 2 s budget); indent(): a wide indentation
        # on every line went past the size budget
        Edit(SLICE_PUSH, "        llamaprompt_slice_step(result);\n" + SLICE_PUSH,
             requires=("common/jinja/value.cpp", "static T slice("),
             lost="a slice with a step of -2**63 never ends and takes all memory"),
        Edit(SPLIT_ERASE, "                llamaprompt::jinja_guard_work(str.size());\n" + SPLIT_ERASE,
             requires=("common/jinja/value.cpp", '{"split", '),
             lost="split() of a long string into many pieces runs past the time budget"),
        Edit("                str.erase(pos);\n",
             "                llamaprompt::jinja_guard_work(str.size() - pos);\n                str.erase(pos);\n",
             requires=("common/jinja/value.cpp", '{"rsplit", '),
             lost="rsplit() of a long string into many pieces runs past the time budget"),
        Edit("indent.assign(val_width->as_int(), ' ')",
             "indent.assign(llamaprompt_indent_width(val_width->as_int()), ' ')",
             requires=("common/jinja/value.cpp", '{"indent", '),
             lost="indent() with a huge width goes past the size budget"),
        Edit(INDENT_LINE,
             INDENT_LINE.replace("indented += indent;", "indented += llamaprompt_sized(indented.size(), indent);"),
             requires=("common/jinja/value.cpp", '{"indent", '),
             lost="indent() with a huge width goes past the size budget"),
    ]),
    # the one stderr print of json-schema-to-grammar goes to the log (src/cpp/shim_json_schema.cpp)
    Rewrite("common/json-schema-to-grammar.cpp", "json-schema-to-grammar.cpp", [
        Edit('fprintf(stderr, "WARNING: JSON schema conversion was incomplete',
             'llamaprompt_log_warning(stderr, "WARNING: JSON schema conversion was incomplete'),
        # the call's time budget (jinja_guard.h) at each rule added and each pattern converted: a
        # pattern's conversion copies every rule so far (to revert them if the pattern is not
        # supported), so tools or a response_format with thousands of patterned properties took
        # minutes, past any `timeout=`
        Edit(SCHEMA_ADD_RULE, SCHEMA_ADD_RULE + SCHEMA_GUARD,
             requires=("common/json-schema-to-grammar.cpp", "std::string _add_rule("),
             lost="grammar generation for JSON schemas is not under the time budget"),
        Edit(SCHEMA_VISIT_PATTERN, SCHEMA_VISIT_PATTERN + SCHEMA_GUARD,
             requires=("common/json-schema-to-grammar.cpp", "std::string _visit_pattern("),
             lost="grammar generation for JSON schemas' patterns is not under the time budget"),
        Edit(SCHEMA_PATTERN_LOOP, SCHEMA_PATTERN_TICK,
             requires=("common/json-schema-to-grammar.cpp", "sub_pattern[i]"),
             lost="a pattern's conversion (quadratic in runs of `*`) is not under the time budget"),
        Edit(SCHEMA_RECURSIVE_REFS, SCHEMA_RECURSIVE_REFS_STEP,
             requires=("common/json-schema-to-grammar.cpp", "get_recursive_refs"),
             lost="an object's optional properties (cubic in their count) are not under the time budget"),
        Edit(SCHEMA_VISIT_LINE, SCHEMA_VISIT_GUARD + SCHEMA_VISIT_LINE,
             requires=("common/json-schema-to-grammar.cpp", "std::string visit("),
             lost="a chain of thousands of $refs in a schema overflows the stack (the process dies)"),
        Edit(SCHEMA_RULE_NAME, "llamaprompt_rule_chars(name)",
             requires=("common/json-schema-to-grammar.cpp", "INVALID_RULE_CHARS_RE"),
             lost="a tool or property name of ~30,000 characters outside [a-zA-Z0-9-] overflows the stack"),
        Edit(SCHEMA_REF_NAME, "llamaprompt_rule_chars(ref_fragment)",
             requires=("common/json-schema-to-grammar.cpp", "nonalphanumeric_regex"),
             lost="a $ref of ~30,000 characters outside [a-zA-Z0-9-] overflows the stack"),
        Edit(SCHEMA_RULES_DECL, SCHEMA_RULES_DECL + SCHEMA_RULES_JOURNAL, speed=SCHEMA_SNAPSHOT_SPEED,
             group="schema_snapshot"),
        Edit("            _rules[esc_name] = rule;\n", "            llamaprompt_put_rule(esc_name, rule);\n",
             speed=SCHEMA_SNAPSHOT_SPEED, group="schema_snapshot"),
        Edit("        _rules[key] = rule;\n", "        llamaprompt_put_rule(key, rule);\n",
             speed=SCHEMA_SNAPSHOT_SPEED, group="schema_snapshot"),
        Edit(SCHEMA_SNAPSHOT, SCHEMA_JOURNAL, speed=SCHEMA_SNAPSHOT_SPEED, group="schema_snapshot"),
        Edit(SCHEMA_RESTORE, SCHEMA_REVERT, count=2, speed=SCHEMA_SNAPSHOT_SPEED, group="schema_snapshot"),
        Edit(OPTIONAL_REFS_HEAD, OPTIONAL_REFS_HEAD_NEW, speed=OPTIONAL_REFS, group="optional_refs"),
        Edit(OPTIONAL_REFS_FIRST, OPTIONAL_REFS_FIRST_NEW, speed=OPTIONAL_REFS, group="optional_refs"),
        Edit(OPTIONAL_REFS_REST, OPTIONAL_REFS_REST_NEW, speed=OPTIONAL_REFS, group="optional_refs"),
        Edit(OPTIONAL_REFS_CALL, "get_recursive_refs(i, false)", speed=OPTIONAL_REFS, group="optional_refs"),
    ]),
    # the JSON-schema reader (src/cpp/shim_json_schema_reader.cpp): build_node recursed once per
    # schema level and once more per $ref it follows -- a chain of 6,000 $defs, each an array of the
    # next (6 levels of JSON, under the request's nesting limit), overflowed the stack (SIGSEGV,
    # found by the fresh-user trial); the stack guard at each node. Trees before it (0.3.35) read
    # schemas in json-schema-to-grammar.cpp's visit (guarded above)
    Rewrite("common/json-schema.cpp", "json-schema.cpp", [
        Edit(SCHEMA_BUILD_NODE, SCHEMA_BUILD_NODE + SCHEMA_NESTING_GUARD,
             requires=("common/json-schema.cpp", "build_node("),
             lost="a chain of thousands of $refs in a schema overflows the stack (the process dies)"),
    ]),
    # rule names without std::regex (src/cpp/rule_names.h, src/cpp/shim_peg_parser.cpp)
    Rewrite("common/peg-parser.cpp", "peg-parser.cpp", [
        Edit("return std::regex_replace(name, invalid_rule_chars_re, \"-\");",
             "return llamaprompt_rule_chars(name);  // llamaprompt: no std::regex (a stack overflow)",
             requires=("common/peg-parser.cpp", "invalid_rule_chars_re"),
             lost="a tool name of ~30,000 characters outside [a-zA-Z0-9-] overflows the stack"),
    ]),
    # no config.ini files applied to a library call (src/cpp/shim_arg.cpp)
    Rewrite("common/arg.cpp", "arg.cpp", [
        Edit("common_params_apply_system_config(params, ctx_arg.ex)",
             "llamaprompt_no_system_config(params, ctx_arg.ex)",
             requires=("common/arg.cpp", "common_params_apply_system_config("),
             lost="nothing: this tree's argument parser reads no config.ini files"),
    ]),
]


# nlohmann::ordered_map (the JSON objects of llama.cpp's request and chat code): its entries,
# pair<const Key, T>, have no noexcept move constructor, so std::vector's own growth copies every
# value -- whole JSON subtrees: a request's messages, tools -- at each reallocation, while parsing
# a body and while building the server's parameters key by key. A full map now grows by moving
# its values (llamaprompt_grow_by_moving, declared before ordered_map): the same capacity as the
# vector's growth, the same entries in the same order; if copying a key throws, the values moved
# so far are moved back; a value to insert that is one of the map's own is left to the vector.
ORDERED_MAP = "JSON object insert: a full object grows by moving its values, not copying them"
ORDERED_MAP_DECL = """template <class Key, class T, class IgnoredLess = std::less<Key>,
          class Allocator = std::allocator<std::pair<const Key, T>>>
              struct ordered_map : std::vector<std::pair<const Key, T>, Allocator>
{"""
GROW_BY_MOVING = """// llamaprompt (an engine rewrite, see its adapt_tree.py): a full ordered_map grows by moving its
// values; the vector would copy them (its entries have no noexcept move constructor)
template <class Container, class T>
inline void llamaprompt_grow_by_moving(Container & entries, const T & value)
{
    if (entries.size() != entries.capacity())
    {
        return;
    }
    const void * at = std::addressof(value);
    const void * first = entries.data();
    const void * last = entries.data() + entries.size();
    if (!std::less<const void *>()(at, first) && std::less<const void *>()(at, last))
    {
        return;  // the value is one of the entries: the vector's growth handles that
    }
    Container grown(entries.get_allocator());
    grown.reserve(entries.empty() ? 1 : 2 * entries.size());  // the vector's growth
    std::size_t moved = 0;
    try
    {
        for (auto & entry : entries)
        {
            grown.emplace_back(entry.first, std::move(entry.second));
            ++moved;
        }
    }
    catch (...)
    {
        for (std::size_t i = 0; i < moved; ++i)
        {
            entries[i].second = std::move(grown[i].second);
        }
        throw;
    }
    entries.swap(grown);
}

"""


# Destroying a JSON array or object (json_value::destroy) moved every element of the whole tree,
# level by level, into a std::vector used as a stack (reserved per container: an allocation each),
# so that a deeply nested value is destroyed without recursion: ~9% of a Qwen3 request's
# instructions went to destroying the request's JSON and its copies. Now the elements are
# destroyed first, in place, by a recursion bounded to 64 levels (each one left null); only a
# tree deeper than that still reaches the stack, with what is left of it. The same memory is
# freed; nothing else is observable of a destruction.
JSON_DESTROY = "JSON destruction: elements destroyed in place to a depth of 64, not moved through a stack"
JSON_DESTROY_DECL = "        void destroy(value_t t)\n        {\n"
JSON_DESTROY_HELPER = """        // llamaprompt (an engine rewrite, see adapt_tree.py): the elements of this array or
        // object destroyed in place, each left null, recursing at most `levels` deep; false when
        // some were left (deeper trees: destroy's stack takes what is left)
        bool llamaprompt_release_elements(value_t t, int levels) noexcept
        {
            bool all = true;
            auto release = [&](basic_json & element) noexcept
            {
                const value_t et = element.m_data.m_type;
                if (et == value_t::array || et == value_t::object)
                {
                    if (levels == 0 || !element.m_data.m_value.llamaprompt_release_elements(et, levels - 1))
                    {
                        all = false;
                        return;
                    }
                }
                element.m_data.m_value.destroy(et);
                element.m_data.m_type = value_t::null;
                element.m_data.m_value = {};
            };
            if (t == value_t::array)
            {
                for (auto & element : *array)
                {
                    release(element);
                }
            }
            else
            {
                for (auto & entry : *object)
                {
                    release(entry.second);
                }
            }
            return all;
        }

"""
JSON_DESTROY_STACK = """            if (t == value_t::array || t == value_t::object)
            {
                // flatten the current json_value to a heap-allocated stack
"""
JSON_DESTROY_STACK_NEW = (
    "            if ((t == value_t::array || t == value_t::object) && !llamaprompt_release_elements(t, 64))\n"
    "            {\n"
    "                // flatten the current json_value to a heap-allocated stack\n"
)

# Jinja values (mk_val: std::make_shared, one block of ~200-300 bytes for the value and its count)
# are allocated and freed by the thousand per render, and freed in bursts (a scope, a loop object,
# the render's result) that glibc's per-thread cache (7 blocks per size) does not absorb: its slow
# path was a fifth of a render's instructions. mk_val now allocates through a per-thread free list
# per size (16-byte classes up to 624 bytes, 1024 blocks kept per class and thread); a block freed
# in another thread joins that thread's list, a block freed after its thread's lists are gone (or
# larger ones) goes back to operator delete. The same values, constructed the same way.
VALUE_POOL = "values: allocated from per-thread free lists, not malloc's slow path"
MK_VAL_DECL = "template<typename T, typename... Args>\nstd::shared_ptr<typename extract_pointee<T>::type> mk_val("
VALUE_POOL_INCLUDE_AT = "#pragma once\n"
VALUE_POOL_INCLUDE = '#include "thread_slots.h"  // llamaprompt (src/cpp): the value pool finds its lists\n'
VALUE_POOL_BLOCK = """// llamaprompt (an engine rewrite, see its adapt_tree.py): the memory of values built by mk_val
namespace llamaprompt_value_pool {
struct free_block { free_block * next; };
constexpr std::size_t granule = 16;
constexpr std::size_t classes = 40;  // blocks of 16, 32, ..., 624 bytes
constexpr unsigned keep = 1024;      // free blocks kept per class and thread
struct lists {                       // trivial: a thread-local without a guard
    free_block * head[classes];
    unsigned count[classes];
    unsigned char state;             // 0 not used yet, 1 in use, 2 the thread is ending
};
inline lists & own_lists() {
    static thread_local lists l;
    return l;
}
inline lists & local() {  // found through the thread pointer once claimed (llamaprompt's thread_slots.h)
    return llamaprompt::thread_slots<lists>::get<own_lists>();
}
struct reaper {  // frees the thread's blocks when the thread ends
    ~reaper() {
        llamaprompt::thread_slots<lists>::release();
        lists & l = own_lists();
        l.state = 2;
        for (std::size_t c = 0; c < classes; ++c) {
            while (free_block * b = l.head[c]) {
                l.head[c] = b->next;
                ::operator delete(b);
            }
            l.count[c] = 0;
        }
    }
};
inline void start(lists & l) {
    static thread_local reaper r;
    (void) r;
    l.state = 1;
    llamaprompt::thread_slots<lists>::claim(&l);
}
inline std::size_t size_class(std::size_t bytes) {  // 0: not pooled
    const std::size_t c = (bytes + granule - 1) / granule;
    return c < classes ? c : 0;
}
inline void * allocate(std::size_t bytes) {
    const std::size_t c = size_class(bytes);
    if (c == 0) {
        return ::operator new(bytes);
    }
    lists & l = local();
    if (l.state == 0) {
        start(l);
    }
    if (free_block * b = l.head[c]) {  // (empty once the thread is ending)
        l.head[c] = b->next;
        --l.count[c];
        return b;
    }
    return ::operator new(c * granule);  // the class's size: the block can be reused for any of it
}
inline void deallocate(void * p, std::size_t bytes) noexcept {
    const std::size_t c = size_class(bytes);
    if (c != 0) {
        lists & l = local();
        if (l.state == 1 && l.count[c] < keep) {
            auto * b = static_cast<free_block *>(p);
            b->next = l.head[c];
            l.head[c] = b;
            ++l.count[c];
            return;
        }
    }
    ::operator delete(p);
}
template <class T>
struct allocator {
    using value_type = T;
    allocator() noexcept = default;
    template <class U>
    allocator(const allocator<U> &) noexcept {}
    T * allocate(std::size_t n) {
        static_assert(alignof(T) <= granule, "operator new's alignment");
        return static_cast<T *>(llamaprompt_value_pool::allocate(n * sizeof(T)));
    }
    void deallocate(T * p, std::size_t n) noexcept { llamaprompt_value_pool::deallocate(p, n * sizeof(T)); }
};
template <class T, class U>
bool operator==(const allocator<T> &, const allocator<U> &) noexcept { return true; }
template <class T, class U>
bool operator!=(const allocator<T> &, const allocator<U> &) noexcept { return false; }
}  // namespace llamaprompt_value_pool
"""


# Engine rewrites in headers (common/jinja/*.h, vendor/nlohmann/json.hpp): compiled by every _core
# file through the mirror of the tree's common/ and nlohmann headers (mirror_headers; llama-common
# and mtmd include nlohmann's from there too). Function bodies (and functions and types of their
# own that they use) only, never a class layout: the llama-common objects compiled with the tree's
# headers stay compatible (an inline function both define, e.g. mk_val, may come from either: each
# value's control block frees it with the allocator that made it).
HEADER_REWRITES = [
    Rewrite("common/jinja/value.h", "", [
        # comparing and hashing deeply nested values (HASH_DEPTH above)
        Edit(VALUE_H_TOP, VALUE_H_GUARD_DECL, requires=("common/jinja/value.h", "unique_hash()"),
             lost=VALUE_COMPARE_LOST),
        Edit(ARRAY_IS_HASHABLE, _after_first_line(ARRAY_IS_HASHABLE, METHOD_GUARD),
             requires=("common/jinja/value.h", "is_hashable()"), lost=VALUE_COMPARE_LOST),
        Edit(ARRAY_EQUIVALENT, _after_first_line(ARRAY_EQUIVALENT, METHOD_GUARD),
             requires=("common/jinja/value.h", "is_hashable()"), lost=VALUE_COMPARE_LOST),
        Edit(ARRAY_HASH, ARRAY_HASH.replace("        for (", HASH_LEVEL + "        for (", 1),
             requires=("common/jinja/value.h", "unique_hash()"), lost=VALUE_COMPARE_LOST),
        Edit(OBJECT_HASH, OBJECT_HASH.replace("        for (", HASH_LEVEL + "        for (", 1),
             requires=("common/jinja/value.h", "unique_hash()"), lost=VALUE_COMPARE_LOST),
        Edit(VALUE_DECL, RELEASE_CHILDREN_DECL + VALUE_DECL, requires=("common/jinja/value.h", "virtual ~value_t()"),
             lost="a list nested ~10^5 deep overflows the stack when its values are destroyed (the process dies)"),
        Edit(AFTER_VALUE_T, RELEASE_CHILDREN + AFTER_VALUE_T, requires=("common/jinja/value.h", "virtual ~value_t()"),
             lost="a list nested ~10^5 deep overflows the stack when its values are destroyed (the process dies)"),
        Edit(VALUE_DTOR, VALUE_DTOR_BODY,
             requires=("common/jinja/value.h", "virtual ~value_t()"),
             lost="a list nested ~10^5 deep overflows the stack when its values are destroyed (the process dies)"),
        Edit(MK_VAL_DECL, VALUE_POOL_BLOCK + MK_VAL_DECL, speed=VALUE_POOL, group="value_pool"),
        Edit(VALUE_POOL_INCLUDE_AT, VALUE_POOL_INCLUDE_AT + VALUE_POOL_INCLUDE, speed=VALUE_POOL, group="value_pool"),
        Edit("    return std::make_shared<PointeeType>(std::forward<Args>(args)...);\n",
             "    return std::allocate_shared<PointeeType>(llamaprompt_value_pool::allocator<PointeeType>(),\n"
             "                                             std::forward<Args>(args)...);\n",
             speed=VALUE_POOL, group="value_pool"),
        # an insert hashed the key twice (has_key, then operator[]); one try_emplace for a plain
        # object (no subclass that could override has_key), the same checks and order of entries.
        # (llamaprompt_insert_plain: also the insert of runtime.h's scope objects, see scope_chain)
        Edit("""    virtual void insert(const value & key, const value & val) override {
        bool replaced = false;
""", """    // llamaprompt (an engine rewrite, see its adapt_tree.py): insert's effect on an object whose
    // type overrides none of its functions: the key hashed once
#define LLAMAPROMPT_INSERT_PLAIN 1
    void llamaprompt_insert_plain(const value & key, const value & val) {
        if (!key->is_immutable() || !key->is_hashable()) {  // has_key's check
            throw std::runtime_error("Object key of unhashable type: " + key->type());
        }
        auto added = unordered.try_emplace(key, val);
        if (added.second) {
            val_obj.push_back({key, val});
            return;
        }
        added.first->second = val;
        for (auto & pair : val_obj) {
            if (*(pair.first) == *key) {
                pair.second = val;
                return;
            }
        }
        val_obj.push_back({key, val});
    }
    virtual void insert(const value & key, const value & val) override {
        bool replaced = false;
""", speed=OBJECT_INSERT, group="object_insert"),
        Edit("""        bool replaced = false;
        if (is_immutable()) {
            throw std::runtime_error("Attempting to modify immutable type");
        }
        if (has_key(key)) {""", """        bool replaced = false;
        if (is_immutable()) {
            throw std::runtime_error("Attempting to modify immutable type");
        }
        if (typeid(*this) == typeid(value_object_t)) {
            llamaprompt_insert_plain(key, val);
            return;
        }
        if (has_key(key)) {""", speed=OBJECT_INSERT, group="object_insert"),
        # string equality (every object-key lookup, ==, `in`) built both strings' full text; two
        # single-part strings (the common case: keys, literals, input fields) are compared as they are
        Edit("""    virtual bool equivalent(const value_t & other) const override {
        return typeid(*this) == typeid(other) && val_str.str() == other.val_str.str();
    }
""", """    virtual bool equivalent(const value_t & other) const override {
        if (typeid(*this) != typeid(other)) {
            return false;
        }
        if (val_str.parts.size() == 1 && other.val_str.parts.size() == 1) {
            return val_str.parts[0].val == other.val_str.parts[0].val;  // what str() returns for one part
        }
        return val_str.str() == other.val_str.str();
    }
""", speed="string equality (object-key lookups): no copies of single-part strings"),
    ]),
    Rewrite("common/jinja/runtime.h", "", [
        # a syntax tree released iteratively (STATEMENT_DELETER above)
        Edit(STATEMENT_FWD, STATEMENT_DELETER, requires=("common/jinja/runtime.h", "std::unique_ptr<statement>"),
             lost=STATEMENT_LOST),
        Edit(STATEMENT_END, STATEMENT_END + RELEASE_STATEMENT,
             requires=("common/jinja/runtime.h", "std::unique_ptr<statement>"), lost=STATEMENT_LOST),
        # printing a value gathers the parts of a list recursively: the stack guard there too
        # (VALUE_RECURSION_GUARD above; its declaration first, at file scope)
        Edit("#pragma once\n",
             "#pragma once\nnamespace llamaprompt { void jinja_guard_step(); }  // llamaprompt: jinja_guard.h\n",
             requires=("common/jinja/runtime.h", "gather_string_parts_recursive("),
             lost="a list nested in itself overflows the stack when printed (the process dies)"),
        Edit(OUTPUT_OF_VALUE, OUTPUT_OF_VALUE + VALUE_RECURSION_GUARD,
             requires=("common/jinja/runtime.h", "gather_string_parts_recursive("),
             lost="a list nested in itself overflows the stack when printed (the process dies)"),
        # a new scope (every `for` iteration, macro call, call block) re-inserted each variable of
        # its parent -- hashing each key twice -- after building six constants and a string that
        # the parent's variables then replace: its variables are exactly the parent's, in the
        # parent's order (every scope's list begins with the same six constants, entries are only
        # ever replaced in place). The visitor is not inherited, as before.
        Edit("""    context(const context & parent) : context() {
        // inherit variables (for example, when entering a new scope)
        auto & pvar = parent.env->as_ordered_object();
        for (const auto & pair : pvar) {
            set_val(pair.first, pair.second);
        }
        current_time = parent.current_time;
        is_get_stats = parent.is_get_stats;
        src = parent.src;
    }
""", CONTEXT_COPY,
             speed="new scope (each for-loop iteration, macro call): the parent's variables copied, not re-inserted "
                   "one by one after six constants"),
        # a variable lookup built an `undefined` default value (a string copy and a value
        # object), found or not, and looked the key up twice
        Edit("""    value get_val(const std::string & name) {
        value default_val = mk_val<value_undefined>(name);
        return env->at(name, default_val);
    }
""", CONTEXT_GET_VAL,
             speed="variable lookup: no `undefined` value built for a found name, one hash lookup instead of two, "
                   "no key value built"),
        # printing a list (each `for`'s output, the program's) copied its items into a new vector
        # -- a reference count up and down and an allocation per list -- to read them in order;
        # nothing the loop calls changes a list (it appends to the string being built)
        Edit("""        auto items = cast_val<value_array>(val)->as_array();
        for (const auto & item : items) {
            gather_string_parts_recursive(item, parts);
""", """        const auto & items = cast_val<value_array>(val)->as_array();
        for (const auto & item : items) {
            gather_string_parts_recursive(item, parts);
""", speed="printing a list (each for loop's output): its items read in place, not copied"),
        # scope_chain: a new scope (each `for`, macro call, call block) copied all its parent's
        # variables -- the hash table rebuilt, every key hashed again -- and freed them when it
        # ended. Now it keeps a reference to its parent's variables and holds only what it sets
        # itself; a lookup reads its own, then its parent's, and so on up. Each scope still sees
        # its variables as they were when it was made: a scope that changes its own while a scope
        # made from it holds them changes a copy (set_val), and the loop object's refill
        # (runtime.cpp) is skipped while they are held. Listed (print_vars), they are the
        # parent's in their order with the scope's own set over them: the copy's order
        Edit("struct context {\n", SCOPE_OBJECT + "struct context {\n", speed=SCOPE_CHAIN, group="scope_chain"),
        Edit(CONTEXT_COPY, """    context(const context & parent)
        : src(parent.src), current_time(parent.current_time), is_get_stats(parent.is_get_stats) {
        // inherit variables (for example, when entering a new scope): the parent's, read through
        // it, not copied; an empty scope's own parent instead (it has the same variables)
        const auto * from = llamaprompt_scope_object::of(*parent.env);
        auto scope = std::make_shared<llamaprompt_scope_object>();
        scope->has_builtins = false;
        if (from && from->unordered.empty() && from->parent) {
            scope->parent = from->parent;
            scope->depth = from->depth;
        } else {
            scope->parent = parent.env;
            scope->depth = (from ? from->depth : 0) + 1;
        }
        if (scope->depth > llamaprompt_scope_object::max_depth) {
            llamaprompt_all_vars_into(parent.env, *scope);
            scope->parent = nullptr;
            scope->depth = 0;
        }
        env = std::move(scope);
    }
""", speed=SCOPE_CHAIN, group="scope_chain"),
        Edit(CONTEXT_GET_VAL, """    value get_val(const std::string & name) {
        // the variable, or `undefined` (built only for a missing name): this scope's own, else
        // the nearest parent's (each looked up in its own table). The key is the one-part string value
        // that mk_val<value_string>(name) builds, kept per thread and given the name's text (the
        // lookup only hashes and compares it)
        static thread_local const value key = mk_val<value_string>(std::string());
        auto & parts = static_cast<value_string_t &>(*key).val_str.parts;
        parts.resize(1);
        parts[0].is_input = false;
        parts[0].val.assign(name);
        for (const value_object_t * vars = env.get(); vars != nullptr;) {
            auto it = vars->unordered.find(key);
            if (it != vars->unordered.end()) {
                return it->second;
            }
            vars = llamaprompt_scope_object::up(*vars);
        }
        return mk_val<value_undefined>(name);
    }
""", speed=SCOPE_CHAIN, group="scope_chain"),
        Edit("""    void set_val(const std::string & name, const value & val) {
        env->insert(name, val);
    }
""", """    void set_val(const std::string & name, const value & val) {
        llamaprompt_own_vars();
        env->insert(name, val);
    }
""", speed=SCOPE_CHAIN, group="scope_chain"),
        Edit("""    void set_val(const value & name, const value & val) {
        env->insert(name, val);
    }
""", """    void set_val(const value & name, const value & val) {
        llamaprompt_own_vars();
        env->insert(name, val);
    }
""", speed=SCOPE_CHAIN, group="scope_chain"),
        Edit("""    void print_vars() const {
        printf("Context Variables:\\n%s\\n", value_to_json(env, 2).c_str());
    }
""", """    void print_vars() const {
        printf("Context Variables:\\n%s\\n", value_to_json(llamaprompt_all_vars(), 2).c_str());
    }

    // llamaprompt (the scope_chain engine rewrite, see its adapt_tree.py)
    // (an assignment would share one scope's own variables between two contexts, as upstream's
    // did, where each now copies them before it changes them: none is compiled)
    context & operator=(const context &) = delete;

    // whether a scope made from this one holds this scope's own variables
    bool llamaprompt_vars_shared() const { return env.use_count() > 1; }

    // all the variables as one object: the parents' in their order, each scope's own set over
    // them (the object the copy of every parent's variables was)
    value_object llamaprompt_all_vars() const {
        value_object all = mk_val<value_object>();
        all->has_builtins = false;
        llamaprompt_all_vars_into(env, *all);
        return all;
    }

    static void llamaprompt_all_vars_into(const value_object & vars, value_object_t & into) {
        std::vector<const value_object_t *> scopes;
        for (const value_object_t * level = vars.get(); level != nullptr;
             level = llamaprompt_scope_object::up(*level)) {
            scopes.push_back(level);
        }
        for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
            for (const auto & pair : (*it)->as_ordered_object()) {
                into.insert(pair.first, pair.second);
            }
        }
    }

private:
    // before this scope changes its own variables: a copy of them, if a scope made from this
    // one holds them (it keeps them as they were)
    void llamaprompt_own_vars() {
        if (env.use_count() > 1) {
            const auto * scope = llamaprompt_scope_object::of(*env);
            value_object vars = scope ? std::make_shared<llamaprompt_scope_object>(*scope) : mk_val<value_object>(*env);
            vars->stats = value_t::stats_t();
            env = std::move(vars);
        }
    }

public:
""", speed=SCOPE_CHAIN, group="scope_chain"),
    ]),
    Rewrite("vendor/nlohmann/json.hpp", "", [
        Edit(ORDERED_MAP_DECL, GROW_BY_MOVING + ORDERED_MAP_DECL, speed=ORDERED_MAP, group="ordered_map"),
        Edit("        Container::emplace_back(key, std::forward<T>(t));\n",
             "        llamaprompt_grow_by_moving(static_cast<Container &>(*this), t);\n"
             "        Container::emplace_back(key, std::forward<T>(t));\n", speed=ORDERED_MAP, group="ordered_map"),
        Edit("        Container::emplace_back(std::forward<KeyType>(key), std::forward<T>(t));\n",
             "        llamaprompt_grow_by_moving(static_cast<Container &>(*this), t);\n"
             "        Container::emplace_back(std::forward<KeyType>(key), std::forward<T>(t));\n",
             speed=ORDERED_MAP, group="ordered_map"),
        Edit(JSON_DESTROY_DECL, JSON_DESTROY_HELPER + JSON_DESTROY_DECL, speed=JSON_DESTROY, group="json_destroy"),
        Edit(JSON_DESTROY_STACK, JSON_DESTROY_STACK_NEW, speed=JSON_DESTROY, group="json_destroy"),
    ]),
]


# Type tests of Jinja values (is_val / cast_val in common/jinja/value.h): a dynamic_cast, which
# walks the class hierarchy (~100 instructions; ~7% of a render). For a value type that no class
# derives from, a value is of that type exactly when its dynamic type is that type, so typeid
# equality answers the same. Which types are such leaves is probed on the program that includes
# the header: the tree's common/ and tools/server/ and llamaprompt's src/cpp; any text that could
# name one as a base (in a base list, a typedef or an alias) keeps dynamic_cast for that type.
LEAF_TYPE_TEST = "value type tests: typeid equality, not dynamic_cast, for the types no class derives from"
VALUE_TYPE_DEF = re.compile(r"\bstruct\s+(value_\w+_t)\s*:\s*public\s+\w+\s*\{")
SRC_CPP = HERE.parent / "src" / "cpp"
IS_VAL = "template<typename T>\nbool is_val(const value & ptr) {\n"
TYPE_TESTS = [  # (upstream's line in is_val / cast_val, the same through llamaprompt_cast_val[, count])
    ("    return dynamic_cast<const PointeeType*>(ptr.get()) != nullptr;\n",
     "    return llamaprompt_cast_val<PointeeType>(ptr.get()) != nullptr;\n"),
    ("    return dynamic_cast<const PointeeType*>(ptr) != nullptr;\n",
     "    return llamaprompt_cast_val<PointeeType>(ptr) != nullptr;\n"),
    ("    return dynamic_cast<const PointeeType*>(ptr.get());\n",
     "    return llamaprompt_cast_val<PointeeType>(ptr.get());\n"),
    ("    return dynamic_cast<PointeeType*>(ptr.get());\n",
     "    return const_cast<PointeeType*>(llamaprompt_cast_val<PointeeType>(ptr.get()));\n"),
    # a string's (and a keyword argument's) hash -- each object-key lookup -- began by hashing its
    # type's name (hash_code: a strlen and a hash of the mangled name); for a leaf type that is one
    # value, computed once
    ("        const auto type_hash = typeid(*this).hash_code();\n",
     "        const auto type_hash = llamaprompt_type_hash(*this);\n", 2),
]


CLASS_TEMPLATE = re.compile(r"template\s*<([^<>]*)>\s*(?:struct|class)\s+\w+\s*(?:<[^{;]*?>)?\s*(?:final\s*)?"
                            r"(?<!:):(?!:)([^{;]*)\{")


def _derives_from_parameter(text: str) -> bool:
    """Whether a class template in ``text`` has one of its own type parameters as a base."""
    for m in CLASS_TEMPLATE.finditer(text):
        params = set(re.findall(r"\b(?:typename|class)\s+(\w+)", m.group(1)))
        bases, depth, item = [], 0, ""
        for ch in m.group(2) + ",":
            depth += (ch == "<") - (ch == ">")
            if ch == "," and depth == 0:
                bases.append(re.sub(r"\b(?:public|protected|private|virtual)\b", "", item).strip())
                item = ""
            else:
                item += ch
        if params & set(bases):
            return True
    return False


def _names_as_base(name: str) -> re.Pattern:
    """Text that could make ``name`` a base class: in a base list, a typedef or an alias."""
    q = r"(?:::\s*)?(?:jinja\s*::\s*)?"
    return re.compile(rf"(?:[:,]\s*(?:(?:public|protected|private|virtual)\s+)*{q}{name}\b(?!\s*::)"
                      rf"|\btypedef\b[^;]*\b{name}\b|\busing\s+\w+\s*=\s*{q}{name}\s*;)")


def leaf_value_types(tree: Tree) -> tuple[list[str], dict[str, str]]:
    """The value types of common/jinja/value.h that nothing derives from, and for each other one
    the file whose text could derive from it."""
    types = VALUE_TYPE_DEF.findall(code_only(tree.read("common/jinja/value.h")))
    texts = _program_texts(tree)
    derived: dict[str, str] = {}
    # a class template deriving from its own parameter could derive from any of them
    mixin = next((rel for rel, text in texts if _derives_from_parameter(text)), None)
    if mixin:
        return [], {name: mixin for name in types}
    for name in types:
        pattern = _names_as_base(name)
        where = next((rel for rel, text in texts if pattern.search(text)), None)
        if where:
            derived[name] = where
    return [t for t in types if t not in derived], derived


VALUE_TYPE_BASE = re.compile(r"\bstruct\s+(value_\w+_t)\s*:\s*public\s+(\w+)\s*\{")


def closed_value_families(tree: Tree, leaves: list[str], derived: dict[str, str]) -> dict[str, list[str]]:
    """{value type: the types deriving from it} for each non-leaf value type whose derived types
    are all defined in value.h, directly from it, and are leaves: nothing else in the program
    names it as a base. A value is of such a type exactly when its dynamic type is in the family."""
    texts = _program_texts(tree)
    defs = VALUE_TYPE_BASE.findall(code_only(tree.read("common/jinja/value.h")))
    families = {}
    for name in derived:
        subs = [d for d, base in defs if base == name]
        named = sum(len(_names_as_base(name).findall(text)) for _, text in texts)
        if subs and all(d in leaves for d in subs) and named == len(subs):
            families[name] = subs
    return families


def _leaf_trait(head: list[str], trait: str, leaves: list[str]) -> list[str]:
    """C++ lines: the comment ``head``, then ``trait<T>`` true for each of ``leaves`` (declared),
    false otherwise."""
    block = [f"// {line}" for line in head] + [f"template <typename T> struct {trait} : std::false_type {{}};"]
    for name in leaves:
        block += [f"struct {name};", f"template <> struct {trait}<{name}> : std::true_type {{}};"]
    return block


def leaf_type_test_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """value.h edits: is_val / cast_val test the leaf value types by typeid, a string's hash takes
    its type's hash computed once (a group)."""
    leaves, derived = leaf_value_types(tree)
    families = closed_value_families(tree, leaves, derived) if leaves else {}
    kept = {t: where for t, where in derived.items() if t not in families}
    if kept:
        notes.append("common/jinja/value.h: type tests by dynamic_cast kept for " +
                     ", ".join(f"{t} (a base in {where})" for t, where in sorted(kept.items())))
    if not leaves:
        return []
    block = _leaf_trait(["llamaprompt (an engine rewrite, see its adapt_tree.py): the value types that no class",
                         "derives from (probed over the tree's common/, tools/server/ and llamaprompt's sources);",
                         "a value is one of them exactly when its dynamic type is, so their tests compare typeid"],
                        "llamaprompt_leaf_value", leaves)
    block += ["// the value types whose derived types are all leaves defined in this header (the same probe):",
              "// a value is one of them exactly when its dynamic type is the type or one of those",
              "template <typename... D> struct llamaprompt_value_types {};",
              "template <typename T> struct llamaprompt_value_family { using derived = void; };"]
    for name, subs in sorted(families.items()):
        types = f"llamaprompt_value_types<{', '.join(subs)}>"
        block += [f"struct {name};",
                  f"template <> struct llamaprompt_value_family<{name}> {{ using derived = {types}; }};"]
    block += ["template <typename T, typename... D>",
              "inline bool llamaprompt_in_family(const std::type_info & t, llamaprompt_value_types<D...> *) {",
              "    return t == typeid(T) || ((t == typeid(D)) || ...);",
              "}",
              "template <typename T, typename V>",
              "inline const T * llamaprompt_cast_val(const V * ptr) {",
              "    if constexpr (llamaprompt_leaf_value<T>::value) {",
              "        return ptr != nullptr && typeid(*ptr) == typeid(T) ? static_cast<const T *>(ptr) : nullptr;",
              "    } else if constexpr (!std::is_void_v<typename llamaprompt_value_family<T>::derived>) {",
              "        using family = typename llamaprompt_value_family<T>::derived;",
              "        return ptr != nullptr && llamaprompt_in_family<T>(typeid(*ptr), static_cast<family *>(nullptr))",
              "                   ? static_cast<const T *>(ptr) : nullptr;",
              "    } else {",
              "        return dynamic_cast<const T *>(ptr);",
              "    }",
              "}",
              "template <typename T>",
              "inline size_t llamaprompt_type_hash(const T & val) {",
              "    if constexpr (llamaprompt_leaf_value<T>::value) {",
              "        static const size_t type_hash = typeid(T).hash_code();  // typeid(val) is typeid(T)",
              "        return type_hash;",
              "    } else {",
              "        return typeid(val).hash_code();",
              "    }",
              "}"]
    edits = [Edit(IS_VAL, "\n".join(block) + "\n" + IS_VAL, speed=LEAF_TYPE_TEST, group="leaf_type_test")]
    edits += [Edit(old, new, *count, speed=LEAF_TYPE_TEST, group="leaf_type_test") for old, new, *count in TYPE_TESTS]
    return edits


# The same for the template's syntax tree: is_stmt / cast_stmt (runtime.h) test a node's type with
# dynamic_cast -- the loop variable, an assignment's target, a filter or test, each time it runs.
# For a node type that nothing derives from (probed as for the values, over the same program),
# typeid equality answers the same.
LEAF_STMT_TEST = ("syntax-tree node type tests: typeid equality, not dynamic_cast, for the node types no class "
                  "derives from")
STMT_TYPE_DEF = re.compile(r"\bstruct\s+(\w+)\s*:\s*public\s+(?:statement|expression)\s*\{")
IS_STMT = "template<typename T>\nbool is_stmt(const statement_ptr & ptr) {\n"
STMT_TESTS = [  # (upstream's line in is_stmt / cast_stmt, the same through llamaprompt_cast_stmt)
    ("    return dynamic_cast<const T*>(ptr.get()) != nullptr;\n",
     "    return llamaprompt_cast_stmt<const T>(ptr.get()) != nullptr;\n"),
    ("    return dynamic_cast<T*>(ptr.get());\n", "    return llamaprompt_cast_stmt<T>(ptr.get());\n"),
    ("    return dynamic_cast<const T*>(ptr.get());\n", "    return llamaprompt_cast_stmt<const T>(ptr.get());\n"),
]


CLASS_HEAD = re.compile(r"\b(?:struct|class)\s+[\w:]+\s*(?:final\s*)?:(?!:)([^{;()]*)\{")


def _base_names(text: str) -> set[str]:
    """The last name of each base class in the class heads of ``text`` (``public jinja::a<b>`` -> a)."""
    names = set()
    for m in CLASS_HEAD.finditer(text):
        depth, item, items = 0, "", []
        for ch in m.group(1) + ",":
            depth += (ch == "<") - (ch == ">")
            if ch == "," and depth == 0:
                items.append(item)
                item = ""
            elif depth == 0 and ch != ">":
                item += ch
        for base in items:
            words = re.findall(r"\w+", base)
            if words:
                names.add(words[-1])
    return names


ALIAS = re.compile(r"\btypedef\b[^;]*|\busing\s+\w+\s*=[^;]*|#\s*define\b[^\n]*")


def _alias_words(text: str) -> set[str]:
    """The names in the typedefs, alias declarations and macros of ``text``."""
    return {w for m in ALIAS.finditer(text) for w in re.findall(r"\w+", m.group(0))}


def leaf_stmt_types(tree: Tree) -> list[str]:
    """The syntax-tree node types of common/jinja/runtime.h that nothing derives from: no class head
    of the program lists one as a base, no typedef, alias or macro names one (node type names are
    common words -- identifier, program --, so base lists are parsed rather than searched)."""
    types = STMT_TYPE_DEF.findall(code_only(tree.read("common/jinja/runtime.h")))
    texts = _program_texts(tree)
    if any(_derives_from_parameter(text) for _, text in texts):
        return []
    named = set().union(*(_base_names(text) | _alias_words(text) for _, text in texts))
    return [t for t in types if t not in named]


def leaf_stmt_test_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """runtime.h edits (a group): is_stmt / cast_stmt test the leaf node types by typeid."""
    leaves = leaf_stmt_types(tree)
    if not leaves:
        notes.append("common/jinja/runtime.h: syntax-tree node type tests by dynamic_cast kept (no leaf node type)")
        return []
    block = _leaf_trait(["llamaprompt (an engine rewrite, see its adapt_tree.py): the syntax-tree node types that no",
                         "class derives from (probed over the tree's common/, tools/server/ and llamaprompt's "
                         "sources);",
                         "a node is one of them exactly when its dynamic type is, so their tests compare typeid"],
                        "llamaprompt_leaf_stmt", leaves)
    block += ["template <typename T, typename S>",
              "inline T * llamaprompt_cast_stmt(S * ptr) {",
              "    if constexpr (llamaprompt_leaf_stmt<std::remove_const_t<T>>::value) {",
              "        return ptr != nullptr && typeid(*ptr) == typeid(T) ? static_cast<T *>(ptr) : nullptr;",
              "    } else {",
              "        return dynamic_cast<T *>(ptr);",
              "    }",
              "}"]
    edits = [Edit(IS_STMT, "\n".join(block) + "\n" + IS_STMT, speed=LEAF_STMT_TEST, group="leaf_stmt_test")]
    return edits + [Edit(old, new, speed=LEAF_STMT_TEST, group="leaf_stmt_test") for old, new in STMT_TESTS]

# A Boolean value (value_bool_t) builds an integer value of its own (its member `val`), which only
# its hash reads -- two allocations per comparison result. Where the tree's code shows that nothing
# else can reach that member (bool_int_problems), the integer is one of two immutable values per
# thread (0 and 1: the same content, so the same hash), not a new value per Boolean.
BOOL_INT = "Boolean values: their integer (read only by their hash) one of two per thread, not built per Boolean"
BOOL_DECL = "struct value_bool_t : public value_t {\n"
BOOL_CTOR = """    value_bool_t(bool v) {
        val_int = static_cast<int64_t>(v);
        val_flt = static_cast<double>(v);
        val = mk_val<value_int>(val_int);
    }
"""
BOOL_INT_HELPER = """// llamaprompt (an engine rewrite, see its adapt_tree.py): a Boolean's integer value, read only by
// the Boolean's hash: one of two immutable values per thread
inline value llamaprompt_bool_int(bool v) {
    static thread_local const value ints[2] = {mk_val<value_int>(int64_t(0)), mk_val<value_int>(int64_t(1))};
    return ints[v ? 1 : 0];
}

"""
# how the program may name the Boolean type without reaching its `val`: building one (the result
# not dereferenced), testing for one, its built-ins, its declaration
BOOL_NAMED = re.compile(r"\bvalue_bool(?:_t)?\b")
BOOL_ALLOWED = re.compile(
    r"(?:\bmk_val<\s*value_bool\s*>\s*\(|\bis_val<\s*value_bool\s*>\s*\(|\bensure_vals<\s*value_bool\s*>\s*\("
    r"|\btest_type_fn<\s*value_bool\s*>|\bis_same_v<\s*T\s*,\s*value_bool\s*>|\bvalue_bool_t::get_builtins\b"
    r"|\bstruct\s+value_bool_t\s*:\s*public\s+value_t\b|\busing\s+value_bool\s*=\s*std::shared_ptr<\s*value_bool_t\s*>"
    r"|\bvalue_bool_t\s*\(\s*bool\s+v\s*\)\s*\{"
    r"|\bllamaprompt_leaf_value<\s*value_bool_t\s*>|\bstruct\s+value_bool_t\s*;)")
BOOL_BODY_USES = ("value val;", "val = mk_val<value_int>(val_int);", "return val->unique_hash();")


def _paren_end(code: str, open_at: int) -> int:
    """The index of the parenthesis closing the one at ``open_at`` (-1: none)."""
    depth = 0
    for i in range(open_at, len(code)):
        depth += (code[i] == "(") - (code[i] == ")")
        if depth == 0:
            return i
    return -1


def _program_texts(tree: Tree) -> list[tuple[str, str]]:
    """(name, code_only text) of the tree's common/ and tools/server/ sources and llamaprompt's
    src/cpp: the program that includes common/jinja/value.h."""
    if tree.program_texts is not None:
        return tree.program_texts
    texts: list[tuple[str, str]] = []
    for top in ("common", "tools/server"):
        for path in sorted((tree.root / top).rglob("*")):
            if path.is_file() and path.suffix in (".h", ".hpp", ".cpp", ".c", ".inc"):
                rel = path.relative_to(tree.root).as_posix()
                texts.append((rel, code_only(tree.read(rel))))
    for path in sorted(SRC_CPP.glob("*")):
        if path.is_file():
            texts.append((f"llamaprompt src/cpp/{path.name}", code_only(path.read_text(encoding="utf-8"))))
    tree.program_texts = texts
    return texts


def bool_int_problems(tree: Tree) -> list[str]:
    """Why a Boolean's integer value cannot be shared ([]: it can): value_bool_t reads its `val`
    other than in its hash, or some code names the type in a way that could reach the member."""
    code = code_only(tree.read("common/jinja/value.h"))
    at = code.find(BOOL_DECL)
    if at < 0 or tree.read("common/jinja/value.h").count(BOOL_CTOR) != 1:
        return ["value_bool_t or its constructor is not as expected"]
    body = code[at:_block_end(code, code.find("{", at)) + 1]
    problems = []
    uses = len(re.findall(r"\bval\b", body))
    if uses != len(BOOL_BODY_USES) or not all(norm(u) in norm(body) for u in BOOL_BODY_USES):
        problems.append("value_bool_t uses its member `val` other than in its hash")
    for rel, text in _program_texts(tree):
        for m in BOOL_NAMED.finditer(text):
            start = max(text.rfind("\n", 0, m.start()), m.start() - 80)
            allowed = next((a for a in BOOL_ALLOWED.finditer(text, start, m.end() + 40)
                            if a.start() <= m.start() < a.end()), None)
            if allowed is None:
                problems.append(f"{rel} names {m.group(0)}: {text[m.start():m.start() + 60].strip()!r}")
            elif allowed.group(0).startswith("mk_val"):
                close = _paren_end(text, allowed.end() - 1)
                if close < 0 or re.match(r"\s*(?:->|\.)", text[close + 1:]):
                    problems.append(f"{rel} dereferences a new Boolean: {text[m.start():m.start() + 60].strip()!r}")
    return problems


def bool_int_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """value.h edits (a group): the Boolean's integer is llamaprompt_bool_int's, where provable."""
    problems = bool_int_problems(tree)
    if problems:
        notes.append("common/jinja/value.h: each Boolean keeps an integer value of its own ("
                     + "; ".join(problems[:3]) + ")")
        return []
    return [Edit(BOOL_DECL, BOOL_INT_HELPER + BOOL_DECL, speed=BOOL_INT, group="bool_int"),
            Edit(BOOL_CTOR, BOOL_CTOR.replace("mk_val<value_int>(val_int)", "llamaprompt_bool_int(v)"),
                 speed=BOOL_INT, group="bool_int")]


# member_expression (`obj.name`, `obj[key]`) took its property's text as property->as_string().str():
# a copy of the string value's parts, then of their text. For a string value whose as_string()
# returns its val_str (probed), val_str.str() is the same text without the first copy.
MEMBER_TEXT = "member access: the property's text without copying the string value first"
MEMBER_IMPL = "value member_expression::execute_impl(context & ctx)"  # (older trees: not const)
STRING_AS_STRING = "virtual string as_string() const override { return val_str; }"
MEMBER_TEXT_HELPER = """// llamaprompt (an engine rewrite, see its adapt_tree.py): v->as_string().str(), without
// copying the parts of a string value first (value_string_t::as_string() returns its val_str)
static std::string llamaprompt_value_text(const value & v) {
    if (typeid(*v) == typeid(value_string_t)) {
        return v->val_str.str();
    }
    return v->as_string().str();
}

"""


def member_text_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """runtime.cpp edits (a group): member_expression's property text via llamaprompt_value_text,
    where value_string_t::as_string() returns its val_str."""
    code = code_only(tree.read("common/jinja/value.h"))
    at = code.find("struct value_string_t : public value_t {")
    body = code[at:_block_end(code, code.find("{", at)) + 1] if at >= 0 else ""
    if norm(STRING_AS_STRING) not in norm(body):
        notes.append("common/jinja/runtime.cpp: member access copies its property's string value "
                     "(value_string_t::as_string() is not `return val_str;`)")
        return []
    count = tree.read("common/jinja/runtime.cpp").count("property->as_string().str()")
    return [Edit(MEMBER_IMPL, MEMBER_TEXT_HELPER + MEMBER_IMPL, speed=MEMBER_TEXT, group="member_text"),
            Edit("property->as_string().str()", "llamaprompt_value_text(property)", max(count, 1),
                 speed=MEMBER_TEXT, group="member_text")]



# oaicompat_chat_params_parse (server-common.cpp) built the template's caps as a std::map of nine
# strings (common_chat_templates_get_caps, chat.cpp) on every request, to read one of them: the
# default of the request's parallel_tool_calls. Now `caps` is a lookup whose operator[] reads that
# one member of the same template's caps -- chosen by a copy of common_chat_templates_get_caps's
# own body that returns the caps instead of their map -- and gives any other name upstream's map.
# Probed: `caps` is named only by its declaration and that subscript, caps.cpp's to_map() maps
# the name to the member of the same name, and get_caps's body only asserts, chooses a template
# and returns `<template>->caps.to_map()`.
CAPS_LOOKUP = "the request's parallel_tool_calls default: one member of the caps read, not their map built"
GET_CAPS_HEAD = ("std::map<std::string, bool> common_chat_templates_get_caps("
                 "const common_chat_templates * chat_templates) {")
CAPS_DECL = "    auto caps = common_chat_templates_get_caps(opt.tmpls.get());\n"
CAPS_USE = 'caps["supports_parallel_tool_calls"]'
SERVER_COMMON = "tools/server/server-common.cpp"


def caps_lookup_edits(tree: Tree, notes: list[str]) -> dict[str, list[Edit]]:
    """The caps_lookup group (chat.cpp and server-common.cpp), where the probe holds; else none."""
    if not (tree.has(SERVER_COMMON) and tree.has("common/jinja/caps.cpp")):
        return {}
    chat, server = tree.read("common/chat.cpp"), tree.read(SERVER_COMMON)
    problems = []
    if chat.count(GET_CAPS_HEAD) != 1:
        problems.append("common_chat_templates_get_caps is not defined as expected")
        body = ""
    else:
        at = chat.find(GET_CAPS_HEAD)
        body = chat[at:_block_end(chat, chat.find("{", at)) + 1]
        derived = body.replace("->caps.to_map();", "->caps;")
        statements = [line.strip() for line in code_only(derived).splitlines()[1:-1] if line.strip()]
        allowed = ("GGML_ASSERT(", "if (chat_templates->", "}", "return chat_templates->")
        if "to_map" in derived or "->caps;" not in derived or not all(st.startswith(allowed) for st in statements):
            problems.append("common_chat_templates_get_caps does more than choose a template's caps.to_map()")
    named = len(re.findall(r"\bcaps\b", code_only(server)))
    if named != 2 or server.count(CAPS_DECL) != 1 or server.count(CAPS_USE) != 1:
        problems.append("oaicompat_chat_params_parse uses `caps` for more than the parallel_tool_calls default")
    entry = '{"supports_parallel_tool_calls", supports_parallel_tool_calls}'
    if norm(entry) not in norm(tree.read("common/jinja/caps.cpp")):
        problems.append("caps::to_map() does not map supports_parallel_tool_calls to its member")
    if problems:
        notes.append(f"{SERVER_COMMON}: engine rewrite not applied ({'; '.join(problems)}); "
                     f"upstream's code there (slower: {CAPS_LOOKUP})")
        return {}
    head = "const jinja::caps & llamaprompt_templates_caps(const common_chat_templates * chat_templates) {"
    derived = derived.replace(GET_CAPS_HEAD, head, 1)
    return {
        "common/chat.cpp": [Edit(body, body + "\n\n// llamaprompt (an engine rewrite, see its adapt_tree.py): "
                                 "common_chat_templates_get_caps's choice, the caps themselves\n" + derived,
                                 speed=CAPS_LOOKUP, group="caps_lookup")],
        SERVER_COMMON: [Edit(CAPS_DECL, "    auto caps = llamaprompt_caps_lookup(opt.tmpls.get());"
                             "  // llamaprompt: an engine rewrite (adapt_tree.py)\n",
                             speed=CAPS_LOOKUP, group="caps_lookup")],
    }


# render_message_to_json (chat.cpp) builds the request's messages as JSON, then hands them to
# messages_inp_normalizer::normalize(const json &), which copies them whole (no normalization:
# `return messages;`) or message by message (`json copy = msg;`) -- every request, the local
# then destroyed. Now that call passes the local as an rvalue to an overload of normalize
# generated from its own body, which moves where the original copies; the same JSON.
NORMALIZE_MOVE = "the request's messages normalized by moving them, not copying them"
NORMALIZE_HEAD = "    json normalize(const json & messages) {\n"
NORMALIZE_CALL = "    return messages_inp_normalizer(c).normalize(messages);\n"
NORMALIZE_COPIES = (("            return messages;\n", "            return std::move(messages);\n"),
                    ("        for (const auto & msg : messages) {\n            json copy = msg;\n",
                     "        for (auto & msg : messages) {\n            json copy = std::move(msg);\n"))


def normalize_move_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """chat.cpp edits (a group): normalize's rvalue overload, and render_message_to_json's call of it."""
    chat = tree.read("common/chat.cpp")
    body = ""
    if chat.count(NORMALIZE_HEAD) == 1 and chat.count(NORMALIZE_CALL) == 1:
        at = chat.find(NORMALIZE_HEAD)
        body = chat[at:_block_end(chat, chat.find("{", at)) + 1] + "\n"
    derived = body.replace(NORMALIZE_HEAD, "    json normalize(json && messages) {\n", 1)
    for old, new in NORMALIZE_COPIES:
        derived = derived.replace(old, new) if body.count(old) == 1 else ""
    # what remains of the body names `messages` only where it did (is_array, the loop): no other read
    if not derived or len(re.findall(r"\bmessages\b", code_only(body))) != 4 or "msg" in derived.replace(
            "for (auto & msg : messages)", "").replace("json copy = std::move(msg);", ""):
        notes.append("common/chat.cpp: engine rewrite not applied (messages_inp_normalizer::normalize or its "
                     f"call in render_message_to_json is not as expected); upstream's code there (slower: "
                     f"{NORMALIZE_MOVE})")
        return []
    return [Edit(body, body + "    // llamaprompt (an engine rewrite, see its adapt_tree.py): the same, for messages "
                 "it may move from\n" + derived, speed=NORMALIZE_MOVE, group="normalize_move"),
            Edit(NORMALIZE_CALL, "    return messages_inp_normalizer(c).normalize(std::move(messages));\n",
                 speed=NORMALIZE_MOVE, group="normalize_move")]


# common_chat_templates_apply_jinja declared its own autoparser and analyzed the template into it;
# llamaprompt's analysis cache (src/cpp/shim_chat.cpp) then copied the cached analysis into that
# local on every request: some thirty strings and vectors. Now the local is a const reference to
# the cached analysis (shared, never changed after it is made). Applied only where the function's
# remaining code reads the analysis and nothing else: members read, the const methods below called
# on them, and the object passed to generate_parser (whose parameter is a const reference).
SHARED_ANALYSIS = "the template analysis: the cached one read in place, not copied for each request"
ANALYSIS_DECL = ("        struct autoparser::autoparser autoparser;\n"
                 "        llamaprompt_analyze_template(autoparser, tmpl);\n")
ANALYSIS_SHARED = ("        // llamaprompt (an engine rewrite, see adapt_tree.py): the cached analysis, not a copy\n"
                   "        const auto llamaprompt_analysis = llamaprompt_shared_analysis(tmpl);\n"
                   "        const struct autoparser::autoparser & autoparser = *llamaprompt_analysis;\n")
ANALYSIS_READ = re.compile(
    r"\bautoparser((?:\.\w+)+)(\s*\(\s*\))?(?=\s*(?:[)\];,?:]|[!=]=|&&|\|\||\.c_str\(\)))")
ANALYSIS_CONST_CALLS = {"empty", "size", "c_str", "str"}
ANALYSIS_PASSED = "llamaprompt_generate_parser(tmpl, params, autoparser)"


def shared_analysis_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """The chat.cpp edit that reads the cached template analysis in place (SHARED_ANALYSIS)."""
    chat = tree.read("common/chat.cpp")
    old = "        struct autoparser::autoparser autoparser;\n        autoparser.analyze_template(tmpl);\n"
    problem = ""
    if chat.count(old) != 1:
        problem = "its declaration and analysis are not two adjacent lines"
    else:
        at = chat.find(old) + len(old)
        end = chat.find("} catch (", at)
        upstream_call = ANALYSIS_PASSED.replace("llamaprompt_generate_parser",
                                                "autoparser::peg_generator::generate_parser")
        rest = code_only(chat[at:end]).replace(upstream_call, "")
        for m in ANALYSIS_READ.finditer(rest):
            members = m.group(1).split(".")[1:]
            if m.group(2) and members[-1] not in ANALYSIS_CONST_CALLS:
                problem = f"it calls autoparser{m.group(1)}()"
                break
        else:
            leftover = ANALYSIS_READ.sub("", rest)
            if end < 0 or re.search(r"\bautoparser\b(?!::)", leftover):
                problem = "the analysis is used other than by reading its members"
    if problem:
        notes.append(f"common/chat.cpp: engine rewrite not applied (the autoparser of "
                     f"common_chat_templates_apply_jinja: {problem}); the analysis is copied for each request "
                     f"(slower: {SHARED_ANALYSIS})")
        return []
    return [Edit(ANALYSIS_DECL, ANALYSIS_SHARED, speed=SHARED_ANALYSIS, group="shared_analysis")]


# _not_strings (the key rule of an object with additionalProperties: any key but the properties')
# walks a trie of the property names recursing once per character: a name of ~50,000 characters
# overflowed the stack (SIGSEGV, found by the fresh-user trial), and names of 40,000 bytes ran 9 s
# past a 10 s budget building a 411 MB rule. The stack guard and the time budget at each trie node.
# Its lambda's head differs between trees (an index in the pinned tree, the node in 0.3.35's).
TRIE_VISIT_HEADS = ("std::function<void(size_t)> visit = [&](size_t idx) {\n",
                    "std::function<void(const TrieNode &)> visit = [&](const TrieNode & node) {\n")
TRIE_GUARD = "            llamaprompt_schema_trie_step();  // llamaprompt: the stack guard and the time budget\n"


def trie_guard_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """The guard at each trie node of json-schema-to-grammar.cpp's _not_strings (TRIE_GUARD)."""
    rel = "common/json-schema-to-grammar.cpp"
    if not tree.contains(rel, "_not_strings("):
        return []
    text = tree.read(rel)
    heads = [h for h in TRIE_VISIT_HEADS if text.count(h) == 1]
    if len(heads) != 1:
        raise TreeError(f"{rel}: _not_strings's trie walk (one of {[h.strip() for h in TRIE_VISIT_HEADS]}) not found "
                        "once: llamaprompt must be adapted to this tree (a long property name overflows the stack)")
    return [Edit(heads[0], heads[0] + TRIE_GUARD)]


# tojson (value_to_json_internal, value.cpp) wrote a string value's escaped text one character at a
# time (`oss << c`: a stream insertion per byte), after copying the value's parts and joining them
# (`as_string().str()`), and inserted empty strings for the indentation and line breaks of compact
# output (indent < 0). Now the text is read from the value's parts where value_string_t::as_string()
# is `return val_str;` (the member_text probe), escaped the same way and written in runs between the
# characters that need an escape; the indentation and line breaks are inserted only when they are
# not empty; an object key that is a string value is printed as it is, not through a new string
# value holding a copy of its text. The same bytes; the same calls of the function (so the same
# stack-guard steps).
TOJSON = "tojson: a string's escaped text written in runs, not a stream insertion per character"
TOJSON_STRING_LOOP = """        oss << "\\"";
        for (char c : val->as_string().str()) {
            switch (c) {
                case '"': oss << "\\\\\\""; break;
                case '\\\\': oss << "\\\\\\\\"; break;
                case '\\b': oss << "\\\\b"; break;
                case '\\f': oss << "\\\\f"; break;
                case '\\n': oss << "\\\\n"; break;
                case '\\r': oss << "\\\\r"; break;
                case '\\t': oss << "\\\\t"; break;
                default:
                    if (static_cast<unsigned char>(c) < 0x20) {
                        char buf[7];
                        snprintf(buf, sizeof(buf), "\\\\u%04x", static_cast<unsigned char>(c));
                        oss << buf;
                    } else {
                        oss << c;
                    }
            }
        }
        oss << "\\"";
"""
TOJSON_STRING_RUNS = """        oss << "\\"";
        llamaprompt_json_escaped(oss, val);
        oss << "\\"";
"""
TOJSON_HELPER = """// llamaprompt (an engine rewrite, see its adapt_tree.py): the text of a string value escaped as
// value_to_json_internal's loop escaped it one character at a time -- a quote and a backslash by a
// backslash, \\b \\f \\n \\r \\t by name, other bytes below 0x20 as \\u00XX, every other byte
// as it is -- written in runs between the bytes that need an escape
static void llamaprompt_json_escape_text(std::ostringstream & oss, const std::string & text) {
    const char * run = text.data();
    const char * const end = run + text.size();
    for (const char * p = run; p != end; ++p) {
        const unsigned char c = static_cast<unsigned char>(*p);
        if (c >= 0x20 && c != '"' && c != '\\\\') {
            continue;
        }
        oss.write(run, p - run);
        run = p + 1;
        switch (c) {
            case '"': oss.write("\\\\\\"", 2); break;
            case '\\\\': oss.write("\\\\\\\\", 2); break;
            case '\\b': oss.write("\\\\b", 2); break;
            case '\\f': oss.write("\\\\f", 2); break;
            case '\\n': oss.write("\\\\n", 2); break;
            case '\\r': oss.write("\\\\r", 2); break;
            case '\\t': oss.write("\\\\t", 2); break;
            default: {
                char buf[7];
                snprintf(buf, sizeof(buf), "\\\\u%04x", c);
                oss.write(buf, 6);
            }
        }
    }
    oss.write(run, end - run);
}

static void llamaprompt_json_escaped(std::ostringstream & oss, const value & val) {
@PARTS@    llamaprompt_json_escape_text(oss, val->as_string().str());
}

// llamaprompt (an engine rewrite, see its adapt_tree.py): an object key as value_to_json_internal
// prints it -- a new string value with the key's text; a key that is a string value already is
// printed as it is (the same type, the same text: the same output, through the same call)
static value llamaprompt_json_key(const value & key) {
    if (typeid(*key) == typeid(value_string_t)) {
        return key;
    }
    return mk_val<value_string>(key->as_string().str());
}

"""
TOJSON_KEY = "value_to_json_internal(oss, mk_val<value_string>(pair.first->as_string().str()), "
TOJSON_KEY_NEW = "value_to_json_internal(oss, llamaprompt_json_key(pair.first), "
# value_string_t::as_string() returns val_str: its parts' texts, in order, are the text
TOJSON_PARTS = """    if (typeid(*val) == typeid(value_string_t)) {
        for (const auto & part : val->val_str.parts) {
            llamaprompt_json_escape_text(oss, part.val);
        }
        return;
    }
"""
TOJSON_INDENT = "                oss << indent_str() << (indent > 0 ? std::string(indent, ' ') : \"\");\n"
TOJSON_INDENT_NEW = ("                if (indent > 0) { oss << indent_str() << std::string(indent, ' '); }"
                     "  // llamaprompt: not \"\" << \"\"\n")
# 4 lines (two of them indented 4 more: the pattern is the end of each)
TOJSON_NEWLINE = "            oss << newline();\n"


def tojson_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """value.cpp edits (a group): value_to_json_internal's string escaping in runs
    (llamaprompt_json_escaped, declared before it) and no empty insertions for compact output."""
    code = code_only(tree.read("common/jinja/value.h"))
    at = code.find("struct value_string_t : public value_t {")
    body = code[at:_block_end(code, code.find("{", at)) + 1] if at >= 0 else ""
    parts = TOJSON_PARTS if norm(STRING_AS_STRING) in norm(body) else ""
    if not parts:
        notes.append("common/jinja/value.cpp: tojson joins a string value's parts before escaping them "
                     "(value_string_t::as_string() is not `return val_str;`)")
    helper = TOJSON_HELPER.replace("@PARTS@", parts)
    edits = [Edit(JSON_OF_VALUE, helper + JSON_OF_VALUE, speed=TOJSON, group="tojson"),
             Edit(TOJSON_STRING_LOOP, TOJSON_STRING_RUNS, speed=TOJSON, group="tojson"),
             Edit(TOJSON_KEY, TOJSON_KEY_NEW, speed=TOJSON, group="tojson"),
             Edit(TOJSON_INDENT, TOJSON_INDENT_NEW, count=2, speed=TOJSON, group="tojson"),
             Edit(TOJSON_NEWLINE, TOJSON_NEWLINE.replace("oss << newline();", "if (indent >= 0) { oss << newline(); }"),
                  count=4, speed=TOJSON, group="tojson")]
    return edits

# generate_parser and the specialized handlers render the prompt, then the generation prompt:
# common_chat_template_generation_prompt_impl renders the template again with a copy of the
# inputs that turns add_generation_prompt and the continuation off, then with
# add_generation_prompt on, and keeps what the second adds. For a request without
# add_generation_prompt (a continuation, or add_generation_prompt false) the first of those
# renders is the prompt's render again: the same template, messages, tools and context -- where
# the text shows that (the probe below), the build-tree copies hand the prompt just rendered to
# generation_prompt_impl (a guard declared after the prompt's statement, consumed by the next
# generation-prompt render on this thread for the same inputs object), which uses it instead of
# rendering it again (src/cpp/shim_chat.cpp llamaprompt_no_gen_render). For a request with
# add_generation_prompt, the second render (add_generation_prompt on, the continuation off) is the
# prompt's render again, by the same argument: that one takes it instead (llamaprompt_gen_render).
# The two renders of upstream differ only if the template reads the clock (strftime_now) across a
# second boundary.
NO_GEN_REUSE = ("generation prompt: the render without add_generation_prompt (or, for a request with it, the render "
                "with it) taken from the prompt's identical render")
NO_GEN_HEAD = ("    autoparser::generation_params params = inputs;\n"
               "    params.add_generation_prompt = false;\n"
               "    params.continue_final_message = COMMON_CHAT_CONTINUATION_NONE;\n"
               "    std::string no_gen_prompt    = ")
NO_GEN_RENDER = ("common_chat_template_direct_apply_impl(tmpl, params, messages_override, tools_override, "
                 "additional_context)")
# its second render, with add_generation_prompt: for a request with add_generation_prompt, the
# prompt's render again as well (the copy still differs from the inputs only in the continuation)
GEN_AGAIN = ("    params.add_generation_prompt = true;\n"
             "    std::string gen_prompt       = ")
# the fields the copy changes: the render must read neither (add_generation_prompt: the request's is off)
NO_GEN_CHANGED = ("continue_final_message", "has_continuation")
RENDER_FUNCS = ("common_chat_template_direct_apply_impl", "common_chat_template_generation_prompt_impl")
WRAPPER_BODY = (r"\{\s*return\s+{impl}\s*\(\s*tmpl\s*,\s*inputs\s*,\s*std\s*::\s*nullopt\s*,\s*std\s*::\s*nullopt\s*,"
                r"\s*std\s*::\s*nullopt\s*\)\s*;\s*\}")
PROMPT_RENDER = re.compile(r"\bdata\s*\.\s*prompt\s*=\s*(common_chat_template_direct_apply(?:_impl)?)\s*\(")
GEN_RENDER = re.compile(r"\s*data\s*\.\s*generation_prompt\s*=\s*(common_chat_template_generation_prompt(?:_impl)?)"
                        r"\s*\(")
RENDERED_GUARD = " llamaprompt_rendered_prompt llamaprompt_rendered_prompt_guard(data.prompt, &{inputs});"


def _parameter_lists(code: str, name: str) -> list[str]:
    """The parameter lists (whitespace removed) of the declarations and definitions of ``name``."""
    lists = []
    for m in re.finditer(r"\b" + name + r"\s*\(", code):
        close = _paren_end(code, m.end() - 1)
        params = re.sub(r"\s+", "", code[m.end():close])
        if params.startswith("constcommon_chat_template"):
            lists.append(params)
    return lists


def no_gen_reuse_problems(tree: Tree) -> list[str]:
    """Why the prompt's render may not stand for generation_prompt_impl's render without
    add_generation_prompt (empty: it may)."""
    text = tree.read("common/chat.cpp")
    if text.count(NO_GEN_HEAD + NO_GEN_RENDER + ";\n") != 1:
        return ["common_chat_template_generation_prompt_impl does not begin with the expected copy and render"]
    code = code_only(text)
    problems = []
    m = re.search(r"\bstd\s*::\s*string\s+common_chat_template_direct_apply_impl\s*\([^;{]*\)\s*\{", code)
    if m is None:
        return ["common_chat_template_direct_apply_impl's definition is not in common/chat.cpp"]
    body = code[m.end():_block_end(code, m.end() - 1)]
    uses = re.findall(r"(?<![\w.>])inputs\b(\s*\.\s*\w+)?", body)
    if any(not u for u in uses):
        problems.append("common_chat_template_direct_apply_impl passes `inputs` on whole")
    read = {u.strip(" .") for u in uses if u}
    for name in NO_GEN_CHANGED:
        if name in read:
            problems.append(f"common_chat_template_direct_apply_impl reads inputs.{name}")
    # both functions take the same parameters (and defaults), wherever they are declared
    for rel in ("common/chat.cpp", "common/chat.h", f"{HANDLER_DIR}/parsers.h"):
        if tree.has(rel):
            c = code_only(tree.read(rel))
            a, b = (_parameter_lists(c, f) for f in RENDER_FUNCS)
            if a and b and set(a) != set(b):
                problems.append(f"{rel}: {RENDER_FUNCS[0]} and {RENDER_FUNCS[1]} take different parameters")
    return problems


def _wrappers_forward(code: str) -> bool:
    """common_chat_template_direct_apply / _generation_prompt (tmpl, inputs) are exactly their
    _impl with three std::nullopt."""
    for name, impl in (("common_chat_template_direct_apply", RENDER_FUNCS[0]),
                       ("common_chat_template_generation_prompt", RENDER_FUNCS[1])):
        pattern = (r"\bstd\s*::\s*string\s+" + name + r"\s*\([^;{)]*\)\s*" + WRAPPER_BODY.replace("{impl}", impl))
        if len(re.findall(pattern, code)) != 1:
            return False
    return True


def _innermost_block(code: str, at: int) -> int:
    depth = 0
    for i in range(at - 1, -1, -1):
        if code[i] == "}":
            depth += 1
        elif code[i] == "{":
            if depth == 0:
                return i
            depth -= 1
    return -1


def no_gen_reuse_edits(tree: Tree, rel: str, wrappers_forward: bool) -> list[Edit]:
    """Edits of ``rel``: after each `data.prompt = <render>(ARGS);` that is directly followed by
    `data.generation_prompt = <generation prompt>(ARGS);` (same ARGS, the same family: both
    _impl, or both the forwarding wrappers), a guard handing the prompt to that render."""
    text = tree.read(rel)
    code = code_only(text)
    sites: dict[str, list[int]] = {}
    blocks: list[int] = []
    for m in PROMPT_RENDER.finditer(code):
        close = _paren_end(code, m.end() - 1)
        semi = re.match(r"\s*;", code[close + 1:]) if close >= 0 else None
        gen = GEN_RENDER.match(code, close + 1 + semi.end()) if semi else None
        if gen is None:
            continue
        gen_close = _paren_end(code, gen.end() - 1)
        if gen_close < 0 or not re.match(r"\s*;", code[gen_close + 1:]):
            continue
        args = re.sub(r"\s+", "", code[m.end():close])
        if (gen.group(1) != m.group(1).replace("direct_apply", "generation_prompt")
                or re.sub(r"\s+", "", code[gen.end():gen_close]) != args
                or (not m.group(1).endswith("_impl") and not wrappers_forward)):
            continue
        inputs = args.split(",")[1] if args.count(",") >= 1 else ""
        before = code[:m.start()].rstrip()
        if not re.fullmatch(r"\w+", inputs) or not before or before[-1] not in ";{}":
            continue  # not a statement of its own (e.g. the body of an if without braces)
        blocks.append(_innermost_block(code, m.start()))
        end = close + 1 + semi.end()
        gen_end = gen_close + 1 + re.match(r"\s*;", code[gen_close + 1:]).end()
        # the edit's text: both statements (the guard goes between them, on the prompt's last line)
        key = (text[m.start():gen_end], text[m.start():end] + RENDERED_GUARD.format(inputs=inputs)
               + text[end:gen_end])
        sites.setdefault(key, []).append(m.start())
    if len(set(blocks)) != len(blocks):
        return []  # two guards would share a scope (one name): none
    edits = []
    for (old, new), starts in sites.items():
        found, at = [], text.find(old)
        while at >= 0:
            found.append(at)
            at = text.find(old, at + 1)
        if found == starts:  # every occurrence of this text is such a site
            edits.append(Edit(old, new, len(starts), speed=NO_GEN_REUSE, group=f"no_gen_reuse {rel}"))
    return edits


def no_gen_reuse_rewrites(tree: Tree, notes: list[str], handlers: list[Rewrite],
                          probed: dict[str, list[Edit]]) -> list[Rewrite]:
    """The no-generation-prompt render reuse: its edit of generation_prompt_impl (added to
    ``probed``) and of the call sites in common/chat.cpp, the generator and the handler files
    (added to their rewrites in ``handlers``, or as new ones); returns the handler rewrites."""
    problems = no_gen_reuse_problems(tree)
    if problems:
        notes.append("common/chat.cpp: the generation prompt renders the prompt again for requests without "
                     f"add_generation_prompt ({'; '.join(problems)})")
        return handlers
    forward = _wrappers_forward(code_only(tree.read("common/chat.cpp")))
    both = NO_GEN_HEAD + NO_GEN_RENDER + ";\n" + GEN_AGAIN + NO_GEN_RENDER + ";\n"
    if tree.read("common/chat.cpp").count(both) == 1:  # the render with add_generation_prompt too
        impl = Edit(both, NO_GEN_HEAD + "llamaprompt_no_gen_render_first(&inputs, !inputs.add_generation_prompt, "
                    "[&] { return " + NO_GEN_RENDER + "; });\n" + GEN_AGAIN
                    + "llamaprompt_gen_render(&inputs, inputs.add_generation_prompt, [&] { return "
                    + NO_GEN_RENDER + "; });\n", speed=NO_GEN_REUSE)
    else:
        notes.append("common/chat.cpp: generation_prompt_impl's render with add_generation_prompt is not written "
                     "as expected: the prompt's render stands only for its render without it")
        impl = Edit(NO_GEN_HEAD + NO_GEN_RENDER + ";\n",
                    NO_GEN_HEAD + "llamaprompt_no_gen_render(&inputs, !inputs.add_generation_prompt, [&] { return "
                    + NO_GEN_RENDER + "; });\n", speed=NO_GEN_REUSE)
    probed.setdefault("common/chat.cpp", []).extend([impl] + no_gen_reuse_edits(tree, "common/chat.cpp", forward))
    folder = tree.root / HANDLER_DIR
    files = [f"{HANDLER_DIR}/{p.name}" for p in sorted(folder.glob("*.cpp"))] if folder.is_dir() else []
    by_file = {rw.rel: rw for rw in handlers}
    out = list(handlers)
    for rel in files + ([GENERATOR] if tree.has(GENERATOR) else []):
        edits = no_gen_reuse_edits(tree, rel, forward)
        if not edits:
            continue
        if rel in by_file:  # before the stop point's edit, whose line (the second statement) they keep
            by_file[rel].edits[:0] = edits
        else:
            out.append(Rewrite(rel, f"mirror/{rel}", edits))
    return out


def mirror_headers(tree: Tree, out_dir: Path, rewritten: dict[str, str]) -> None:
    """generated/mirror/common and generated/mirror/vendor/nlohmann: every header of the tree's
    common/ and its vendored nlohmann/json (byte for byte, or rewritten).

    _core includes common/ from here, so that each of its files sees the same (rewritten)
    headers, whichever header includes which; _core, llama-common and mtmd include
    <nlohmann/json.hpp> from here (CMakeLists.txt)."""
    mirror = out_dir / "generated" / "mirror"
    wanted: set[Path] = set()
    nlohmann = tree.root / "vendor" / "nlohmann"
    for path in sorted((tree.root / "common").rglob("*")) + sorted(nlohmann.glob("*") if nlohmann.is_dir() else []):
        if path.suffix not in (".h", ".hpp") or not path.is_file():
            continue
        rel = path.relative_to(tree.root).as_posix()
        text = rewritten.get(rel)
        if text is None:
            text = tree.read(rel)
        target = mirror / rel
        wanted.add(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text(encoding="utf-8", errors="surrogateescape") != text:
            target.write_text(text, encoding="utf-8", errors="surrogateescape")
    if mirror.exists():
        for stale in [p for p in mirror.rglob("*") if p.suffix in (".h", ".hpp") and p not in wanted]:
            stale.unlink()


# ---------------------------------------------------------------------------
# the prompt-only path of specialized handlers
# ---------------------------------------------------------------------------
# A specialized handler (common/parsers/*.cpp, `common_chat_params_init_<name>`) renders the
# prompt, then the generation prompt (two more renders), then builds its parser and grammar.
# Where the code after the prompt is computed provably reads neither the messages nor the
# prompt -- only non-message inputs, which the parser-inputs key covers -- the build-tree copy
# of the handler's file calls llamaprompt_prompt_ready(__func__) at that point: with
# apply_template's prompt-only path on and these inputs known good, the handler stops there
# (src/cpp/shim_chat.cpp). The probe is per handler, on its text (comments and literals
# blanked); a handler it cannot prove runs in full, as before.

HANDLER_DIR = "common/parsers"
HANDLER_DEF = re.compile(r"common_chat_params\s+(common_chat_params_init_\w+)\s*\([^)]*\)\s*\{")
STOP_STATEMENT = re.compile(r"\bdata\.generation_prompt\s*=(?!=)")
CONTINUATION_BLOCK = re.compile(r"if\s*\(\s*inputs\.has_continuation\(\)\s*\)\s*\{")
PROMPT_READY = "if (llamaprompt_prompt_ready(__func__)) { return data; } "
# A handler whose code after the prompt reads the generation prompt as well (ling3 and minimax-m3
# look for an unclosed think tag in it) stops right after the generation prompt's own statement
# instead, when that statement is its render alone: the code after it then depends on the keyed
# inputs and the generation prompt only, and the memo's key holds both (src/cpp/shim_chat.cpp
# llamaprompt_prompt_ready_after). Its two renders still run; the parser and grammar do not.
PROMPT_READY_AFTER = (" if (llamaprompt_prompt_ready_after(data.generation_prompt, __func__)) "
                      "{ return data; }")
PROMPT_ONLY_AFTER = "prompt-only after its generation prompt"
IDENT = r"(?<![.>:\w])[A-Za-z_]\w*\b"
# names that are not a handler's locals (keywords, types, its parameters and result)
NOT_LOCALS = {"auto", "const", "static", "constexpr", "bool", "int", "size_t", "if", "else", "for", "while",
              "return", "true", "false", "nullptr", "std", "json", "ordered_json", "string", "data", "inputs", "tmpl"}
# a stop point returns the function's result where it is (`return data;`): the result must be a
# `common_chat_params data` declared at the function's top level, and the stop point there too
RESULT_DECL = re.compile(r"(?:^|[;{}])\s*common_chat_params\s+data\s*;")


def _return_problems(body: str, at: int) -> list[str]:
    """Why ``return data;`` at offset ``at`` of a function ``body`` (code_only) would not return
    the function's result (empty: it would)."""
    before = body[:at]
    if before.count("{") != before.count("}"):
        return ["its stop point would not be at its top level"]
    for m in RESULT_DECL.finditer(before):
        head = before[:m.end()]
        if head.count("{") == head.count("}"):
            return []
    return ["its result is not a `common_chat_params data` declared at its top level"]


def _digit_separator(text: str, i: int) -> bool:
    """Whether the quote at ``i`` separates digits of a number (``1'000``, ``0xFF'FF``)."""
    token = re.search(r"[\w']*$", text[max(0, i - 40):i])
    return bool(token and token.group(0)[:1].isdigit() and i + 1 < len(text) and text[i + 1].isalnum())


CODE_MARK = re.compile(r"//|/\*|R\"|[\"']")  # where a comment or a literal may begin
NOT_NEWLINE = re.compile(r"[^\n]")


def code_only(text: str, keep_literals: bool = False) -> str:
    """``text`` with comments and the insides of string / character literals blanked (same
    length, same line breaks), so that code patterns match code only; with ``keep_literals``,
    only the comments."""
    out, i, n = list(text), 0, len(text)

    def blank(a: int, b: int, literal: bool = False) -> None:
        b = min(b, n)
        if a < b and not (literal and keep_literals):
            out[a:b] = NOT_NEWLINE.sub(" ", text[a:b])

    while i < n:
        mark = CODE_MARK.search(text, i)
        if mark is None:
            break
        i = mark.start()
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif (raw := re.match(r'R"([^(\s]*)\(', text[i:i + 20])) is not None:
            end = text.find(")" + raw.group(1) + '"', i)
            j = n if end < 0 else end + len(raw.group(1)) + 2
            blank(i + 1, j - 1, literal=True)
            i = j
            continue
        elif text[i] == "'" and _digit_separator(text, i):
            i += 1  # a digit separator (1'000), not a character literal
            continue
        elif text[i] in "\"'":
            j = i + 1
            while j < n and text[j] != text[i]:
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j, literal=True)
            i = j + 1
            continue
        else:
            i += 1
            continue
        blank(i, j)
        i = j
    return "".join(out)


def _block_end(code: str, open_at: int) -> int:
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _statements(code: str) -> list[tuple[str, str]]:
    """(statement, the headers of the blocks around it) for each statement of ``code``
    (statements end at ``;``, ``{`` and ``}``; a ``{`` makes the text before it a header)."""
    out, headers, start = [], [], 0
    for i, c in enumerate(code):
        if c in ";{}":
            text = code[start:i]
            if c == "{":
                headers.append(text)
            elif c == "}" and headers:
                headers.pop()
            if text.strip():
                out.append((text, " ".join(headers)))
            start = i + 1
    if code[start:].strip():
        out.append((code[start:], " ".join(headers)))
    return out


def _written(statement: str) -> set[str]:
    """The names a statement may set: declared or assigned (left of ``=``, compound
    assignments, ``++``/``--``), the objects whose methods it calls, the names it passes
    whole to a call (out-parameters) and range-for variables."""
    names: set[str] = set()
    lhs = re.match(r"^(.*?)(?<![=!<>+\-*/%&|^])=(?!=)", statement, re.DOTALL)
    if lhs:
        names |= set(re.findall(IDENT, lhs.group(1)))
    names |= set(re.findall(r"(?<![.>:\w])(\w+)\s*(?:[-+*/%&|^]|<<|>>)=", statement))
    names |= set(re.findall(r"(?<![.>:\w])(\w+)\s*(?:\+\+|--)", statement))
    names |= set(re.findall(r"(?:\+\+|--)\s*(\w+)", statement))
    names |= set(re.findall(r"(?<![.>:\w])(\w+)\s*(?:\.|->)\s*\w+\s*\(", statement))
    names |= set(re.findall(r"[(,]\s*&?\s*(\w+)\s*(?=[,)])", statement))
    names |= set(re.findall(r"\bfor\s*\([^:;]*?(\w+)\s*:", statement))
    return names - NOT_LOCALS


def _tainted(before: str) -> set[str]:
    """The names that statements before the prompt may set from the messages: a statement
    that involves the messages (or a name already tainted), or sits in a block whose header
    does, taints every name it may set (to a fixed point)."""
    tainted: set[str] = set()
    statements = _statements(before)

    def involves(text: str) -> bool:
        return bool(re.search(r"\bmessages\b", text)) or bool(set(re.findall(IDENT, text)) & tainted)

    changed = True
    while changed:
        changed = False
        for text, headers in statements:
            if involves(text) or involves(headers):
                new = _written(text) - tainted
                if new:
                    tainted |= new
                    changed = True
    return tainted


def _without_calls(code: str, functions: tuple[str, ...]) -> str:
    """``code`` with each call of ``functions`` (the name and its parenthesized arguments) blanked."""
    for fn in functions:
        while (m := re.search(r"\b" + fn + r"\s*\(", code)) is not None:
            depth, i = 0, m.end() - 1
            while i < len(code):
                depth += {"(": 1, ")": -1}.get(code[i], 0)
                if depth == 0:
                    break
                i += 1
            code = code[:m.start()] + " " * (i + 1 - m.start()) + code[i + 1:]
    return code


RENDERS = ("common_chat_template_direct_apply_impl", "common_chat_template_generation_prompt_impl")


def _after_prompt_problems(after: str, messages: str, whole_inputs: str,
                           generation_prompt_known: bool = False) -> list[str]:
    """What the code ``after`` a stop point must not do: read or change the prompt or (unless
    ``generation_prompt_known``: the stop point follows its render and keys on it) the
    generation prompt, pass its result on, read ``messages`` (a regex of the names that carry
    them), catch exceptions, pass ``inputs`` whole (searched in ``whole_inputs``), or read an
    ``inputs`` field that the parser-inputs key leaves out."""
    after_result = re.sub(r"\breturn\s+data\s*;", " ", after)  # the function's own result
    generation_prompt = r"(?!)" if generation_prompt_known else r"\bdata\s*\.\s*generation_prompt\b"
    checks = ((after_result, r"\bdata\s*\.\s*prompt\b", "reads or changes the prompt"),
              (after_result, generation_prompt, "reads the generation prompt"),
              (after_result, r"\bdata\b(?!\s*\.\s*\w)", "passes its result on or copies it"),
              (after_result, rf"\b({messages})\b", "reads the messages"),
              (after_result, r"\b(try|catch)\b", "catches exceptions"),
              (whole_inputs, r"\binputs\b(?!\s*\.)", "passes the whole inputs on"))
    problems = [f"after the prompt, it {what}" for text, pattern, what in checks if re.search(pattern, text)]
    unkeyed = set(re.findall(r"\binputs\s*\.\s*(\w+)", after)) - KEYED_FIELDS - {"has_continuation", "messages"}
    if unkeyed:
        problems.append(f"after the prompt, it reads inputs.{', inputs.'.join(sorted(unkeyed))} (not in the key)")
    return problems


# A handler may finish its prompt right after the generation prompt: gemma4 appends the model's
# turn opener to a prompt that ends a turn. Such a block, right after the generation prompt's
# own statement, is accepted as the prompt's last step when it is exactly
#   if (COND) { data.generation_prompt = "..."; data.prompt += data.generation_prompt; }
# (no else): COND reads only keyed `inputs` fields and `data.prompt`, through string_ends_with /
# string_starts_with (common.h's, pure); the body only assigns string literals to the generation
# prompt and appends it (after such an assignment) or literals to the prompt. It reads nothing the
# generation prompt's render computed, so running it before that render gives the full handler's
# prompt: the build-tree copy runs a copy of it (comments removed, one line) there when the stop
# point is armed, then stops (FIXUP_READY); the handler's own statements run unchanged otherwise.
GENERATION_PROMPT_RENDER = re.compile(
    r"\s*data\s*\.\s*generation_prompt\s*=\s*common_chat_template_generation_prompt(?:_impl)?\s*\(\s*tmpl\s*,"
    r"\s*inputs\s*\)\s*;\s*")
FIXUP_CALLS = ("string_ends_with", "string_starts_with")
FIXUP_STATEMENTS = (
    re.compile(r'\s*data\s*\.\s*generation_prompt\s*=\s*(?:"[ ]*"\s*)+'),  # a literal (blanked: code_only)
    re.compile(r"\s*data\s*\.\s*prompt\s*\+=\s*data\s*\.\s*generation_prompt\s*"),
    re.compile(r'\s*data\s*\.\s*prompt\s*\+=\s*(?:"[ ]*"\s*)+'),
)
FIXUP_ARMED = "if (llamaprompt_prompt_stop_armed(__func__)) { "
FIXUP_READY = " llamaprompt_prompt_stop(); return data; } "


def _prompt_fixup(body: str, stop: re.Match) -> tuple[tuple[int, int] | None, list[str]]:
    """((start, end) of the prompt fix-up block right after the generation prompt's statement at
    ``stop``, or None), why it is not one (empty when it is)."""
    head = re.compile(r"\s*if\s*\(").match(body, body.find(";", stop.end()) + 1)
    if head is None:
        return None, ["no prompt fix-up block follows the generation prompt"]
    cond_end = _paren_end(body, head.end() - 1)
    brace = re.compile(r"\s*\{").match(body, cond_end + 1) if cond_end > 0 else None
    close = _block_end(body, brace.end() - 1) if brace else -1
    if close < 0:
        return None, ["the block after the generation prompt is not `if (...) { ... }`"]
    problems = []
    if GENERATION_PROMPT_RENDER.fullmatch(body, stop.start(), head.start()) is None:
        problems.append("the generation prompt is not computed by its render alone")
    if re.match(r"\s*else\b", body[close + 1:]):
        problems.append("the fix-up block has an else branch")
    cond = body[head.end():cond_end]
    fields = set(re.findall(r"\binputs\s*\.\s*(\w+)", cond))
    rest = re.sub(r"\binputs\s*\.\s*\w+|\bdata\s*\.\s*prompt\b|\b(?:" + "|".join(FIXUP_CALLS) + r")\b(?=\s*\()|&&|\|\|",
                  " ", cond)
    if fields - KEYED_FIELDS or not re.fullmatch(r'[\s()!,"]*', rest):
        problems.append("the fix-up block's condition reads more than keyed inputs fields and the prompt's ends")
    seen_literal = False
    statements = body[brace.end():close].split(";")
    if statements[-1].strip():
        problems.append("the fix-up block's body is not a list of statements")
    for text in statements[:-1]:
        kind = next((k for k, pattern in enumerate(FIXUP_STATEMENTS) if pattern.fullmatch(text)), None)
        if kind is None or (kind == 1 and not seen_literal):
            shown = " ".join(text.split())
            problems.append(f"the fix-up block does more than append literals to the prompt: {shown!r}")
            break
        seen_literal |= kind == 0
    return (head.start(), close + 1), problems


def _text_problems(raw: str, code: str) -> list[str]:
    """What a handler's body (``raw``, and ``code``: comments and literals blanked) must not use
    for the probe's text rules to read it as the compiler does: line continuations (they join
    a comment, a literal or a name with the next line), preprocessor lines (``#if 0`` hides code
    and braces, ``#include`` brings code in) and ``goto`` (it jumps past the rules' blocks)."""
    problems = []
    if re.search(r"\\[ \t]*\r?\n", raw):
        problems.append("it uses a line continuation")
    if re.search(r"^[ \t]*#", code, re.MULTILINE):
        problems.append("it has preprocessor lines")
    if re.search(r"\bgoto\b", code):
        problems.append("it uses goto")
    return problems


def _prompt_only_problems(body: str, stop: re.Match, macros: set[str],
                          fixup: tuple[int, int] | None = None, after_generation_prompt: bool = False) -> list[str]:
    """Why the handler body cannot stop at ``stop`` (empty: it can), or, with ``fixup`` (the
    span of a prompt fix-up block), after that block, or, with ``after_generation_prompt``,
    right after the generation prompt's statement (which must then be its render alone), keyed
    on the generation prompt. Conservative: text rules that a handler written another way
    fails, never the reverse (tests/test_adapt_tree.py)."""
    before = body[:stop.start()]
    problems = []
    if after_generation_prompt and GENERATION_PROMPT_RENDER.fullmatch(
            body, stop.start(), body.find(";", stop.end()) + 1) is None:
        problems.append("the generation prompt is not computed by its render alone")
    if before.count("{") != before.count("}"):
        problems.append("the generation prompt is not assigned at the function's top level")
    end = fixup[1] - 1 if fixup else body.find(";", stop.end())
    after = body[end + 1:]
    cont = CONTINUATION_BLOCK.search(after)
    if cont:  # a continuation never takes the prompt-only path
        close = _block_end(after, cont.end() - 1)
        after = after[:cont.start()] + after[close + 1:]
    problems += _after_prompt_problems(after, "messages", re.sub(r"\breturn\s+data\s*;", " ", after),
                                       generation_prompt_known=after_generation_prompt)
    if re.search(r"\b(try|catch)\b", before):
        problems.append("it catches exceptions")
    # aliases made before the prompt: of the result, of the inputs, captured by a lambda
    if re.search(r"&\s*data\b|=\s*data\b(?!\s*\.)|=\s*&?\s*data\s*\.\s*(prompt|generation_prompt)\b", before):
        problems.append("before the prompt, it takes a reference or pointer to its result")
    # std::addressof(data.prompt), f(x, data), T & r{data.prompt} (a brace after a name; not a block's)
    inits = [m for m in re.finditer(r"(\w+)\s*\{\s*[&*]?\s*data\b", before) if m.group(1) not in ("else", "do", "try")]
    if re.search(r"[(,]\s*[&*]?\s*data\b", before) or inits:
        problems.append("before the prompt, it passes its result or a part of it to a call or an initializer")
    if re.search(r"\binputs\b(?!\s*\.)", _without_calls(before, RENDERS)):
        problems.append("before the prompt, it passes the whole inputs to something other than a render")
    if re.search(r"\[\s*(?:[&=]|this\b|\w+\s*[,\]])", before):
        problems.append("before the prompt, it defines a capturing lambda")
    used = set(re.findall(r"\b[A-Za-z_]\w*\b", body)) & macros
    if used:
        problems.append(f"it uses the file's macro {', '.join(sorted(used))}")
    # locals set before the prompt from the messages, directly or not, read after it
    shared = set(re.findall(IDENT, before)) & set(re.findall(IDENT, after)) - NOT_LOCALS
    for name in sorted(shared & _tainted(before)):
        problems.append(f"'{name}', read after the prompt, may depend on the messages")
    return problems


def handler_rewrites(tree: Tree, notes: list[str]) -> tuple[list[Rewrite], dict[str, str]]:
    """(the handler files' rewrites, {handler: "prompt-only" or why not})."""
    rewrites, verdicts = [], {}
    folder = tree.root / HANDLER_DIR
    for path in sorted(folder.glob("*.cpp")) if folder.is_dir() else []:
        rel = f"{HANDLER_DIR}/{path.name}"
        text = tree.read(rel)
        code = code_only(text)
        macros = set(re.findall(r"^\s*#\s*define\s+(\w+)", code, re.MULTILINE))
        edits = []
        for m in HANDLER_DEF.finditer(code):
            name = m.group(1)
            open_at = m.end() - 1
            close = _block_end(code, open_at)
            body = code[open_at + 1:close]
            stop = STOP_STATEMENT.search(body)
            problems = ["no generation prompt assigned"] if stop is None else _prompt_only_problems(body, stop, macros)
            text_problems = _text_problems(text[open_at + 1:close], body)
            if text_problems:
                verdicts[name] = "; ".join(text_problems)
                continue
            insert = PROMPT_READY
            if problems and stop is not None:
                # the prompt may end with a fix-up block after the generation prompt
                fixup, fixup_problems = _prompt_fixup(body, stop)
                if fixup is not None and not fixup_problems:
                    fixup_problems = _prompt_only_problems(body, stop, macros, fixup)
                    # common.h's functions, not an overload or a definition of the file's own
                    if re.search(r"\b(?:" + "|".join(FIXUP_CALLS) + r")\b", code[:open_at] + code[close:]):
                        fixup_problems.append("the file names " + " or ".join(FIXUP_CALLS) + " outside the handler")
                if fixup is not None and not fixup_problems:
                    block = code_only(text, keep_literals=True)[open_at + 1 + fixup[0]:open_at + 1 + fixup[1]]
                    # one line (the file's line numbers stay), whitespace outside string literals collapsed
                    block = re.sub(r'("(?:[^"\\\n]|\\.)*")|\s+', lambda m: m.group(1) or " ", block).strip()
                    problems, insert = [], FIXUP_ARMED + block + FIXUP_READY
                elif fixup is not None:
                    problems.append("with its prompt fix-up block: " + "; ".join(fixup_problems))
            verdict = "prompt-only"
            at = open_at + 1 + stop.start()
            after_problems = (_prompt_only_problems(body, stop, macros, after_generation_prompt=True)
                              if problems and stop is not None else [])
            if problems and stop is not None and not after_problems:
                # the stop point right after the generation prompt's statement, keyed on it
                problems, insert, verdict = [], PROMPT_READY_AFTER, PROMPT_ONLY_AFTER
                at = open_at + 1 + body.find(";", stop.end()) + 1
                if "\n" in text[open_at + 1 + stop.start():at]:
                    problems.append("the generation prompt's statement spans lines")
            elif after_problems:
                # what the stop point after the generation prompt adds (a problem of the code after
                # it is a problem of both stop points: said once)
                more = [p for p in after_problems if p not in problems]
                problems.append("after its generation prompt: " + ("; ".join(more) if more else "the same"))
            problems += _return_problems(body, at - open_at - 1)
            if problems:
                verdicts[name] = "; ".join(problems)
                continue
            # the statement's own text, unique in the file with its line's start
            line_start = text.rfind("\n", 0, at) + 1
            old = text[line_start:text.find("\n", at)]
            if text.count(old) != 1:
                verdicts[name] = "its generation-prompt line is not unique in the file"
                continue
            edits.append(Edit(old, old[:at - line_start] + insert + old[at - line_start:]))
            verdicts[name] = verdict
        if edits:
            rewrites.append(Rewrite(rel, f"mirror/{rel}", edits))
    if not verdicts:
        notes.append(f"{HANDLER_DIR}: no specialized handler files in this tree; none takes the prompt-only path")
    return rewrites, verdicts


# The autoparser's generate_parser (common/chat-auto-parser-generator.cpp) renders the prompt,
# the generation prompt (two more renders) and, with a continuation, appends the continued
# message to both; then it builds the parser and grammar from non-message inputs and a copy of
# the generation prompt made before any continuation (a literal prefix: the argument that lets
# the prompt-only path skip generate_parser for add_generation_prompt requests). Where its text
# shows exactly that, the build-tree copy calls llamaprompt_prompt_ready(nullptr)
# just before the parser is built: requests that continue the final message or turn
# add_generation_prompt off then stop there once their non-message inputs are known good
# (src/cpp/shim_chat.cpp llamaprompt_generate_parser). Otherwise they run in full, as before.
GENERATOR = "common/chat-auto-parser-generator.cpp"
GENERATOR_DEF = re.compile(r"common_chat_params\s+peg_generator\s*::\s*generate_parser\s*\([^)]*\)\s*\{")
GENERATOR_STOP = re.compile(r"\bauto\s+parser\s*=\s*autoparser\s*\.\s*build_parser\s*\(\s*inputs\s*,\s*(\w+)\s*\)\s*;")
GENERATOR_READY = "if (llamaprompt_prompt_ready(nullptr)) { return data; } "
# the autoparser's other sources: none may read the continued message (the parser is built from
# the key's inputs and the generation prompt only)
AUTOPARSER_SOURCES = ("common/chat-auto-parser-generator.cpp", "common/chat-auto-parser-helpers.cpp",
                      "common/chat-diff-analyzer.cpp", "common/chat-peg-parser.cpp")


def _generator_problems(tree: Tree, code: str, raw: str) -> tuple[list[str], int]:
    """(why generate_parser cannot stop before its parser, the stop point's offset in ``code``;
    ``raw``: the file's text, of which ``code`` is the code_only form)."""
    bodies = []
    for m in GENERATOR_DEF.finditer(code):
        close = _block_end(code, m.end() - 1)
        body = code[m.end():close]
        if re.search(r"common_chat_template_direct_apply\s*\(\s*tmpl\s*,\s*inputs\s*\)", body):
            bodies.append((m.end(), body))
    if len(bodies) != 1:
        return [f"{len(bodies)} generate_parser definitions render the prompt (expected 1)"], -1
    start, body = bodies[0]
    text_problems = _text_problems(raw[start:start + len(body)], body)
    if text_problems:
        return text_problems, -1
    stops = list(GENERATOR_STOP.finditer(body))
    if len(stops) != 1:
        return [f"'auto parser = autoparser.build_parser(inputs, ...);' occurs {len(stops)} times (expected 1)"], -1
    stop = stops[0]
    copy = stop.group(1)
    before, after = body[:stop.start()], body[stop.start():]
    problems = []
    if before.count("{") != before.count("}"):
        problems.append("the parser is not built at the function's top level")
    else:
        problems += _return_problems(before, len(before))
    if not re.search(r"\b" + copy + r"\s*=\s*data\s*\.\s*generation_prompt\s*;", before):
        problems.append(f"'{copy}' is not a copy of the generation prompt")
    if len(re.findall(r"\b" + copy + r"\b", before)) != 1 or len(re.findall(r"\b" + copy + r"\b", after)) != 1:
        problems.append(f"'{copy}' is used other than as the parser's generation prompt")
    # `inputs` whole goes to build_parser only: the rest of the code after that statement
    rest = after[stop.end() - stop.start():]
    problems += _after_prompt_problems(after, "messages|continue_msg|has_continuation", rest)
    if re.search(r"\b(try|catch)\b", before):
        problems.append("it catches exceptions")
    shared = set(re.findall(IDENT, before)) & set(re.findall(IDENT, after)) - NOT_LOCALS - {copy, "autoparser"}
    if shared:
        problems.append(f"after the prompt, it reads {', '.join(sorted(shared))}, set before it")
    # the parser itself: no autoparser source reads the continued message, except this prologue
    for rel in AUTOPARSER_SOURCES:
        if not tree.has(rel):
            continue
        text = code_only(tree.read(rel))
        if rel == GENERATOR:
            text = text[:start] + " " * len(before) + text[start + len(before):]
        if re.search(r"\b(continue_msg|has_continuation)\b", text):
            problems.append(f"{rel} reads the continued message outside generate_parser's prompt")
    return problems, start + stop.start()


def generator_rewrite(tree: Tree, notes: list[str]) -> tuple[list[Rewrite], str]:
    """(generate_parser's stop-point rewrite, if its text proves it; "prompt-only" or why not)."""
    if not tree.has(GENERATOR):
        notes.append(f"{GENERATOR}: not in this tree; requests that continue the final message or turn "
                     "add_generation_prompt off run the full path")
        return [], f"{GENERATOR} is not in this tree"
    text = tree.read(GENERATOR)
    problems, at = _generator_problems(tree, code_only(text), text)
    if problems:
        verdict = "; ".join(problems)
        notes.append(f"{GENERATOR}: generate_parser has no prompt-only stop point ({verdict}); requests that "
                     "continue the final message or turn add_generation_prompt off run the full path")
        return [], verdict
    line_start = text.rfind("\n", 0, at) + 1
    old = text[line_start:text.find("\n", at)]
    if text.count(old) != 1:
        return [], "its build_parser line is not unique in the file"
    edit = Edit(old, old[:at - line_start] + GENERATOR_READY + old[at - line_start:])
    return [Rewrite(GENERATOR, f"mirror/{GENERATOR}", [edit])], "prompt-only"


# common_chat_try_specialized_template chooses a handler by the template's source alone: each
# branch is `if (<src.find(...) tests, or helpers called with src only>) { ...; return
# common_chat_params_init_<name>(...); }` and it ends with `return std::nullopt;`. Where its text
# shows exactly that, a template that took no handler once takes none again, and the fast path
# skips the chain of source searches for it (src/cpp/shim_chat.cpp, LP_HANDLER_CHOICE_BY_SOURCE).
HANDLER_CHOICE_DEF = re.compile(
    r"std::optional<common_chat_params>\s+common_chat_try_specialized_template\s*\([^)]*\)\s*\{")
SOURCE_ONLY_NAMES = {"src", "find", "std", "string", "npos"}


def handler_choice_problems(tree: Tree) -> list[str]:
    """Why the handler choice may depend on more than the template's source (empty: it does not)."""
    code = code_only(tree.read("common/chat.cpp"))
    m = HANDLER_CHOICE_DEF.search(code)
    if not m:
        return ["common_chat_try_specialized_template's definition is not found"]
    close = _block_end(code, m.end() - 1)
    body, i, problems = code[m.end():close], 0, []
    while True:
        rest = body[i:]
        if re.fullmatch(r"\s*return\s+std::nullopt\s*;\s*", rest):
            return problems
        head = re.match(r"\s*if\s*\(", rest)
        if not head:
            return problems + [f"a statement other than a source test: '{' '.join(rest.split())[:60]}'"]
        depth, j = 0, head.end() - 1
        while j < len(rest):
            depth += {"(": 1, ")": -1}.get(rest[j], 0)
            if depth == 0:
                break
            j += 1
        cond = rest[head.end():j]
        helpers = set(re.findall(r"\b(\w+)\s*\(\s*src\s*\)", cond))
        names = set(re.findall(r"[A-Za-z_]\w*", cond)) - SOURCE_ONLY_NAMES - helpers
        if names:
            problems.append(f"a branch tests {', '.join(sorted(names))}, not only the source")
        block = re.match(r"\s*\{", rest[j + 1:])
        if not block:
            return problems + ["a branch without a block"]
        open_at = j + 1 + block.end() - 1
        end = _block_end(rest, open_at)
        if not re.search(r"\breturn\s+common_chat_params_init_\w+\s*\([^;]*\)\s*;\s*$", rest[open_at + 1:end]):
            problems.append("a branch does not end by returning a handler's result")
        i += end + 1


# chat.cpp tests the template's source for marker texts, `src.find("...")`, in
# common_chat_templates_apply_jinja (two per request) and common_chat_try_specialized_template (the
# chain that picks a specialized handler: up to ~20 searches of the whole source per request, some
# 15% of a request on a long template that takes a late handler). What a search finds is the same
# for as long as the template lives: llamaprompt_source_find (src/cpp/shim_chat.cpp) keeps each
# position in the ChatTemplate's memo, keyed by the template and the literal, where `src` is that
# template's own source (checked at run time; anything else is searched as before). Each call
# `src.find("literal")` in those two functions is rewritten, when every copy of its text in the
# file is in them and a `tmpl` (the template) is declared there; other calls are left as they are.
SOURCE_FINDS = "the template source's marker searches: each position found once per template, not per request"
SOURCE_FIND_FUNCTIONS = (
    ("common_chat_try_specialized_template", HANDLER_CHOICE_DEF),
    ("common_chat_templates_apply_jinja",
     re.compile(r"common_chat_params\s+common_chat_templates_apply_jinja\s*\([^)]*\)\s*\{")),
)
SOURCE_FIND_CALL = re.compile(r'src\.find\(\s*("(?:[^"\\\n]|\\.)*")\s*\)')
SOURCE_FIND_TMPL = re.compile(r"\bcommon_chat_template\s*&\s*tmpl\b|\bauto\s*&\s*tmpl\s*=")


def source_find_edits(tree: Tree, notes: list[str]) -> list[Edit]:
    """The chat.cpp edits that keep the template source's marker searches (SOURCE_FINDS)."""
    rel = "common/chat.cpp"
    text = tree.read(rel)
    code = code_only(text)
    spans, missing = [], []
    for name, definition in SOURCE_FIND_FUNCTIONS:
        m = definition.search(code)
        close = _block_end(code, m.end() - 1) if m else -1
        if not m or not SOURCE_FIND_TMPL.search(code[m.start():close]):
            missing.append(name)
            continue
        spans.append((m.end(), close))
    # each call's text with the character before it (not part of a name: `default_template_src.find(`
    # is another string's search), which every copy of that text in the file must be a call in them
    calls: dict[str, list[bool]] = {}
    left = 0
    for m in re.finditer(r"(?<![\w.>:])src\.find\(", code):
        inside = any(start <= m.start() < end for start, end in spans)
        call = SOURCE_FIND_CALL.match(text, m.start())
        if call is None or m.start() == 0:
            left += inside
            continue
        calls.setdefault(text[m.start() - 1] + call.group(0), []).append(inside)
    edits = []
    for old, where in calls.items():
        if all(where) and text.count(old) == len(where):
            literal = SOURCE_FIND_CALL.match(old, 1).group(1)
            edits.append(Edit(old, f"{old[0]}llamaprompt_source_find(tmpl, src, {literal})", count=len(where),
                              speed=SOURCE_FINDS))
        else:
            left += sum(where)
    if missing or left or not edits:
        what = [f"{', '.join(missing)} not found with a `tmpl`"] if missing else []
        what += [f"{left} of its searches are not `src.find(\"literal\")` only in those functions"] if left else []
        notes.append(f"{rel}: engine rewrite not applied to every marker search of the template source "
                     f"({'; '.join(what) or 'none found'}): those search the source for each request "
                     f"(slower: {SOURCE_FINDS})")
    return edits


def _incomplete_groups(text: str, edits: list[Edit], engine_rewrites: bool) -> set[str]:
    """The groups of ``edits`` that cannot all apply to ``text``. Edits apply in order, each to
    the text the ones before it left (an edit may rewrite another's result), so this applies
    them as apply_rewrites will, leaving out each group found incomplete, until none is."""
    incomplete: set[str] = set()
    while True:
        current, found = text, set()
        for e in edits:
            if e.group in incomplete or (e.speed and not engine_rewrites):
                continue
            if current.count(e.old) == e.count:
                current = current.replace(e.old, e.new)
            elif e.group:
                found.add(e.group)
        if not found:
            return incomplete
        incomplete |= found


# the generated copy of a guarded file the tree does not have
EMPTY_COPY = "// llamaprompt: this file is not in this llama.cpp tree (third_party/adapt_tree.py)\n"


def apply_rewrites(tree: Tree, out_dir: Path, notes: list[str], engine_rewrites: bool = True,
                   handlers: list[Rewrite] | None = None,
                   probed_edits: dict[str, list[Edit]] | None = None) -> list[dict]:
    """Apply REWRITES and HEADER_REWRITES (with ``probed_edits``' edits added to their files'
    lists) and ``handlers``; write the copies and the header mirror; one record per edit."""
    applied = []
    headers: dict[str, str] = {}
    extra = probed_edits or {}
    fixed = [Rewrite(rw.rel, rw.out, rw.edits + extra.get(rw.rel, [])) for rw in REWRITES + HEADER_REWRITES]
    for rw in fixed + (handlers or []):
        if all(e.speed for e in rw.edits) and not tree.has(rw.rel):  # engine rewrites of a file it lacks
            notes.append(f"{rw.rel}: not in this tree; its rewrites are not applied")
            applied += [{"file": rw.rel, "pattern": e.old, "applied": False, "engine": e.speed,
                         "skipped": "the file is not in this tree"} for e in rw.edits]
            continue
        if not tree.has(rw.rel) and all(e.requires and e.requires[0] == rw.rel for e in rw.edits):
            # guards of a file the tree does not have (nothing to guard): an empty copy for its shim
            notes.append(f"{rw.rel}: not in this tree; its guards are not needed")
            applied += [{"file": rw.rel, "pattern": e.old, "applied": False, "skipped": "the file is not in this tree"}
                        for e in rw.edits]
            target = out_dir / "generated" / rw.out
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists() or target.read_text(encoding="utf-8") != EMPTY_COPY:
                target.write_text(EMPTY_COPY, encoding="utf-8")
            continue
        text = tree.read(rw.rel)
        incomplete = _incomplete_groups(text, rw.edits, engine_rewrites)
        for e in rw.edits:
            n = text.count(e.old) if e.group not in incomplete else -1
            record = {"file": rw.rel, "pattern": e.old, "applied": False}
            if e.speed:
                record["engine"] = e.speed
            if e.speed and not engine_rewrites:
                record["skipped"] = "off (LLAMAPROMPT_ENGINE_REWRITES=OFF)"
            elif e.speed and n != e.count:
                found = f"occurs {n} times, expected {e.count}" if n >= 0 else "another edit of its group is not found"
                notes.append(f"{rw.rel}: engine rewrite not applied ('{e.old.strip()}' {found}); "
                             f"the engine is upstream's there (slower: {e.speed})")
                record["skipped"] = found
            elif n == e.count:
                text = text.replace(e.old, e.new)
                record["applied"] = True
            elif n == 0 and e.requires and not tree.contains(*e.requires):
                notes.append(f"{rw.rel}: '{e.old}' is not in this tree, nor '{e.requires[1]}' that it guards; "
                             f"rewrite skipped (lost: {e.lost})")
                record["skipped"] = e.lost
            elif n == 0:
                guarded = f" (while '{e.requires[1]}', the code it guards, is there)" if e.requires else ""
                raise TreeError(f"{rw.rel}: '{e.old}' not found{guarded}: the call site has moved or changed, "
                                "and llamaprompt must be adapted to this tree")
            else:
                raise TreeError(f"{rw.rel}: '{e.old}' occurs {n} times, expected {e.count}: "
                                "llamaprompt must be adapted to this tree")
            applied.append(record)
        if not rw.out:  # a header: written by mirror_headers
            headers[rw.rel] = text
            continue
        if rw.rel.startswith(HANDLER_DIR + "/") or rw.rel == GENERATOR:  # the stop point's declaration
            text = '#include "lp_prompt_ready.h"  // llamaprompt: see adapt_tree.py handler_rewrites\n#line 1\n' + text
        (out_dir / "generated" / rw.out).parent.mkdir(parents=True, exist_ok=True)
        target = out_dir / "generated" / rw.out
        if not target.exists() or target.read_text(encoding="utf-8", errors="surrogateescape") != text:
            target.write_text(text, encoding="utf-8", errors="surrogateescape")
    mirror_headers(tree, out_dir, headers)
    return applied


# ---------------------------------------------------------------------------
# drift checks: upstream logic restated in llamaprompt's code
# ---------------------------------------------------------------------------

# src/cpp/shim_server.cpp make_server_chat_params mirrors server-context.cpp's load_model():
# each server_chat_params member and the expression it is filled from (allow_* are what a
# loaded vision+audio projector reports: the reference fixtures were made with one)
SERVER_CHAT_PARAMS = [
    ("use_jinja", "params_base.use_jinja"),
    ("prefill_assistant", "params_base.prefill_assistant"),
    ("reasoning_format", "params_base.reasoning_format"),
    ("chat_template_kwargs", "params_base.default_template_kwargs"),
    ("tmpls", "std::move(chat_templates)"),
    ("allow_image", "mctx ? mtmd_support_vision(mctx) : false"),
    ("allow_audio", "mctx ? mtmd_support_audio (mctx) : false"),
    ("allow_video", "mctx ? mtmd_helper_support_video(mctx) : false"),
    ("enable_thinking", "enable_thinking"),
    ("reasoning_budget", "params_base.sampling.reasoning_budget_tokens"),
    ("reasoning_budget_msg", "params_base.sampling.reasoning_budget_message"),
    ("media_path", "params_base.media_path"),
    ("force_pure_content", "params_base.force_pure_content_parser"),
]
SERVER_THINKING = [
    "const bool template_supports_thinking = params_base.use_jinja && "
    "common_chat_templates_support_enable_thinking(chat_templates.get());",
    "enable_thinking = params_base.enable_reasoning != 0 && template_supports_thinking;",
]

# src/cpp/shim_chat.cpp parser_inputs_key: autoparser::generation_params fields it covers, and
# those it leaves out on purpose
KEYED_FIELDS = {"tools", "tool_choice", "json_schema", "parallel_tool_calls", "reasoning_format", "stream",
                "grammar", "add_generation_prompt", "continue_final_message", "enable_thinking", "extra_context",
                "add_bos", "add_eos", "is_inference", "add_inference", "mark_input"}
UNKEYED_FIELDS = {
    "messages": "reach the parser only through the generation prompt, a literal prefix",
    "continue_msg": "read only before the prompt-only path ends (the prompt and the generation prompt: "
                    "generator_rewrite checks that no other autoparser code reads it)",
    "now": "the date: part of the analysis key (the day)",
}

# src/cpp/model.cpp check_vocab_metadata / check_tokenize: the llama-vocab.cpp code whose
# asserts they check first. (text, feature that must be present for the check to apply)
VOCAB_ASSERTS = [
    ('word = "[EMPTY_" + std::to_string(i) + "]";', None),
    ("GGML_ASSERT(id_to_token.size() == token_to_id.size());", None),
    ('GGML_ABORT("invalid token size: %zu exceeds int32_t limit", size);', None),
    ("output.push_back((llama_token)(hash % n_vocab));", "vocab_test_tokenizer"),
    ("case LLAMA_VOCAB_TYPE_WPM: { GGML_ABORT(\"fatal error\"); }", None),
    # the RWKV tokenizer's unescape (rwkv_token_bytes restates it), its trie and its loop that never
    # returns at a byte that begins a token but is none alone
    ("uint8_t value = (c >= 'a') ? (c - 'a' + 10) : (c - '0');", None),
    ("token_matcher.insert((const char *) text.data(), text.size(), id);", None),
    ("position = token_length;", None),
]


def server_main_check(tree: Tree) -> None:
    """src/cpp/parse.cpp resolves an automatic slot count as llama-server's main() does."""
    rel = "tools/server/server.cpp"
    text = norm(tree.read(rel))
    m = re.search(r"if \(params\.n_parallel < 0\) \{(.*?)\}", text)
    if not m or "params.n_parallel = 4;" not in m.group(1):
        raise TreeError(f"{rel}: 'if (params.n_parallel < 0) {{ ... params.n_parallel = 4; ... }}' not found "
                        "(src/cpp/parse.cpp restates it)")


def server_chat_params_check(tree: Tree) -> None:
    rel = "tools/server/server-context.cpp"
    text = tree.read(rel)
    m = re.search(r"chat_params\s*=\s*\{(.*?)\};", text, re.S)
    if not m:
        raise TreeError(f"{rel}: no 'chat_params = {{ ... }};' initializer (server_chat_params) found")
    got = re.findall(r"/\*\s*(\w+)\s*\*/\s*(.*?)\s*(?:,\s*(?=/\*)|$)", m.group(1).strip(), re.S)
    got = [(k, norm(v)) for k, v in got]
    want = [(k, norm(v)) for k, v in SERVER_CHAT_PARAMS]
    if got != want:
        raise TreeError(f"{rel}: llama-server fills server_chat_params differently from what "
                        "src/cpp/shim_server.cpp (make_server_chat_params) mirrors:\n  tree:  "
                        + "; ".join(f"{k}={v}" for k, v in got) + "\n  ours:  "
                        + "; ".join(f"{k}={v}" for k, v in want))
    for line in SERVER_THINKING:
        if not tree.contains(rel, line):
            raise TreeError(f"{rel}: '{line}' not found (make_server_chat_params restates it)")


def exiting_flags_check(tree: Tree) -> None:
    rel = "common/arg.cpp"
    text = tree.read(rel)
    ours = set(re.findall(r'"([^"]+)"', (SRC_CPP / "server_args_refused.inc").read_text()))
    missing = []
    for block in re.split(r"\n\s*add_opt\(", text)[1:]:
        head = re.match(r"\s*common_arg\(\s*\{([^}]*)\}", block)
        body = block.split("\n    add_opt(")[0]
        if head and re.search(r"\bexit\(", body):
            flags = re.findall(r'"([^"]+)"', head.group(1))
            if not any(flag in ours for flag in flags):
                missing.append("/".join(flags))
    if missing:
        raise TreeError(f"{rel}: the handlers of {', '.join(missing)} call exit(); they are not in "
                        "src/cpp/server_args_refused.inc, so a server_args list could end the Python process")


def parser_key_check(tree: Tree) -> None:
    rel = "common/chat-auto-parser.h"
    m = tree.search(rel, r"(?s)struct generation_params\s*\{(.*?)\n\};")
    if not m:
        raise TreeError(f"{rel}: 'struct generation_params {{ ... }};' not found")
    fields = set(re.findall(r"^\s*[\w:<>,\s]+?\s+(\w+)\s*(?:=[^;]*)?;", m.group(1), re.M))
    unknown = fields - KEYED_FIELDS - set(UNKEYED_FIELDS)
    gone = (KEYED_FIELDS | set(UNKEYED_FIELDS)) - fields
    if unknown or gone:
        raise TreeError(f"{rel}: autoparser::generation_params fields changed (new: {sorted(unknown)}, "
                        f"gone: {sorted(gone)}); src/cpp/shim_chat.cpp parser_inputs_key must cover them")
    rel = "common/chat-auto-parser-generator.cpp"
    first = "data.prompt = common_chat_template_direct_apply(tmpl, inputs);"
    body = tree.search(rel, r"(?s)common_chat_params peg_generator::generate_parser\([^)]*\)\s*\{(.{0,1500})")
    if not body or norm(first) not in norm(body.group(1)):
        raise TreeError(f"{rel}: generate_parser no longer starts with '{first}' "
                        "(the prompt-only path of src/cpp/shim_chat.cpp returns exactly that render)")


def vocab_check(tree: Tree, features: dict[str, dict]) -> None:
    rel = "src/llama-vocab.cpp"
    for text, needs in VOCAB_ASSERTS:
        if needs and not features[needs]["present"]:
            continue
        if not tree.contains(rel, text):
            raise TreeError(f"{rel}: '{text}' not found; src/cpp/model.cpp checks the condition it asserts "
                            "before loading a vocab and must be adapted")


# ---------------------------------------------------------------------------
# request fields whose handlers need a vocab
# ---------------------------------------------------------------------------

KEY_USE = re.compile(r'(?:data\.find|data\.at|data\.contains|json_value\(\s*data\s*,)\(?\s*"([a-z_]+)"')
VOCAB_USE = re.compile(r"\bctx\.vocab\b|common_tokenize\(\s*vocab\b|llama_vocab_\w+\(\s*vocab\b")


def _child_blocks(text: str, body_start: int) -> list[str]:
    """The `{ ... }` blocks nested directly in the function body that opens at body_start
    (string and character literals and comments skipped)."""
    blocks, depth, start, i = [], 1, None, body_start
    while i < len(text) and depth > 0:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
            continue
        if c == "{":
            depth += 1
            if depth == 2:
                start = i
        elif c == "}":
            if depth == 2 and start is not None:
                blocks.append(text[start : i + 1])
            depth -= 1
        i += 1
    return blocks


def vocab_fields(tree: Tree, features: dict[str, dict]) -> list[str]:
    """The request fields whose handlers in the tree's request schema (eval_llama_cmpl_schema,
    or server_task::params_from_json_cmpl) use the vocab -- they assert it (a crash without a
    model) and only set sampling parameters. src/cpp/parse.cpp drops them when there is no model.
    Read from the tree, not listed by hand: their names and number change between trees."""
    if not features["parse"]["present"]:
        return []
    names: set[str] = set()
    if features["server_schema"]["present"]:
        rel = "tools/server/server-schema.cpp"
        for block in re.split(r"\badd\(\s*\(\s*new\s+", tree.read(rel))[1:]:
            head = re.match(r"field_\w+\s*\(\s*\"([a-z_]+)\"", block)
            if head and VOCAB_USE.search(block):
                names.add(head.group(1))
                names.update(KEY_USE.findall(block))
    else:
        rel = "tools/server/server-task.cpp"
        text = tree.read(rel)
        m = re.search(r"task_params\s+server_task::params_from_json_cmpl\s*\([^)]*\)\s*\{", text)
        if not m:
            raise TreeError(f"{rel}: no definition of server_task::params_from_json_cmpl")
        # the function's top-level { ... } groups: each parses one set of related fields
        for block in _child_blocks(text, m.end()):
            if VOCAB_USE.search(block):
                names.update(KEY_USE.findall(block))
    parser_keys = names & {"chat_format", "chat_parser", "reasoning_format", "parse_tool_calls", "generation_prompt"}
    if parser_keys:
        raise TreeError(f"{rel}: the fields found to need a vocab include chat-parser inputs {sorted(parser_keys)}; "
                        "dropping them would change the parse (src/cpp/parse.cpp must be adapted)")
    for needed in ("preserved_tokens", "logit_bias"):
        if needed not in names:
            raise TreeError(f"{rel}: could not find the request fields whose handlers use the vocab "
                            f"(no '{needed}' among {sorted(names)}); src/cpp/parse.cpp needs that list")
    return sorted(names)


# ---------------------------------------------------------------------------
# llama-server's /tokenize and /detokenize handlers, compiled from the tree
# ---------------------------------------------------------------------------

SERVER_CONTEXT = "tools/server/server-context.cpp"
TOKENIZE_HANDLERS = ("post_tokenize", "post_detokenize")
# what src/cpp/server_tokenize.cpp gives a handler body in place of server_routes' lambda:
# each name, and the members of it the body may use
HANDLER_SCOPE = {"req": {"body"}, "ctx_server": {"vocab"}, "res": {"ok", "error"}}
# the vocab's calls a body may make; server_tokenize.cpp runs each through check_tokenize first
# (the conditions llama.cpp asserts: a GGUF without a tokenizer would abort the process)
VOCAB_CALLS = ("tokenize_mixed", "common_token_to_piece", "tokens_to_str")


def tokenize_handler_bodies(tree: Tree) -> dict[str, str] | None:
    """The bodies of server_routes' post_tokenize and post_detokenize lambdas
    (tools/server/server-context.cpp), each with its vocab calls renamed to the checked ones of
    src/cpp/server_tokenize.cpp (``lp_vocab::NAME``). None when the tree has neither handler in
    that form; a TreeError when a body uses what server_tokenize.cpp does not give it."""
    if not tree.has(SERVER_CONTEXT):
        return None
    text = tree.read(SERVER_CONTEXT)
    code = code_only(text)
    bodies: dict[str, str] = {}
    for name in TOKENIZE_HANDLERS:
        m = re.search(r"\bthis->" + name + r"\s*=\s*\[this\]\s*\(\s*const\s+server_http_req\s*&\s*req\s*\)\s*\{",
                      code)
        if m is None:
            continue
        end = _block_end(code, m.end() - 1)
        if end < 0:
            raise TreeError(f"{SERVER_CONTEXT}: the body of this->{name} has no end")
        body, body_code = text[m.end():end], code[m.end():end]
        where = f"{SERVER_CONTEXT}: this->{name}"
        problems = []
        for obj, members in HANDLER_SCOPE.items():
            for use in re.finditer(r"\b" + obj + r"\b(\s*(?:\.|->)\s*(\w+))?", body_code):
                if use.group(2) not in members and not re.match(
                        r"\s*=\s*create_response\(\)\s*;|\s*;", body_code[use.end():]):
                    problems.append(f"uses '{norm(body_code[use.start():use.end() + 12])}...'")
        for word in ("this", "params", "meta", "ctx_http", "queue_tasks", "queue_results"):
            if re.search(r"\b" + word + r"\b", body_code):
                problems.append(f"uses llama-server's state ('{word}')")
        calls = re.findall(r"\b(\w+)\s*\(\s*ctx_server\s*\.\s*vocab\b", body_code)
        if len(calls) != len(re.findall(r"\bctx_server\s*\.\s*vocab\b", body_code)) or set(calls) - set(VOCAB_CALLS):
            problems.append(f"hands the vocab to other than the first argument of {', '.join(VOCAB_CALLS)} "
                            f"(calls found: {', '.join(calls) or 'none'})")
        if not re.match(r"\s*auto\s+res\s*=\s*create_response\(\)\s*;", body_code) or not re.search(
                r"\breturn\s+res\s*;\s*$", body_code):
            problems.append("does not begin 'auto res = create_response();' and end 'return res;'")
        if problems:
            raise TreeError(f"{where}: the handler {'; '.join(problems)}; src/cpp/server_tokenize.cpp gives it only "
                            + ", ".join(f"{k}.{'/'.join(sorted(v))}" for k, v in HANDLER_SCOPE.items())
                            + " and create_response(), and must be adapted")
        line = text.count("\n", 0, m.end()) + 1  # compiler messages name the upstream file and line
        calls_at = r"\b(" + "|".join(VOCAB_CALLS) + r")(\s*\(\s*ctx_server\s*\.\s*vocab\b)"
        bodies[name] = f'#line {line} "{SERVER_CONTEXT}"\n' + re.sub(calls_at, r"lp_vocab::\1\2", body)
    if not bodies:
        return None
    if len(bodies) != len(TOKENIZE_HANDLERS):
        missing = [n for n in TOKENIZE_HANDLERS if n not in bodies]
        raise TreeError(f"{SERVER_CONTEXT}: 'this->{missing[0]} = [this](const server_http_req & req) {{' not found "
                        f"(the other handler, {next(iter(bodies))}, is there)")
    return bodies


# ---------------------------------------------------------------------------


def cmake_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def main(argv: list[str]) -> int:
    engine_rewrites = "--no-engine-rewrites" not in argv
    argv = [a for a in argv if a != "--no-engine-rewrites"]
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    tree = Tree(Path(argv[1]))
    out = Path(argv[2])
    (out / "generated").mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    try:
        features = probe_features(tree)
        handlers, verdicts = handler_rewrites(tree, notes)
        generator, generator_verdict = generator_rewrite(tree, notes)
        choice_problems = handler_choice_problems(tree)
        if choice_problems:
            notes.append("common/chat.cpp: the specialized-handler choice may depend on more than the template "
                         f"source ({'; '.join(choice_problems)}): it runs for every request")
        handlers += generator
        probed: dict[str, list[Edit]] = {}
        if tree.has("common/jinja/value.h"):
            probed["common/jinja/value.h"] = leaf_type_test_edits(tree, notes) + bool_int_edits(tree, notes)
            if tree.has("common/jinja/runtime.cpp"):
                probed["common/jinja/runtime.cpp"] = member_text_edits(tree, notes)
            if tree.has("common/jinja/value.cpp"):
                probed["common/jinja/value.cpp"] = tojson_edits(tree, notes)
            if tree.has("common/jinja/runtime.h"):
                probed["common/jinja/runtime.h"] = leaf_stmt_test_edits(tree, notes)
        for rel, edits in caps_lookup_edits(tree, notes).items():
            probed[rel] = probed.get(rel, []) + edits
        probed["common/chat.cpp"] = probed.get("common/chat.cpp", []) + normalize_move_edits(tree, notes)
        probed["common/chat.cpp"] += shared_analysis_edits(tree, notes)
        probed["common/chat.cpp"] += source_find_edits(tree, notes)
        schema_rel = "common/json-schema-to-grammar.cpp"
        probed[schema_rel] = probed.get(schema_rel, []) + trie_guard_edits(tree, notes)
        handlers = no_gen_reuse_rewrites(tree, notes, handlers, probed)
        rewrites = apply_rewrites(tree, out, notes, engine_rewrites, handlers, probed)
        server_chat_params_check(tree)
        server_main_check(tree)
        exiting_flags_check(tree)
        parser_key_check(tree)
        vocab_check(tree, features)
        fields = vocab_fields(tree, features)
        handler_bodies = tokenize_handler_bodies(tree)
        features["serve_tokenize"] = {
            "present": handler_bodies is not None,
            "what": f"{SERVER_CONTEXT}: llama-server's POST /tokenize and /detokenize handlers (server_routes' "
                    "post_tokenize and post_detokenize), which `llamaprompt serve` runs"}
    except TreeError as e:
        print(f"llamaprompt: cannot build against the llama.cpp tree at {tree.root}:\n{e}", file=sys.stderr)
        return 1

    sources = []
    if features["server_schema"]["present"]:
        sources.append("tools/server/server-schema.cpp")
    if features["parse"]["present"]:
        sources += ["tools/server/server-task.cpp", "tools/server/server-chat.cpp"]
    for name in LOSSES:
        if not features[name]["present"]:
            notes.append(f"not in this tree: {features[name]['what']}")

    info = {"features": {k: v["present"] for k, v in features.items()},
            "feature_docs": {k: v["what"] for k, v in features.items()},
            "losses": [name for name in LOSSES if name in features],
            "rewrites": rewrites, "notes": notes, "vocab_fields": fields, "prompt_only_handlers": verdicts,
            "prompt_only_generator": generator_verdict,
            "handler_choice_by_source": "; ".join(choice_problems) or True}
    header = ["// generated by third_party/adapt_tree.py from the llama.cpp tree's contents", "#pragma once"]
    for name, f in features.items():
        header.append(f"#define LP_HAS_{name.upper()} {int(f['present'])}")
    header.append("// the specialized-handler choice reads only the template source (handler_choice_problems())")
    header.append(f"#define LP_HANDLER_CHOICE_BY_SOURCE {int(not choice_problems)}")
    header.append("// request fields whose schema handlers need a vocab (vocab_fields())")
    header.append("#define LP_VOCAB_FIELDS " + ", ".join(json.dumps(n) for n in fields))
    header.append("#define LP_TREE_INFO_JSON " + json.dumps(json.dumps(info, sort_keys=True)))
    text = "\n".join(header) + "\n"
    for name in TOKENIZE_HANDLERS:
        inc = out / "generated" / f"lp_{name}.inc"
        inc_text = (f"// generated by third_party/adapt_tree.py: the body of this->{name} in {SERVER_CONTEXT}\n"
                    + (handler_bodies[name] if handler_bodies else "") + "\n")
        if not inc.exists() or inc.read_text() != inc_text:
            inc.write_text(inc_text)
    target = out / "generated" / "lp_tree.h"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    cmake = [f"set(LP_TREE_SOURCES {' '.join(sources)})"]
    # the upstream files whose build-tree copies src/cpp/shim_*.cpp compile into _core (every
    # definition of each is in its copy): CMakeLists.txt does not compile them again in llama-common
    cmake.append(f"set(LP_COPIED_SOURCES {' '.join(rw.rel for rw in REWRITES + handlers)})")
    # the handler files with a prompt-only stop point or the render reuse: _core compiles their copies
    cmake.append(f"set(LP_HANDLER_COPIES {' '.join(rw.out for rw in handlers)})")
    # src/cpp/lp_common_log.h force-included (common's LOG_* lines to Python's logging) or not
    cmake.append(f"set(LP_COMMON_LOG_ROUTED {'ON' if features['common_log']['present'] else 'OFF'})")
    cmake += [f"message(STATUS {cmake_str('llamaprompt: ' + n)})" for n in notes]
    (out / "lp_tree.cmake").write_text("\n".join(cmake) + "\n")
    (out / "generated" / "lp_tree_inputs.txt").write_text("".join(f"{rel}\n" for rel in sorted(tree.inputs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
