#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the sources vendored in the llama-cpp-python sdist, for the benchmark's
# `llama-server` peer (specdecode/bench/peers.py). CPU only, tuned for this machine (GGML_NATIVE), no network
# features. About 5 minutes on 2 cores. The binary goes to the user cache, where the peer looks for it.
#
#   bash benchmarks/build_llama_server.sh [VERSION]      (default 0.3.36)
set -euo pipefail
version="${1:-0.3.36}"
dest="${SPECDECODE_CACHE:-$HOME/.cache/specdecode}/llama-server"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" -q
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
cmake --build "$work/build" --target llama-server -j "$(nproc)"
mkdir -p "$dest/bin"
cp "$work/build/bin/llama-server" "$dest/bin/llama-server"
echo "llama-server $version: $dest/bin/llama-server"
