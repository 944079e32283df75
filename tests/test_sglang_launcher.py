"""The sglang-router compatible launcher: flag translation into ``kvplug serve``."""

from __future__ import annotations

import pytest
import yaml
from kvplug.integrations.sglang.launch_router import translate

from kvplug.cli import build_parser
from kvplug.errors import ConfigError
from kvplug.frontend.config import load_worker_config


def _serve_ok(serve, workers, tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump(workers))
    args = build_parser().parse_args(serve + ["--worker-config", str(path)])
    return args, load_worker_config(path, "sglang")


def test_aggregated_workers_and_policy(tmp_path):
    serve, workers, notes = translate(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--worker-urls",
            "http://127.0.0.1:30001",
            "http://127.0.0.1:30002",
            "--policy",
            "round_robin",
            "--cache-threshold",
            "0.3",
            "--kv-block-size",
            "16",
        ]
    )
    assert serve[:7] == [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--worker-engine",
        "sglang",
    ]
    assert workers == {
        "workers": [
            {"url": "http://127.0.0.1:30001", "engine": "sglang"},
            {"url": "http://127.0.0.1:30002", "engine": "sglang"},
        ]
    }
    args, specs = _serve_ok(serve, workers, tmp_path)
    assert args.router_mode == "round-robin" and args.port == 30000
    assert [s.role for s in specs] == ["both", "both"]
    assert any("--cache-threshold" in n for n in notes)


def test_pd_flags_become_roles_and_bootstrap_ports(tmp_path):
    serve, workers, notes = translate(
        [
            "--pd-disaggregation",
            "--prefill",
            "http://10.0.0.1:30000",
            "9000",
            "--prefill",
            "http://10.0.0.2:30000",
            "none",
            "--prefill",
            "http://10.0.0.5:30000",
            "--decode",
            "http://10.0.0.3:30000",
            "--decode",
            "http://10.0.0.4:30000",
            "--prefill-policy",
            "random",
            "--dp-aware",
        ]
    )
    args, specs = _serve_ok(serve, workers, tmp_path)
    assert args.router_mode == "kv"  # cache_aware
    assert [(s.url, s.role) for s in specs] == [
        ("http://10.0.0.1:30000", "prefill"),
        ("http://10.0.0.2:30000", "prefill"),
        ("http://10.0.0.5:30000", "prefill"),
        ("http://10.0.0.3:30000", "decode"),
        ("http://10.0.0.4:30000", "decode"),
    ]
    assert [s.options.get("bootstrap_port", "-") for s in specs] == [9000, None, 8998, "-", "-"]
    assert all(s.options.get("dp_aware") for s in specs)
    assert any("policies" in n for n in notes)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--api-key", "secret", "--worker-urls", "http://a:1"], "api-key"),
        (["--pd-disaggregation", "--prefill", "http://a:1"], "at least one"),
        (["--prefill", "http://a:1"], "need --pd-disaggregation"),
        (
            ["--pd-disaggregation", "--prefill", "http://a:1", "port", "--decode", "http://b:1"],
            "not an integer",
        ),
        (
            ["--pd-disaggregation", "--prefill", "http://a:1", "1", "2", "--decode", "http://b:1"],
            "URL \\[BOOTSTRAP_PORT",
        ),
    ],
)
def test_bad_flags_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        translate(argv)


def test_explicit_router_mode_wins():
    serve, _, _ = translate(["--worker-urls", "http://a:1", "--router-mode", "least-loaded"])
    assert serve.count("--router-mode") == 1 and "least-loaded" in serve
