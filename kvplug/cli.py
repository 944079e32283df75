"""The ``kvplug`` command. Each subcommand lives in its own module and registers itself here;
imports are lazy so ``kvplug --help`` stays fast and engines stay optional.

Errors: a mistake on the command line is one line on stderr and exit code 2
(:class:`UsageError`, a ``ConfigError``, or argparse's own usage message); a correct command
that fails while running (a port in use, an unreadable file) is one line and exit code 1
(:class:`RunError`, an ``OSError``). No traceback for either.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import socket
import sys
from collections.abc import Iterable

DESCRIPTION = """\
A KV-cache-aware router for LLM serving (vLLM, SGLang, TensorRT-LLM). Start with
'kvplug demo' (no GPU, under a minute); 'kvplug COMMAND --help' describes each command."""

# subcommand -> module exposing register(subparsers) which sets ``func`` on its parser
SUBCOMMANDS = {
    "serve": "kvplug.frontend.cli",
    "demo": "kvplug.sim.cli",
    "bench": "kvplug.sim.cli",
    "sim": "kvplug.sim.cli",
}


class UsageError(Exception):
    """The command line is wrong (a flag's value, a missing input file): exit code 2."""


class RunError(Exception):
    """The command line is right but running failed (a port in use): exit code 1."""


def check_ports_free(host: str, ports: Iterable[tuple[int, str]]) -> None:
    """Raise RunError naming the flag if a TCP port cannot be bound on ``host`` now (checked
    before anything starts, so nothing is half started or connected when it fails)."""
    for port, flag in ports:
        if port == 0:
            continue  # any free port
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
                s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise RunError(f"{flag}: port {port} on {host} is already in use") from None
            raise RunError(f"{flag}: cannot listen on {host}:{port}: {exc}") from None


def check_port(value: int, flag: str, allow_zero: bool = False) -> None:
    """UsageError unless ``value`` is a TCP port number."""
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise UsageError(f"{flag}: {value} is not a port number ({low}..65535)")


def build_parser() -> argparse.ArgumentParser:
    from kvplug import __version__, backend

    parser = argparse.ArgumentParser(
        prog="kvplug", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=f"kvplug {__version__} (core: {backend})"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in dict.fromkeys(SUBCOMMANDS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("kvplug"):
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvplug.errors import ConfigError, KvplugError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    command = _subparser(parser, args.command)
    if extra:  # the command's usage, not the top-level one
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except (UsageError, ConfigError) as exc:
        print(f"{command.prog}: error: {exc}", file=sys.stderr)
        return 2
    except (RunError, OSError, KvplugError) as exc:
        print(f"{command.prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # python -m kvplug.cli: run the importable module's main, so that
    from kvplug.cli import main as _main  # the subcommands' error classes are the same ones

    sys.exit(_main())
