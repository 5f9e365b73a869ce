#!/usr/bin/env bash
# Build llama-server (and only what it links) from a llama.cpp tree, for the live-server
# peer of `llamaprompt bench --llama-server` and tests/server_differential.py.
#
#   benchmarks/build_llama_server.sh [TREE] [BUILD_DIR]
#
# TREE: a llama.cpp source tree (default: the one the installed llamaprompt was built from,
# llamaprompt.tree_info()["tree_dir"]); BUILD_DIR default: ~/.cache/llamaprompt/llama-server/<commit>
# (for a TREE given here: tree-<hash of its path>).
# No web UI, no HTTPS, CPU only; ccache when it is installed. Prints the binary's path.
# ~17 min on 2 cores with nothing cached; a rebuild from ccache takes about a minute.
set -euo pipefail
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; -*) usage >&2; exit 2 ;; esac
if [ $# -ge 1 ] && [ -z "$1" ]; then
    echo "build_llama_server: the tree argument is empty (omit it for the installed llamaprompt's tree)" >&2
    exit 2
fi
PY=${PYTHON:-python3}
if [ $# -ge 1 ]; then
    TREE=$1
elif ! TREE=$("$PY" -c 'import llamaprompt; print(llamaprompt.tree_info()["tree_dir"])' 2>/dev/null); then
    echo "build_llama_server: $PY cannot import llamaprompt: pass the llama.cpp tree (or set PYTHON)" >&2
    exit 2
fi
if [ ! -f "$TREE/tools/server/CMakeLists.txt" ]; then
    echo "build_llama_server: $TREE is not a llama.cpp tree with tools/server" >&2
    exit 2
fi
if [ $# -ge 1 ]; then  # a tree of its own: a build folder named by the tree's path
    KEY=tree-$(printf '%s' "$(cd "$TREE" && pwd)" | sha1sum | cut -c1-12)
else
    KEY=$("$PY" -c 'import llamaprompt; print(llamaprompt.tree_info()["commit"] or "tree")')
fi
BUILD=${2:-${LLAMAPROMPT_CACHE_DIR:-$HOME/.cache/llamaprompt}/llama-server/$KEY}
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
