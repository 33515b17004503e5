#!/usr/bin/env bash
# The decode benchmark's own environment (benchmarks/decode.py, benchmarks/serve_llm.py): packcache with its hf extra, plus
# llama-cpp-python built from its PyPI sdist (no prebuilt wheel: llama.cpp compiled for this CPU,
# GGML_NATIVE) and the llama.cpp tree that sdist vendors, whose convert_hf_to_gguf.py makes the GGUF
# files from the same checkpoint. 7-10 minutes on 2 cores here (the issue guessed 15-25), so never in CI; idempotent.
# Usage: bash benchmarks/setup_decode.sh            (environment in .bench/decode, or $PACKCACHE_DECODE_ENV)
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${PACKCACHE_DECODE_ENV:-.bench/decode}
LLAMA_CPP_PYTHON=0.3.36
PYTHON=${PYTHON:-python3}
mkdir -p "$ENV"
if [ ! -x "$ENV/venv/bin/python" ]; then
    "$PYTHON" -m venv "$ENV/venv"
fi
py="$ENV/venv/bin/python"
stamp="$ENV/venv/.installed-$LLAMA_CPP_PYTHON"
# benchmarks/serve_llm.py: packcache's serve extra, and the peers as servers: llama-cpp-python's server extra
# (its requirements, pinned at what ran here) and transformers serve's (openai, accelerate; protobuf, without which
# transformers cannot read the checkpoint's sentencepiece tokenizer.model). Their own stamp: an environment whose
# llama.cpp is built already gets them without a rebuild.
SERVE_PEERS="fastapi==0.165.0 uvicorn==0.55.0 sse-starlette==3.7.1 starlette-context==0.3.6 pydantic-settings==2.16.3
openai==3.57.0 accelerate==1.16.0 protobuf==7.36.2"
serve_stamp="$ENV/venv/.installed-serve-peers"
if [ "$(cat "$serve_stamp" 2>/dev/null)" != "$SERVE_PEERS" ]; then
    # shellcheck disable=SC2086  # one word per requirement
    "$py" -m pip install --quiet -c <(echo torch==2.13.0) -e '.[hf,serve]' sentencepiece==0.2.3 $SERVE_PEERS
    echo "$SERVE_PEERS" >"$serve_stamp"
fi
# AMX off unless asked for: llama.cpp's AMX kernels crash when built by GCC (ggml_tile_config_init keeps the tile
# config on the stack and GCC 12 drops its stores, so ldtilecfg faults: llama.cpp issue #20824, PR #26954).
# PACKCACHE_DECODE_AMX=on keeps them (a compiler known to be safe, or a llama.cpp with that fix).
AMX=${PACKCACHE_DECODE_AMX:-off}
case "$AMX" in
    on) ARCH_FLAGS="" ;;
    off) ARCH_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" ;;
    *) echo "PACKCACHE_DECODE_AMX must be on or off, not $AMX" >&2; exit 2 ;;
esac
build="llama-cpp-python $LLAMA_CPP_PYTHON GGML_NATIVE=ON amx=$AMX"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$(cat "$stamp")" = "$build" ]; then
    echo "$ENV ready ($build)"
else
"$py" -m pip install --quiet --upgrade pip
# torch==2.13.0 is the CPU build on local disk; the constraint keeps every other resolution on it.
"$py" -m pip install --quiet -c <(echo torch==2.13.0) -e '.[hf,serve]' sentencepiece==0.2.3
if [ ! -d "$ENV/src/llama_cpp_python-$LLAMA_CPP_PYTHON" ]; then
    "$py" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$ENV/sdist"
    mkdir -p "$ENV/src"
    tar -xzf "$ENV/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$ENV/src"
fi
# Built for this CPU (GGML_NATIVE: -march=native, so AVX2, AVX512 where present; explicit -mno-* flags win over
# -march in either order). A rebuild (other flags) replaces the installed copy: pip would keep the same version.
rm -f "$stamp"
"$py" -m pip uninstall --quiet --yes llama_cpp_python 2>/dev/null || true
CFLAGS="$ARCH_FLAGS" CXXFLAGS="$ARCH_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \
    "$py" -m pip install --verbose --no-cache-dir -c <(echo torch==2.13.0) "$ENV/src/llama_cpp_python-$LLAMA_CPP_PYTHON" \
    >"$ENV/build.log" 2>&1 || { tail -40 "$ENV/build.log"; exit 1; }
echo "$build" >"$stamp"
echo "$ENV ready ($build; build log: $ENV/build.log)"
fi

# llama.cpp's own server (benchmarks/serve_llm.py's llama-server systems: continuous batching over -np slots),
# built from the same vendored tree with the same flags, into $ENV/llama-server/bin. Its own stamp.
tree="$ENV/src/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
server_stamp="$ENV/llama-server/.built"
server_build="llama-server from llama-cpp-python $LLAMA_CPP_PYTHON's llama.cpp GGML_NATIVE=ON amx=$AMX"
if [ -x "$ENV/llama-server/bin/llama-server" ] && [ "$(cat "$server_stamp" 2>/dev/null)" = "$server_build" ]; then
    echo "llama-server ready ($server_build)"; exit 0
fi
rm -rf "$ENV/llama-server"
{
    # the build tree is $ENV/llama-server: llama.cpp puts its programs in the tree's bin/
    CFLAGS="$ARCH_FLAGS" CXXFLAGS="$ARCH_FLAGS" cmake -S "$tree" -B "$ENV/llama-server" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build "$ENV/llama-server" --target llama-server -j "$(nproc)"
} >"$ENV/build-llama-server.log" 2>&1 || { tail -40 "$ENV/build-llama-server.log"; exit 1; }
echo "$server_build" >"$server_stamp"
echo "llama-server ready: $ENV/llama-server/bin/llama-server ($server_build; build log: $ENV/build-llama-server.log)"
