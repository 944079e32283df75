"""Build kvplug._core (csrc/*.c + kvplug/_core.pyx). Flags from the environment:

KVPLUG_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer build (-O1, frame pointers)
KVPLUG_DEBUG=1     -O0 -g, no NDEBUG
KVPLUG_NATIVE=1    add -march=native (not for wheels or CI: the binary would not be portable)
"""

import hashlib
import json
import os
import sys
from glob import glob

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# one line run at interpreter start: installs kvplug's TRT-LLM router hook only where
# KVPLUG_TRTLLM_HOOK is set (integrations/trtllm/hook.py); the only file outside kvplug/
HOOK_PTH = "kvplug_trtllm.pth"


class BuildPyWithHook(build_py):
    """build_py that also puts ``kvplug_trtllm.pth`` at the wheel's root (site-packages)."""

    def run(self):
        super().run()
        if os.path.exists(HOOK_PTH):
            self.copy_file(HOOK_PTH, os.path.join(self.build_lib, HOOK_PTH))

    def get_outputs(self, include_bytecode=True):
        extra = [os.path.join(self.build_lib, HOOK_PTH)] if os.path.exists(HOOK_PTH) else []
        return super().get_outputs(include_bytecode) + extra

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if os.path.exists(HOOK_PTH):
            mapping[os.path.join(self.build_lib, HOOK_PTH)] = HOOK_PTH
        return mapping


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false", "no")


sanitize = _flag("KVPLUG_SANITIZE")
debug = _flag("KVPLUG_DEBUG")

compile_args = ["-std=c11", "-ffp-contract=off", "-fno-strict-aliasing"]
link_args = []
if sys.platform == "win32":  # pragma: no cover - not a target, keep setup importable
    compile_args = []
elif sanitize:
    san = [
        "-fsanitize=address,undefined",
        "-fno-omit-frame-pointer",
        "-fno-sanitize-recover=undefined",
    ]
    compile_args += ["-O1", "-g"] + san
    link_args += san
elif debug:
    compile_args += ["-O0", "-g"]
else:
    compile_args += ["-O3"]
    if _flag("KVPLUG_NATIVE"):
        compile_args += ["-march=native"]

LANE_C = "lane.c"  # kvplug._lane's, not the core's

core = Extension(
    "kvplug._core",
    sources=["kvplug/_core.pyx", *sorted(c for c in glob("csrc/*.c") if not c.endswith(LANE_C))],
    include_dirs=["csrc", np.get_include()],
    depends=sorted(glob("csrc/*.h")),
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

# kvplug serve: token-id prompts read from the request's JSON bytes into u32 (no Python ints)
token_json = Extension(
    "kvplug._token_json",
    sources=["kvplug/_token_json.pyx"],
    include_dirs=[np.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

# vLLM integration (issue 4): one-pass msgpack decoder for KV-event batches (optional at run
# time: kvplug.integrations.vllm.wire falls back to msgspec without it)
vllm_fastwire = (
    Extension(  # only built where the source exists (the sanitizer test copies csrc only)
        "kvplug.integrations.vllm._fastwire",
        sources=["integrations/vllm/_fastwire.pyx"],
        include_dirs=[np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
)

# kvplug serve --data-path native: the compiled HTTP data path (Linux: epoll, timerfd)
lane = Extension(
    "kvplug._lane",
    sources=["kvplug/_lane.pyx", "csrc/lane.c"],
    include_dirs=["csrc"],
    depends=["csrc/lane.h"],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

# Python modules on the routing path compiled as they are (Cython: the same semantics and
# floats, ~40 % less interpreter time; arguments annotated `float` become C doubles, the same
# IEEE arithmetic with -ffp-contract=off); the .py stays the source and the fallback. Each
# one's SHA-256 is recorded so a stale build is caught (tests/test_affinity.py).
# These are the default routing's own: compiled too, the router's kv path (router, pipeline,
# decision, index, kv_cost) ran 4-6 % slower, CPython 3.11's specialised attribute loads
# beating Cython's generic ones there (benchmarks/results/ab_route_cost_compiled_*.json)
COMPILED_PY = [
    m
    for m in (
        "kvplug/affinity.py",  # the affinity decision
        "kvplug/prefill_fit.py",  # the prefill model fitted to first tokens
        "kvplug/load.py",  # in-flight load, read by every prediction
        "kvplug/policies/affinity.py",  # the policy's pick and first-token hooks
    )
    if os.path.exists(m)
]
if COMPILED_PY:
    with open("kvplug/_compiled_sources.json", "w") as out:
        json.dump({m: hashlib.sha256(open(m, "rb").read()).hexdigest() for m in COMPILED_PY}, out)
compiled_py = [
    Extension(
        m[:-3].replace("/", "."),
        sources=[m],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    for m in COMPILED_PY
]

setup(
    cmdclass={"build_py": BuildPyWithHook},
    ext_modules=cythonize(
        [core, token_json, *compiled_py]
        + ([lane] if sys.platform.startswith("linux") else [])
        + ([vllm_fastwire] if os.path.exists("integrations/vllm/_fastwire.pyx") else []),
        compiler_directives={"language_level": "3"},
        force=sanitize or debug,
    ),
)
