"""`sanctum check`: each cap inconsistency is caught with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.capcheck import ModelFacts, Report, check, check_path, model_facts, render
from shared.config import parse_config

BASE = """
[proxy]
tokenizer_margin = {margin}

[[seat]]
name = "brain"
model = "m/brain"
{brain}

[[seat]]
name = "coder"
model = "m/coder"

[[seat]]
name = "hosted"
kind = "openai"
base_url = "https://example.invalid/v1"
offbox = true
{hosted}

[[route]]
model = "brain"
ladder = ["brain", "coder"]
{route}
"""

SAME = ModelFacts(2048, "aaaa")


def run(brain: str = "", margin: int = 64, route: str = "", hosted: str = "",
        coder: ModelFacts = SAME) -> tuple[list[str], list[str]]:
    config = parse_config(BASE.format(brain=brain, margin=margin, route=route, hosted=hosted))
    report = check(config, {"m/brain": SAME, "m/coder": coder})
    return report.errors, report.warnings


def test_consistent_config_passes_and_uses_default_caps() -> None:
    """Defaults: a cap under the context with room to answer, proxy = cap - margin."""
    config = parse_config(BASE.format(brain="", margin=64, route="", hosted=""))
    report = check(config, {"m/brain": SAME, "m/coder": SAME})
    assert report.errors == []
    rows = {(r.layer, r.seat): r.cap for r in report.rows}
    assert rows[("seat", "brain")] == 1536 and rows[("proxy", "brain")] == 1472
    assert rows[("model", "brain")] == 2048
    assert rows[("proxy", "hosted")] == 65536 - 1024


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"brain": "max_prompt_tokens = 1000\nproxy_max_prompt_tokens = 990"},
         "plus margin 64 exceeds the seat's cap 1000"),
        ({"brain": "max_prompt_tokens = 4096"}, "not below the model's context length 2048"),
        ({"brain": "max_prompt_tokens = 60", "margin": 64}, "leaves no room"),
        ({"route": "same_tokenizer = true", "coder": ModelFacts(2048, "bbbb")},
         "same_tokenizer is claimed but the seats' tokenizers differ"),
        ({"hosted": "max_prompt_tokens = 2000\nproxy_max_prompt_tokens = 1500"},
         "proxy cap plus hosted margin exceeds"),
    ],
)
def test_each_inconsistency_is_an_error(kw: dict, needle: str) -> None:
    """Proxy cap over the seat's, seat cap over the context, no room, mixed tokenizers."""
    errors, _ = run(**kw)
    assert any(needle in e for e in errors), errors


def test_same_tokenizer_claim_that_holds_passes() -> None:
    """The same claim with identical tokenizers is fine."""
    assert run(route="same_tokenizer = true")[0] == []


def test_unreadable_model_is_a_warning_not_an_error() -> None:
    """A missing model makes that seat FATAL at run time, not the whole config invalid."""
    config = parse_config(BASE.format(brain="", margin=64, route="", hosted=""))
    report = check(config, {"m/brain": "no such directory", "m/coder": SAME})
    assert report.errors == []
    assert any("brain" in w and "cannot be read" in w for w in report.warnings)


def _model(dir: Path, context: int, tokenizer: str) -> None:
    dir.mkdir(parents=True)
    (dir / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
    (dir / "tokenizer.json").write_text(tokenizer)


def _cli(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    return subprocess.run([sys.executable, "-m", "sanctum.cli", "check", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120)


def test_cli_prints_every_layer_and_fails_on_mismatch(tmp_path: Path) -> None:
    """The command prints a row per layer and seat, and exits non-zero naming the problem."""
    _model(tmp_path / "m" / "brain", 2048, '{"a": 1}')
    _model(tmp_path / "m" / "coder", 2048, '{"a": 2}')
    text = BASE.format(brain="", margin=64, route="", hosted="")
    ok = _cli(tmp_path, text)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for layer in ("proxy", "seat", "model"):
        assert any(line.startswith(layer) and "brain" in line for line in ok.stdout.splitlines())
    assert "upper-bound estimate" in ok.stdout
    bad = _cli(tmp_path, BASE.format(brain="", margin=64, route="same_tokenizer = true",
                                     hosted=""))
    assert bad.returncode == 1 and "tokenizers differ" in bad.stdout


def test_cli_negative_margin_is_refused(tmp_path: Path) -> None:
    """A negative margin is refused with a message naming the key."""
    res = _cli(tmp_path, BASE.format(brain="", margin=-5, route="", hosted=""))
    assert res.returncode == 2 and "tokenizer_margin" in res.stderr


def test_daemons_refuse_to_start_on_cap_error(tmp_path: Path) -> None:
    """`sanctum proxyd` exits at once with the check's error instead of serving."""
    _model(tmp_path / "m" / "brain", 2048, "{}")
    _model(tmp_path / "m" / "coder", 2048, "{}")
    cfg = tmp_path / "c.toml"
    cfg.write_text(BASE.format(brain="max_prompt_tokens = 9999", margin=64, route="",
                               hosted=""))
    res = subprocess.run([sys.executable, "-m", "sanctum.cli", "proxyd", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "context length 2048" in res.stderr


def test_model_facts_carry_the_code_a_folder_names(tmp_path: Path) -> None:
    """`model_facts` reads what a folder names as code; builtin folders name none."""
    _model(tmp_path / "m" / "brain", 2048, "{}")
    (tmp_path / "m" / "brain" / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 2048, "model_file": "evil.py"}))
    config = parse_config(BASE.format(brain="", margin=64, route="", hosted=""),
                          base_dir=str(tmp_path))
    got = model_facts(config, "m/brain")
    assert isinstance(got, ModelFacts) and [str(c) for c in got.own_code] == [
        'config.json model_file = "evil.py"']
    demo = model_facts(config, "builtin:demo")
    assert isinstance(demo, ModelFacts) and demo.own_code == ()


def test_render_shows_fatal_seats_and_counts_them() -> None:
    """FATAL lines come before errors, and the last line counts both."""
    assert render(Report([], [], [], ["seat a: x"])).splitlines()[-2:] == [
        "FATAL: seat a: x", "1 seat(s) FATAL"]
    assert render(Report([], ["e"], [], ["seat a: x"])).splitlines()[-1] == (
        "1 error(s), 1 seat(s) FATAL")
    assert render(Report([], [], [])).splitlines()[-1] == "config ok"


def test_a_seat_that_will_be_fatal_does_not_stop_the_daemons(tmp_path: Path) -> None:
    """preflight refuses cap errors only: an untrusted folder costs its seat, not the rest."""
    from sanctum.cli import preflight

    for name in ("brain", "coder"):
        _model(tmp_path / "m" / name, 2048, "{}")
    (tmp_path / "m" / "brain" / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 2048, "auto_map": {"AutoConfig": "c.C"}}))
    config = parse_config(BASE.format(brain="", margin=64, route="", hosted=""),
                          base_dir=str(tmp_path))
    report = check_path(config)
    assert report.errors == [] and len(report.fatal) == 1
    assert 'config.json auto_map.AutoConfig = "c.C"' in report.fatal[0]
    preflight(config)  # no SystemExit
