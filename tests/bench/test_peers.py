"""The peer gateways as arms of the overload benchmark: named, found, started as configured."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kneegate_bench.arms import Arm, parse_arms
from kneegate_bench.peers import INSTALL, Peer, command, find, parse_peer


def test_peer_arms_are_named_with_an_optional_concurrency() -> None:
    assert parse_peer("litellm") == Peer("litellm")
    assert parse_peer("vllm-router-32") == Peer("vllm-router", 32)
    assert parse_peer("litellm-0") is None and parse_peer("vllm-router-x") is None
    assert parse_peer("kneegate") is None
    assert parse_arms("direct,litellm-8,vllm-router", [], None) == [
        Arm("direct"), Arm("litellm-8", peer=Peer("litellm", 8)),
        Arm("vllm-router", peer=Peer("vllm-router"))]
    with pytest.raises(ValueError, match="litellm\\[-N\\] or vllm-router\\[-N\\]"):
        parse_arms("envoy", [], None)


def test_a_missing_peer_says_what_to_install_and_where(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        find("vllm-router", tmp_path)
    message = str(stop.value)
    assert message.startswith(f"arm vllm-router: no vllm-router in {tmp_path}.")
    assert f".venv-compare/bin/pip install {INSTALL['vllm-router']}" in message
    assert "--peer-bin .venv-compare/bin" in message
    program = tmp_path / "vllm-router"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    assert find("vllm-router", tmp_path) == str(program)


def test_litellm_is_configured_with_the_engine_as_its_one_model(tmp_path: Path) -> None:
    cmd, ready = command(Peer("litellm", 32), "/bin/litellm", "http://127.0.0.1:9000", 8001,
                         "cpu-tiny", tmp_path)
    assert cmd == ["/bin/litellm", "--config", str(tmp_path / "litellm.yaml"), "--host",
                   "127.0.0.1", "--port", "8001"]
    assert ready == "http://127.0.0.1:8001/health/liveliness"
    config = yaml.safe_load((tmp_path / "litellm.yaml").read_text())
    assert config["model_list"] == [{"model_name": "cpu-tiny", "litellm_params": {
        "model": "hosted_vllm/cpu-tiny", "api_base": "http://127.0.0.1:9000/v1",
        "api_key": "none", "max_parallel_requests": 32}}]


def test_vllm_router_takes_the_engine_and_its_limits_by_flag(tmp_path: Path) -> None:
    cmd, ready = command(Peer("vllm-router", 16), "/bin/vllm-router", "http://127.0.0.1:9000",
                         8002, "cpu-tiny", tmp_path)
    assert cmd == ["/bin/vllm-router", "--worker-urls", "http://127.0.0.1:9000", "--host",
                   "127.0.0.1", "--port", "8002", "--log-level", "warning",
                   "--max-concurrent-requests", "16", "--queue-size", "32"]
    assert ready == "http://127.0.0.1:8002/health"


def test_the_relay_cost_run_refuses_an_unknown_or_missing_peer_before_any_cell(
        tmp_path: Path) -> None:
    from kneegate_bench.overhead_peers import run

    with pytest.raises(SystemExit, match="unknown peer 'envoy'"):
        run(["short"], [16], 1.0, ["envoy"], tmp_path)
    with pytest.raises(SystemExit, match="pip install vllm-router"):
        run(["short"], [16], 1.0, ["vllm-router"], tmp_path)  # an empty bin folder
