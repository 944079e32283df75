"""The ``kvplug`` command. Each subcommand lives in its own module and registers itself here;
imports are lazy so ``kvplug --help`` stays fast and engines stay optional."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing register(subparsers) which sets ``func`` on its parser
SUBCOMMANDS = {
    "serve": "kvplug.frontend.cli",
    "demo": "kvplug.sim.cli",
    "bench": "kvplug.sim.cli",
    "sim": "kvplug.sim.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplug", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    registered: set[str] = set()
    for module_name in dict.fromkeys(SUBCOMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("kvplug"):
                continue  # subcommand not built yet
            raise
        module.register(sub)
        registered.update(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
