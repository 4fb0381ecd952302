"""launchd plists built in code, the committed templates, and the install script's dry run."""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launchd import plists
from seatd.states import stop_deadline
from tests.procs import demo_config

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "deploy" / "install.sh"
HOME = "/Users/someone"


def built(service: str, drain_s: float = 20.0, **kw: Any) -> dict[str, Any]:
    install = plists.Install(sanctum="/opt/sanctum/bin/sanctum", home=HOME,
                             config="/etc/sanctum.toml", drain_s=drain_s, **kw)
    return dict(plistlib.loads(plists.render(service, install)))


@pytest.mark.parametrize("service", plists.SERVICES)
def test_plist_parses_and_carries_the_keys(service: str) -> None:
    """Each service's plist parses and carries every key launchd needs from us."""
    data = built(service)
    assert data["Label"] == f"com.sanctum.{service}"
    assert data["ProgramArguments"] == ["/opt/sanctum/bin/sanctum", service,
                                        "--config", "/etc/sanctum.toml"]
    assert data["RunAtLoad"] is True
    assert data["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert data["ThrottleInterval"] == 10
    assert data["ExitTimeOut"] > stop_deadline(20.0)
    assert data["ProcessType"] == "Interactive"
    env = data["EnvironmentVariables"]
    assert env["PATH"].split(":")[:2] == ["/opt/homebrew/bin", "/usr/local/bin"]
    assert env["SANCTUM_SPECULATION"] == "on" and env["SANCTUM_PROMPT_CACHE"] == "on"
    assert env["SANCTUM_LOG_FORMAT"] == "json"
    assert data["StandardOutPath"] == f"{HOME}/Library/Logs/Sanctum/{service}.log"
    assert data["StandardErrorPath"] == f"{HOME}/Library/Logs/Sanctum/{service}.err.log"
    assert plists.check(service, data) == []


@pytest.mark.parametrize("drain_s", [0.5, 20.0, 45.0, 300.0])
def test_exit_timeout_outlasts_the_internal_drain(drain_s: float) -> None:
    """launchd's SIGKILL comes only after seatd's drain and its own TERM-then-KILL."""
    data = built("seatd", drain_s=drain_s)
    assert data["ExitTimeOut"] > stop_deadline(drain_s)
    assert plists.check("seatd", data, drain_s) == []
    assert plists.check("seatd", data, drain_s + 60), "a longer drain needs a longer timeout"


def test_kill_switches_and_extra_env_reach_the_plist() -> None:
    """`--set` values override the kill switches and add variables."""
    env = built("seatd", env={"SANCTUM_SPECULATION": "off", "SANCTUM_LOG_LEVEL": "debug"})[
        "EnvironmentVariables"]
    assert env["SANCTUM_SPECULATION"] == "off" and env["SANCTUM_LOG_LEVEL"] == "debug"


BROKEN = [
    ("ProcessType", "Background", "ProcessType must be Interactive"),
    ("ExitTimeOut", 5, "ExitTimeOut must be longer"),
    ("KeepAlive", True, "KeepAlive must restart"),
    ("ThrottleInterval", 0, "ThrottleInterval"),
    ("EnvironmentVariables", {"SANCTUM_SPECULATION": "on", "SANCTUM_PROMPT_CACHE": "on"},
     "must set PATH"),
    ("StandardOutPath", "/opt/logs/seatd.log", "StandardOutPath must be under"),
    ("ProgramArguments", ["sanctum", "seatd"], "ProgramArguments"),
    ("Label", "seatd", "Label must be"),
]


@pytest.mark.parametrize(("key", "value", "problem"), BROKEN)
def test_check_names_what_is_wrong(key: str, value: Any, problem: str) -> None:
    """A plist missing one of our guarantees is refused with a message naming it."""
    data = built("seatd")
    data[key] = value
    found = plists.check("seatd", data)
    assert len(found) == 1 and problem in found[0], found


@pytest.mark.parametrize("service", plists.SERVICES)
def test_committed_templates_are_what_the_generator_makes(service: str) -> None:
    """launchd/*.plist are the generator's output with placeholders: regenerate, never edit."""
    committed = (REPO / "launchd" / f"com.sanctum.{service}.plist").read_bytes()
    assert committed == plists.template(service), "run: python -m launchd.plists templates launchd"


@pytest.mark.skipif(shutil.which("plutil") is None, reason="plutil exists only on macOS")
@pytest.mark.parametrize("service", plists.SERVICES)
def test_plutil_lints_the_templates(service: str) -> None:
    """Apple's own checker accepts the plists."""
    path = REPO / "launchd" / f"com.sanctum.{service}.plist"
    assert subprocess.run(["plutil", "-lint", str(path)]).returncode == 0


def install(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HOME=str(home))
    return subprocess.run(["sh", str(INSTALL), *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=120)


def written(output: str) -> dict[str, dict[str, Any]]:
    """The plists a dry run says it would write, by path."""
    found = {}
    for m in re.finditer(r"^\+ write (\S+)\n(<\?xml.*?</plist>)", output, re.S | re.M):
        found[m.group(1)] = plistlib.loads(m.group(2).encode())
    return found


def test_install_dry_run_prints_every_command_and_file(tmp_path: Path) -> None:
    """--dry-run shows the plists and the launchctl calls, in order, and writes nothing."""
    home = tmp_path / "home"
    home.mkdir()
    config = tmp_path / "sanctum.toml"
    config.write_text(demo_config(8800, drain_s=45))
    done = install(home, "--dry-run", "--config", str(config), "--set", "SANCTUM_SPECULATION=off")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    plist_dir = home / "Library" / "LaunchAgents"
    plist_files = written(out)
    assert list(plist_files) == [str(plist_dir / "com.sanctum.seatd.plist"),
                                 str(plist_dir / "com.sanctum.proxyd.plist")]
    for data in plist_files.values():
        service = data["Label"].removeprefix("com.sanctum.")
        assert plists.check(service, data, 45.0) == []
        assert data["ExitTimeOut"] > stop_deadline(45.0)
        assert data["ProgramArguments"][2:] == ["--config", str(config)]
        assert data["EnvironmentVariables"]["SANCTUM_SPECULATION"] == "off"
        assert data["StandardOutPath"].startswith(str(home / "Library" / "Logs" / "Sanctum"))
    domain = f"gui/{os.getuid()}"
    commands = [line[2:] for line in out.splitlines() if line.startswith("+ launchctl")]
    expected = []
    for svc in ("seatd", "proxyd"):
        label = f"com.sanctum.{svc}"
        expected += [f"launchctl bootout {domain}/{label} || true",
                     f"launchctl enable {domain}/{label}",
                     f"launchctl bootstrap {domain} {plist_dir / (label + '.plist')}",
                     f"launchctl kickstart {domain}/{label}"]
    assert commands == expected
    assert f"check --config {config}" in out and "launchd.plists check" in out
    assert re.search(r"\blaunchctl (load|unload)\b", out) is None
    assert list(home.iterdir()) == [], "a dry run must not write anything"


def test_uninstall_dry_run_boots_out_proxyd_then_seatd(tmp_path: Path) -> None:
    """--uninstall --dry-run stops proxyd before seatd, removes both plists, writes nothing."""
    done = install(tmp_path, "--uninstall", "--dry-run")
    assert done.returncode == 0, done.stderr
    domain = f"gui/{os.getuid()}"
    plist_dir = tmp_path / "Library" / "LaunchAgents"
    lines = [line[2:] for line in done.stdout.splitlines() if line.startswith("+ ")]
    assert lines == [f"launchctl bootout {domain}/com.sanctum.proxyd || true",
                     f"rm -f {plist_dir}/com.sanctum.proxyd.plist",
                     f"launchctl bootout {domain}/com.sanctum.seatd || true",
                     f"rm -f {plist_dir}/com.sanctum.seatd.plist"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(sys.platform == "darwin", reason="the real install runs on macOS")
def test_install_refuses_to_run_off_macos(tmp_path: Path) -> None:
    """Without --dry-run, the script refuses to act where there is no launchd."""
    done = install(tmp_path)
    assert done.returncode == 1 and "only on macOS" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_install_rejects_unknown_options(tmp_path: Path) -> None:
    """A mistyped option stops the script with its usage, before anything runs."""
    done = install(tmp_path, "--dry-rnu")
    assert done.returncode == 2 and "unknown option" in done.stderr
    assert "--dry-run" in done.stderr
