#!/usr/bin/env bash
# Build llama-server (and only what it links) from a llama.cpp tree, for the live-server
# peer of `llamaprompt bench --llama-server` and tests/server_differential.py.
#
#   benchmarks/build_llama_server.sh [TREE] [BUILD_DIR]
#
# TREE: a llama.cpp source tree (default: the one the installed llamaprompt was built from,
# llamaprompt.tree_info()["tree_dir"]); BUILD_DIR default: ~/.cache/llamaprompt/llama-server/<commit>.
# No web UI, no HTTPS, CPU only; ccache when it is installed. Prints the binary's path.
# ~17 min on 2 cores with nothing cached; a rebuild from ccache takes about a minute.
set -euo pipefail
PY=${PYTHON:-python3}
TREE=${1:-$("$PY" -c 'import llamaprompt; print(llamaprompt.tree_info()["tree_dir"])')}
if [ ! -f "$TREE/tools/server/CMakeLists.txt" ]; then
    echo "build_llama_server: $TREE is not a llama.cpp tree with tools/server" >&2
    exit 2
fi
COMMIT=$("$PY" -c 'import llamaprompt; print(llamaprompt.tree_info()["commit"] or "tree")' 2>/dev/null || echo tree)
BUILD=${2:-${LLAMAPROMPT_CACHE_DIR:-$HOME/.cache/llamaprompt}/llama-server/$COMMIT}
LAUNCHER=()
if command -v ccache >/dev/null 2>&1; then
    LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
cmake -S "$TREE" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release "${LAUNCHER[@]}" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >&2
cmake --build "$BUILD" --target llama-server -j "$(nproc 2>/dev/null || echo 2)" >&2
echo "$BUILD/bin/llama-server"
