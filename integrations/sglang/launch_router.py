"""Drop-in for ``python -m sglang_router.launch_router``: the same flags, kvplug underneath.

    python -m kvplug.integrations.sglang.launch_router --host 127.0.0.1 --port 30000 \\
        --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 --kv-block-size 16

    python -m kvplug.integrations.sglang.launch_router --pd-disaggregation \\
        --prefill http://10.0.0.1:30000 8998 --prefill http://10.0.0.2:30000 none \\
        --decode http://10.0.0.3:30000 --decode http://10.0.0.4:30000 --port 30000

Accepted ``sglang-router`` flags and what kvplug does with them:

* ``--host``, ``--port``, ``--worker-urls``: the OpenAI API address and the (aggregated)
  SGLang workers;
* ``--pd-disaggregation``, ``--prefill URL [BOOTSTRAP_PORT|none]``, ``--decode URL``: prefill
  and decode workers; the bootstrap port (default 8998) becomes the prefill worker's
  ``bootstrap_port`` option; ``--dp-aware`` sends ``routed_dp_rank`` on both hops;
* ``--policy`` / ``--prefill-policy`` / ``--decode-policy``: ``cache_aware`` (the default)
  becomes kvplug's event-driven ``kv`` mode; ``random``, ``round_robin`` and
  ``power_of_two`` map to kvplug's modes of the same meaning; others fall back to ``kv``.
  kvplug routes both PD stages with one mode, so a differing prefill/decode policy is noted;
* ``--cache-threshold``, ``--balance-abs-threshold``, ``--balance-rel-threshold``,
  ``--eviction-interval-secs``, ``--max-tree-size``: accepted and unused (they tune
  sglang-router's approximate character tree; kvplug reads the engines' real KV events);
* ``--prometheus-host`` / ``--prometheus-port``: accepted; kvplug serves ``/metrics`` on the
  API port;
* ``--api-key``: **refused** — kvplug's frontend has no client authentication, and silently
  serving without it would be worse than stopping.

Every other argument (after the known ones) goes to ``kvplug serve`` unchanged, e.g.
``--kv-block-size 16 --tokenizer /models/qwen``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import yaml

from kvplug import ConfigError

POLICY_MODES = {
    "cache_aware": "kv",
    "random": "random",
    "round_robin": "round-robin",
    "power_of_two": "power-of-two",
}
DEFAULT_BOOTSTRAP_PORT = 8998
UNUSED_TUNING = (
    "cache_threshold",
    "balance_abs_threshold",
    "balance_rel_threshold",
    "eviction_interval_secs",
    "max_tree_size",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvplug.integrations.sglang.launch_router",
        description="sglang-router compatible launcher for kvplug serve (see the module doc); "
        "unknown arguments are passed to kvplug serve",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--worker-urls", nargs="*", default=[], metavar="URL")
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--prefill-policy", default=None)
    p.add_argument("--decode-policy", default=None)
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument(
        "--prefill", action="append", nargs="+", default=[], metavar="URL [BOOTSTRAP_PORT|none]"
    )
    p.add_argument("--decode", action="append", nargs=1, default=[], metavar="URL")
    p.add_argument("--dp-aware", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--prometheus-host", default=None)
    p.add_argument("--prometheus-port", type=int, default=None)
    for name in UNUSED_TUNING:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None)
    return p


def _prefill_entry(values: list[str], dp_aware: bool) -> dict[str, Any]:
    if not 1 <= len(values) <= 2:
        raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {values}")
    url = values[0]
    port: int | None = DEFAULT_BOOTSTRAP_PORT
    if len(values) == 2:
        if values[1].lower() == "none":
            port = None
        else:
            try:
                port = int(values[1])
            except ValueError:
                raise ConfigError(
                    f"--prefill {url}: bootstrap port {values[1]!r} is not an integer or 'none'"
                ) from None
    options: dict[str, Any] = {"bootstrap_port": port}
    if dp_aware:
        options["dp_aware"] = True
    return {"url": url, "engine": "sglang", "role": "prefill", "options": options}


def translate(argv: list[str]) -> tuple[list[str], dict[str, Any], list[str]]:
    """(``kvplug serve`` argv without the worker file, the worker file content, notes)."""
    args, rest = build_parser().parse_known_args(argv)
    notes: list[str] = []
    if args.api_key:
        raise ConfigError(
            "--api-key is not supported by kvplug serve (no client "
            "authentication); put an authenticating proxy in front instead"
        )
    workers: list[dict[str, Any]] = []
    if args.pd_disaggregation:
        if not args.prefill or not args.decode:
            raise ConfigError("--pd-disaggregation needs at least one --prefill and one --decode")
        workers += [_prefill_entry(v, args.dp_aware) for v in args.prefill]
        for (url,) in args.decode:
            entry: dict[str, Any] = {"url": url, "engine": "sglang", "role": "decode"}
            if args.dp_aware:
                entry["options"] = {"dp_aware": True}
            workers.append(entry)
        if args.worker_urls:
            notes.append(
                "--worker-urls with --pd-disaggregation: also serving them as aggregated workers"
            )
    elif args.prefill or args.decode:
        raise ConfigError("--prefill/--decode need --pd-disaggregation")
    workers += [{"url": u, "engine": "sglang"} for u in args.worker_urls]
    policies = {args.policy, args.prefill_policy or args.policy, args.decode_policy or args.policy}
    mode = POLICY_MODES.get(args.policy)
    if mode is None:
        mode = "kv"
        notes.append(f"--policy {args.policy}: no kvplug equivalent, using kv (event-driven)")
    if len(policies) > 1:
        notes.append(
            f"prefill/decode policies {sorted(policies)}: kvplug routes both stages "
            f"with mode {mode}"
        )
    unused = [n for n in UNUSED_TUNING if getattr(args, n) is not None]
    if unused:
        notes.append(
            "unused (kvplug reads real KV events): "
            + ", ".join("--" + n.replace("_", "-") for n in unused)
        )
    if args.prometheus_host or args.prometheus_port:
        notes.append(f"metrics are served at http://{args.host}:{args.port}/metrics")
    serve = ["serve", "--host", args.host, "--port", str(args.port), "--worker-engine", "sglang"]
    if "--router-mode" not in rest:
        serve += ["--router-mode", mode]
    return serve + rest, {"workers": workers}, notes


def main(argv: list[str] | None = None) -> int:
    from kvplug.cli import main as kvplug_main

    try:
        serve, worker_file, notes = translate(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"launch_router: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"launch_router: {note}", file=sys.stderr)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="kvplug-sglang-") as f:
        yaml.safe_dump(worker_file, f)
        f.flush()
        return kvplug_main(serve + ["--worker-config", f.name])


if __name__ == "__main__":
    sys.exit(main())
