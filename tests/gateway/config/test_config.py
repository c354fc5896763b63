"""Config: validation names the field path; flags override; workers split fixed limits."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from helpers.gateway import EXAMPLE

from kneegate.cli import apply_flags, main
from kneegate.gateway.config.gateway import (
    GatewayConfig,
    load_config,
    parse_config,
    split_for_worker,
)
from kneegate.gateway.errors import ConfigError


def _field(data: object) -> tuple[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.field, info.value.reason


def test_example_file_loads() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.upstreams[0].name == "vllm-0"
    assert cfg.classes["interactive"].priority > cfg.classes["batch"].priority
    assert cfg.api_keys == {"sk-batch-jobs-0001": "batch"}
    assert cfg.classes["batch"].header and not cfg.classes["interactive"].header


def test_defaults_need_no_file() -> None:
    cfg = GatewayConfig()
    assert cfg.upstreams == [] and cfg.default_class in cfg.classes
    assert cfg.timeouts.first_byte > 5 and cfg.timeouts.idle > 5  # never a library's 5 s


@pytest.mark.parametrize(
    ("data", "field", "reason"),
    [
        ({"upstreams": [{"name": "a", "url": "localhost:8000"}]}, "upstreams[a].url", "http"),
        ({"upstreams": [{"name": "a", "url": "http://h:1/v1"}]}, "upstreams[a].url", "no path"),
        ({"upstreams": [{"name": "a", "url": "http://h:1", "controller": "magic"}]},
         "upstreams[a].controller", "unknown controller"),
        ({"upstreams": [{"name": "a", "url": "http://h:1", "params": {"initial": 0}}]},
         "upstreams[a].params.initial", "greater than or equal to 1"),
        ({"upstreams": [{"name": "a", "url": "http://h:1", "params": {"intial": 4}}]},
         "upstreams[a].params.intial",
         "not a parameter of controller 'knee' (did you mean 'initial'?)"),
        ({"upstreams": [{"name": "a", "url": "http://h:1", "controller": "aimd",
                         "params": {"backof": 0.8}}]},
         "upstreams[a].params.backof", "did you mean 'backoff'?"),
        ({"upstreams": [{"name": "a", "url": "http://h:1", "controller": "fixed",
                         "params": {"sk-live-0123abcd": 1}}]},
         "upstreams[a].params.<unknown key>",
         "not shown: it may be a secret); its parameters: initial, max_limit, min_limit,"),
        ({"upstreams": [{"name": "a", "url": "http://h:1", "params": {"initial": 4,
                                                                       "min_limit": 8}}]},
         "upstreams[a].params", "need min_limit <= initial <= max_limit, got 8 <= 4"),
        ({"upstreams": [{"name": "a", "url": "http://h:1"}, {"url": "http://h:2"}]},
         "upstreams[http://h:2].name", "Field required"),
        ({"upstreams": [{"url": "http://ops:pw-secret@h:2?key=k-secret"}]},
         "upstreams[http://h:2?***].name", "Field required"),
        ({"upstreams": [{"name": "a", "url": "http://h:1", "stale_after": 0.5}]},
         "upstreams[a].stale_after", "give more than scrape_interval"),
        ({"timeouts": {"idle": -1}}, "timeouts.idle", "greater than 0"),
        ({"max_queue": -1}, "max_queue", "greater than or equal to 0"),
        ({"default_class": "vip"}, "default_class", "'vip' is not one of"),
        ({"api_keys": {"k1234": "vip"}}, "api_keys", "entry 1 maps to unknown class 'vip'"),
        ({"api_keys": {"k1234": 5}}, "api_keys.<key>", "valid string"),
        ({"admin_token": ""}, "admin_token", "at least 1 character"),
        ({"classes": {"a": {"queue_share": 2}}, "default_class": "a"},
         "classes.a.queue_share", "less than or equal to 1"),
        ({"sever": {}}, "sever", "Extra inputs are not permitted (did you mean 'server'?)"),
        ({"limits": {"max_header": 1}}, "limits.max_header", "did you mean 'max_headers'?"),
        ({"sk-live-0123abcd": "batch"}, "<unknown key>", "the key is not shown"),
        ({"timeouts": {"sk_live_0123": 1}}, "timeouts.<unknown key>", "not shown"),
        ([1, 2], "", "mapping"),
    ],
)
def test_bad_config_names_field_and_reason(data: object, field: str, reason: str) -> None:
    got_field, got_reason = _field(data)
    assert got_field == field
    assert reason in got_reason


def test_url_errors_hide_passwords_and_queries() -> None:
    for url in ("http://ops:pw-secret@h:1/v1?key=k-secret", "ftp://ops:pw-secret@h:1"):
        field, reason = _field({"upstreams": [{"name": "a", "url": url}]})
        assert field == "upstreams[a].url" and "ops:***@h:1" in reason
        assert "pw-secret" not in reason and "k-secret" not in reason


def test_duplicate_upstream_names_rejected() -> None:
    ups = [{"name": "a", "url": "http://h:1"}, {"name": "a", "url": "http://h:2"}]
    assert _field({"upstreams": ups})[0] == "upstreams"


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("upstreams:\n  - name: a\n    url: http://h:1\n    params: {initial: 0}\n")
    assert main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "upstreams[a].params.initial" in err
    assert main(["check-config", str(EXAMPLE)]) == 0
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == 1
    (tmp_path / "broken.yaml").write_text("upstreams: [\n")
    assert main(["check-config", str(tmp_path / "broken.yaml")]) == 1
    assert "not valid YAML" in capsys.readouterr().err
    (tmp_path / "empty.yaml").write_text("")
    assert main(["check-config", str(tmp_path / "empty.yaml")]) == 1
    assert "the config is empty" in capsys.readouterr().err


def test_check_config_names_upstreams_without_their_credentials(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kneegate.yaml"
    path.write_text("upstreams: [{name: vllm, url: 'http://ops:pw-secret@h:1'}]\n")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "upstreams: vllm=http://h:1 (knee)" in out and "pw-secret" not in out


@pytest.mark.parametrize(("content", "reason"), [
    (b"", "the config is empty"),
    (b"# only a comment\n\n", "the config is empty"),
    (b"upstreams: []\nadmin_token:\n", "admin_token: no value"),
    (b"max_queue: 1\nclass_header: caf\xe9\n", "not UTF-8 text (byte 0xe9 at line 2)"),
    (b"[" * 10_000, "nest"),  # libyaml's own cap (1000) or ours
    ("".join(" " * i + "k:\n" for i in range(40)).encode(), "nested deeper than 32 levels"),
    (b"a: &a [1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\n"
     b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c]\n"
     b"e: &e [*d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e]\n",
     "expands to more than"),
    (b"max_queue: " + b"9" * 5000, "a value cannot be converted"),
    (b"admin_token: hunter2-secret: [\n", "mapping values are not allowed"),
    (b"upstreams: []\nadmin_token: hunter2-secret: [\n", "at line 2, column"),
    (b"x" * (1 << 20) + b"\n", "larger than"),
])
def test_files_that_cannot_be_a_config(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "kneegate.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert reason in str(info.value)
    assert "hunter2" not in str(info.value)  # PyYAML would quote the line; we do not


def test_a_null_admin_token_and_an_empty_mapping_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "kneegate.yaml"
    path.write_text("admin_token: null  # none\n")
    assert load_config(path).admin_token is None
    path.write_text("{}")
    assert load_config(path) == GatewayConfig()


def _flags(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = dict(upstream=None, host=None, port=None, controller=None,
                                   limit=None, workers=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_flags_override_the_file() -> None:
    cfg = apply_flags(load_config(EXAMPLE), _flags(
        upstream=["http://10.0.0.1:8000"], port=9999, limit=100000, workers=2))
    assert [u.url for u in cfg.upstreams] == ["http://10.0.0.1:8000"]
    assert cfg.upstreams[0].params["initial"] == 100000  # above the default max_limit
    assert cfg.server.port == 9999 and cfg.server.workers == 2
    assert cfg.classes == load_config(EXAMPLE).classes


def test_flags_switch_controller_and_drop_old_params() -> None:
    cfg = apply_flags(load_config(EXAMPLE), _flags(controller="aimd", limit=8))
    assert cfg.upstreams[0].controller == "aimd"
    assert cfg.upstreams[0].params["initial"] == 8


def test_workers_split_a_fixed_limit_exactly() -> None:
    cfg = parse_config({"max_queue": 10, "upstreams": [
        {"name": "a", "url": "http://h:1", "params": {"initial": 10, "min_limit": 4}}]})
    parts = [split_for_worker(cfg, i, 4) for i in range(4)]
    limits = [p.upstreams[0].params["initial"] for p in parts]
    assert limits == [3, 3, 2, 2] and sum(limits) == 10
    assert sum(p.max_queue for p in parts) == 10
    assert all(p.upstreams[0].params["min_limit"] <= p.upstreams[0].params["initial"]
               for p in parts)
    assert split_for_worker(cfg, 0, 1) is cfg
