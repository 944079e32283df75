"""The public API: the names at the package top (pinned), their docstrings, the embedding
example of docs/api.md (run as written), and the integrations using the public names."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import kvplug

ROOT = Path(__file__).resolve().parent.parent
API_DOC = ROOT / "docs" / "api.md"

PUBLIC = [
    "AllCleared",
    "AllWorkersOverloaded",
    "AttributeThreshold",
    "BlockMoved",
    "BlockRemoved",
    "BlockStored",
    "CandidateTrace",
    "ConfigError",
    "Decision",
    "Exclusion",
    "InvalidArgument",
    "InvalidEvent",
    "InvalidRequest",
    "InvalidTokens",
    "KvEvent",
    "KvIndex",
    "KvplugError",
    "NoCompatibleWorker",
    "Overlaps",
    "PinnedWorkerOverloaded",
    "Role",
    "RouteContext",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RoutingError",
    "RoutingHints",
    "RoutingPolicy",
    "Stage",
    "Tier",
    "UnknownWorker",
    "Worker",
    "__version__",
    "add_router_arguments",
    "backend",
    "register_policy",
]


def test_the_public_surface_is_pinned():
    # adding or removing a public name is a decision: change this list and docs/api.md
    assert sorted(kvplug.__all__) == sorted(PUBLIC)
    for name in kvplug.__all__:
        assert getattr(kvplug, name) is not None
    documented = set(re.findall(r"`(\w+)", API_DOC.read_text()))
    missing = [n for n in PUBLIC if n.strip("_") not in documented and n not in documented]
    assert not missing, f"public names not in docs/api.md: {missing}"


def test_every_public_class_and_function_says_what_it_is():
    for name in kvplug.__all__:
        obj = getattr(kvplug, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj) or ""
        # a dataclass without a docstring gets its signature as one
        assert doc and not doc.startswith(f"{obj.__name__}("), f"{name} has no docstring"


def test_importing_kvplug_stays_light():
    heavy = "('aiohttp', 'zmq', 'matplotlib')"
    code = f"import sys, kvplug; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _python_blocks(section: str) -> list[str]:
    text = API_DOC.read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


async def test_the_embedding_example_runs_as_documented():
    from aiohttp.test_utils import TestClient, TestServer

    (code,) = _python_blocks("Embedding the router in another server")
    ns: dict = {}
    exec(compile(code, str(API_DOC), "exec"), ns)
    async with TestClient(TestServer(ns["app"])) as client:
        await _exercise(client, ns)


async def _exercise(client, ns: dict) -> None:
    prompt = ns["SYSTEM_PROMPT"] + list(range(16))
    resp = await client.post("/v1/completions", json={"id": "r1", "prompt_token_ids": prompt})
    assert resp.status == 200
    answer = await resp.json()
    assert answer["worker"] == "gpu-1" and answer["url"] == "http://10.0.0.2:8000"
    # the explanation quoted in the doc is the real one
    assert f"`{answer['why']}`" in API_DOC.read_text()
    router = ns["router"]
    assert router.stats()["active_requests"] == 0  # the load was released
    bad = await client.post("/v1/completions", json={"id": "r2", "prompt_token_ids": [-1]})
    assert bad.status == 400 and "token" in (await bad.json())["error"]


def test_the_policy_example_registers_a_mode():
    (code,) = _python_blocks("Adding a routing mode")
    code = code.replace('"longest-prefix"', '"doc-longest-prefix"')  # one registration per name
    ns: dict = {}
    exec(compile(code, str(API_DOC), "exec"), ns)
    import random

    r = kvplug.Router(kvplug.RouterConfig(router_mode="doc-longest-prefix"), rng=random.Random(0))
    for w in ("a", "b"):
        r.add_worker(kvplug.Worker(w))
    p = list(range(64))
    r.apply_event(
        kvplug.BlockStored(
            worker_id="b", engine_hashes=[1, 2], block_hashes=r.index.request_hashes(p)[:2]
        )
    )
    d = r.route(kvplug.RouteRequest("x", p))
    assert (d.worker_id, d.mode) == ("b", "doc-longest-prefix")


def test_the_integrations_import_public_names_from_the_top():
    # what kvplug exports is imported from kvplug, not from the module that defines it
    offenders = []
    for path in (ROOT / "integrations").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("kvplug.")
                and not (node.module or "").startswith("kvplug.integrations")
            ):
                public = [a.name for a in node.names if a.name in kvplug.__all__]
                if public:
                    offenders.append(f"{path.relative_to(ROOT)}: {node.module} {public}")
    assert not offenders, offenders
