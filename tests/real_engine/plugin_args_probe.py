"""Run in the vLLM venv: build vLLM's own command-line parser (``vllm serve``'s subcommand, or
the API server's), which loads general plugins the way vLLM does (entry points, in
``AsyncEngineArgs.add_cli_args``), parse a command line, and print what kvplug's plugin read.

    python plugin_args_probe.py serve|api_server CONFIG_YAML
"""

from __future__ import annotations

import json
import os
import sys

os.environ["KVPLUG_ROUTER_URL"] = "http://127.0.0.1:9"  # never used: no engine comes up here

from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

shape, config = sys.argv[1], sys.argv[2]
argv = [
    "--port",
    "8123",
    "--kv-transfer-config",
    '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
    "--config",
    config,
]
if shape == "serve":
    import vllm.entrypoints.cli.serve as serve

    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers(dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(sub)
    parser.parse_args(["serve", "/models/m", *argv])
else:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # before the launchers package
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "/models/m", *argv])

from kvplug.integrations.vllm import plugin  # noqa: E402

registrar = plugin._registrar
assert registrar is not None, "vLLM did not load kvplug's plugin"
args = registrar.args_source.get(5.0, registrar.stopping)
registrar.stopping.set()
print(
    json.dumps(
        {
            "marker_is_own_pid": os.environ.get(plugin.OWNER_ENV) == str(os.getpid()),
            "host": args.host,
            "port": args.port,
            "kv_role": args.kv_role,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        }
    )
)
