// llamaprompt._core: llama.cpp's chat-template code, compiled from the tree the build was given.
// Each topic registers itself from its own file; this file only wires them up.
#include "errors.h"
#include "gil.h"
#include "logging.h"
#include "jinja_guard.h"
#include "memory.h"
#include "shim.h"
#include "tree.h"
#include "lp_build.h"

#include "llama.h"

#include "log.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <memory>

namespace py = pybind11;

namespace llamaprompt {
void register_template(py::module_ & m);
void register_model(py::module_ & m);
void register_builtin(py::module_ & m);
void register_parse(py::module_ & m);
void register_server_tokenize(py::module_ & m);
}

PYBIND11_MODULE(_core, m) {
    m.doc() = "llamaprompt's private extension: llama.cpp's chat code (do not import directly)";
    m.attr("LLAMA_CPP_COMMIT") = LLAMAPROMPT_LLAMA_CPP_COMMIT;
    m.attr("LLAMA_CPP_SOURCE") = LLAMAPROMPT_LLAMA_CPP_SOURCE;
    m.attr("LLAMA_CPP_DIR") = LLAMAPROMPT_LLAMA_CPP_DIR;  // the tree's folder at build time
    m.attr("SOURCE_HASH") = LLAMAPROMPT_SOURCE_HASH;     // llamaprompt's build inputs (cores.source_hash)
    m.attr("SOURCE_DIR") = LLAMAPROMPT_SOURCE_DIR;       // where they were at build time
    // what third_party/adapt_tree.py found in the tree (features, rewrites applied or skipped)
    m.attr("TREE_INFO_JSON") = LP_TREE_INFO_JSON;
    // whether the module's operator new keeps freed blocks per thread (src/cpp/memory.cpp): built
    // with it, and the process's operator new is libstdc++'s
    m.attr("BLOCK_CACHE") = llamaprompt::block_cache_active();
    // how: "sized", "usable" (the cache), "forward" (the process's operator new), "off" (not built)
    m.attr("BLOCK_CACHE_MODE") = llamaprompt::block_cache_mode();
    // whether the files a request runs were compiled and linked together (CMakeLists.txt LLAMAPROMPT_LTO)
    m.attr("LTO") = bool(LLAMAPROMPT_LTO_BUILD);
    // whether they were then compiled again with the counts of a training run (LLAMAPROMPT_PGO)
    m.attr("PGO") = bool(LLAMAPROMPT_PGO_BUILD);
    // tests: the check that chooses "sized", on usable sizes given per request size 0, 1, 2, ...
    m.def("block_sizes_fit", &llamaprompt::block_sizes_fit, py::arg("usable"));
    // tests: whether the calling thread finds its lists of the cache through its thread pointer
    m.def("block_cache_slot_found", &llamaprompt::block_cache_slot_found);
    // bytes of the calling thread's stack left (a huge number when unknown): Python code that
    // decodes deep JSON itself (CPython's json recurses on the C stack) asks it first
    m.def("stack_left", []() { return llamaprompt::stack_left(); });
    m.attr("CAPS_KEYS") = llamaprompt::caps_keys();
    // a flag that stops the template executions of the threads it is given to once set
    // (template.map_on_threads: its threads' renders in progress when the caller is interrupted)
    struct stop_flag {
        std::shared_ptr<std::atomic<bool>> flag = std::make_shared<std::atomic<bool>>(false);
    };
    py::class_<stop_flag>(m, "StopFlag")
        .def(py::init<>())
        .def("set", [](stop_flag & s) { s.flag->store(true); })
        .def("is_set", [](const stop_flag & s) { return s.flag->load(); });
    // the calling thread's executions stop once `flag` is set ("... stopped: <why>"); None: no flag
    m.def(
        "stop_renders_on_this_thread",
        [](const stop_flag * flag) {
            llamaprompt::jinja_cancel_thread(flag ? flag->flag : nullptr, "the caller was interrupted");
        },
        py::arg("flag").none(true));

    // llama.cpp's common log itself (its worker thread, stdout / stderr) stays silent: its LOG_*
    // lines reach Python's logging through the captures instead (lp_common_log.h), where the tree
    // allows it (llamaprompt.features["common_log"])
    common_log_set_verbosity_thold(-1);
    // llama.cpp / ggml logs go to Python's logging ("llamaprompt.llama_cpp"), never stderr
    llamaprompt::install_log_callback();
    llama_backend_init();
    llamaprompt::hold_renders_at_exit();
    llamaprompt::init_sigint_watch();

    llamaprompt::register_errors(m);
    llamaprompt::register_template(m);
    llamaprompt::register_model(m);
    llamaprompt::register_builtin(m);
    llamaprompt::register_parse(m);
    llamaprompt::register_server_tokenize(m);
}
