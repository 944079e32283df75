"""The ``kvplug`` command's answers to ordinary mistakes: one line on stderr, no traceback,
exit code 2 for a wrong command line and 1 for a correct one that cannot run; and help
texts that say what the command really does."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import kvplug
from kvplug.cli import main

pytestmark = pytest.mark.timeout(60)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: --help, --version, its own usage errors
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "--trace", "missing.jsonl"], "--trace missing.jsonl: no such file"),
        (["bench", "--policies", "kv:credit=abc"], "policy 'kv:credit=abc'"),
        (["bench", "--policies", "nope"], "policy 'nope'"),
        (["demo", "--duration", "-5"], "--duration must be > 0"),
        (["demo", "--start", "-1"], "--start must be >= 0"),
        (["bench", "--limit", "0"], "--limit must be >= 1"),
        (["sim", "--base-port", "99999"], "--base-port: 99999 is not a port number"),
        (["sim", "--base-port", "65000", "--engines", "3"], "66000 is not a port number"),
        (["sim", "--engines", "0"], "--engines"),
        (
            ["bench", "--long-prefill-token-threshold", "-1"],
            "--long-prefill-token-threshold must be >= 0",
        ),
        (
            ["sim", "--long-prefill-token-threshold", "-1"],
            "--long-prefill-token-threshold must be >= 0",
        ),
    ],
)
def test_usage_mistakes_are_one_line_and_exit_2(argv, words, capsys):
    rc, _, err = run(argv, capsys)
    line = one_line(err)
    assert rc == 2 and line.startswith(f"kvplug {argv[0]}: error: ") and words in line, line


def test_a_file_that_is_not_a_trace_is_one_line(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# kvplug\n\nnot a trace\n")
    rc, _, err = run(["demo", "--trace", str(readme)], capsys)
    assert rc == 2 and "is not a Mooncake JSONL trace" in one_line(err)
    # a bad record further down is found when the trace is loaded: one line, exit 1
    trace = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    trace.write_text(good + "\n{broken\n")
    rc, _, err = run(["bench", "--trace", str(trace), "--no-progress", "--json", ""], capsys)
    assert rc == 1 and ":2: bad trace record" in one_line(err)


def test_a_port_in_use_is_one_line_and_exit_1(busy_port, capsys):
    rc, _, err = run(["sim", "--base-port", str(busy_port)], capsys)
    line = one_line(err)
    assert rc == 1 and line.endswith(
        f"--base-port: port {busy_port} on 127.0.0.1 is already in use"
    )


def test_serve_checks_its_port_before_contacting_any_worker(busy_port):
    # a worker that would hang the start if contacted: a listening socket that never answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        worker = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc = subprocess.run(
            [sys.executable, "-m", "kvplug.cli", "serve", "--host", "127.0.0.1"]
            + ["--port", str(busy_port), "--worker", worker],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode == 1, proc.stderr
    line = one_line(proc.stderr)
    assert line == f"kvplug serve: error: --port: port {busy_port} on 127.0.0.1 is already in use"


def test_an_unknown_flag_shows_the_commands_usage(capsys):
    rc, _, err = run(["demo", "--bogus"], capsys)
    assert rc == 2 and err.startswith("usage: kvplug demo ")
    assert err.strip().endswith("kvplug demo: error: unrecognized arguments: --bogus")


def test_help_says_what_the_commands_really_do(capsys):
    rc, out, _ = run(["demo", "--help"], capsys)
    assert rc == 0 and "(default: 1200, 20 minutes)" in " ".join(out.split())
    rc, out, _ = run(["bench", "--help"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "profile" in text and "lmetric" in text
    rc, out, _ = run(["--help"], capsys)
    assert rc == 0 and "``" not in out and "kvplug demo" in out


def test_version(capsys):
    rc, out, _ = run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"kvplug {kvplug.__version__} (core: {kvplug.backend})"


def test_a_router_setting_of_the_wrong_type_is_a_config_error():
    # was a TypeError ("'<' not supported ...") from deep in validation
    from kvplug import ConfigError, RouterConfig

    with pytest.raises(ConfigError, match="--router-kv-overlap-score-credit must be a float"):
        RouterConfig.from_dict({"router-kv-overlap-score-credit": "abc"})
    with pytest.raises(ConfigError, match="--kv-block-size must be an int"):
        RouterConfig(kv_block_size=16.5)  # type: ignore[arg-type]
    assert RouterConfig(router_track_output_blocks=1).router_track_output_blocks == 1


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "--sweep", "credit=abc", "temperature=0"], "values must be numbers"),
        (["bench", "--sweep", "nokey=1", "temperature=0"], "'nokey=1' is not KEY=VALUE"),
        (["bench", "--workload", "bogus"], "unknown workload 'bogus'"),
        (["serve", "--port", "99999"], "--port: 99999 is not a port number"),
    ],
)
def test_more_usage_mistakes(argv, words, capsys):
    rc, _, err = run(argv, capsys)
    assert rc == 2 and words in one_line(err)
