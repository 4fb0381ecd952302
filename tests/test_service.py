"""`sanctum service`: system LaunchDaemons for a Mac nobody logs in to.  The account and
path refusals, the daemon plists, the dry run's files and commands, the power advice,
log rotation and reading, and the secrets file, on any platform (launchd itself only
exists on macOS: `plutil` lints where it is found)."""

from __future__ import annotations

import io
import os
import plistlib
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launchd import plists
from sanctum import service, service_plan
from sanctum.cli import main
from sanctum.service_plan import Account, blocked, power_advice, refuse_account
from shared import env_file
from shared.config import parse_config, state_dir
from shared.logs import ReopeningFile


def account(uid: int = 501, groups: frozenset[str] = frozenset({"staff"}),
            home: str = "/Users/sanctum") -> Account:
    return Account("sanctum", uid, 20, "staff", home, groups, frozenset({20}))


@pytest.mark.parametrize(("found", "says"), [
    (None, "no account named 'sanctum'; make it first"),
    (account(uid=0), "is root"),
    (account(groups=frozenset({"staff", "admin"})), "administers this machine (group admin)"),
    (account(groups=frozenset({"sudo"})), "administers this machine (group sudo)"),
    (account(), None),
])
def test_the_account_is_a_standard_one(found: Account | None, says: str | None) -> None:
    """Root, an admin or a missing account is refused, with the command that makes one."""
    why = refuse_account("sanctum", found)
    if says is None:
        assert why is None
    else:
        assert why is not None and says in why and "sysadminctl -addUser" in why


def fake_stat(table: dict[str, tuple[int, int, int]]) -> Any:
    """os.stat over a table of path -> (mode, uid, gid)."""
    def stat_(path: str) -> os.stat_result:
        if path not in table:
            raise FileNotFoundError(path)
        mode, uid, gid = table[path]
        return os.stat_result((mode, 0, 0, 1, uid, gid, 0, 0, 0, 0))
    return stat_


D, F = stat.S_IFDIR, stat.S_IFREG
TREE = {"/": (D | 0o755, 0, 0), "/Users": (D | 0o755, 0, 80),
        "/Users/alice": (D | 0o750, 502, 20), "/Users/alice/m": (D | 0o755, 502, 20),
        "/Users/alice/m/w": (F | 0o644, 502, 20),
        "/srv": (D | 0o755, 0, 0), "/srv/m": (D | 0o700, 502, 20),
        "/srv/k": (F | 0o600, 501, 20), "/srv/g": (F | 0o640, 0, 20),
        "/srv/x": (F | 0o755, 0, 0), "/srv/r": (F | 0o744, 0, 0)}


@pytest.mark.parametrize(("path", "want", "who", "says"), [
    ("/Users/alice/m/w", "read", account(), None),  # staff (gid 20) may enter alice's home
    ("/Users/alice/m/w", "read", Account("s", 501, 30, "s", "/", frozenset(), frozenset({30})),
     "/Users/alice: s cannot enter it (mode 0750"),
    ("/srv/m", "read", account(), "/srv/m: sanctum cannot read it (mode 0700"),
    ("/srv/k", "read", account(), None),  # its own
    ("/srv/g", "read", account(), None),  # by its group
    ("/srv/g", "write", account(), "/srv/g: sanctum cannot write to it"),
    ("/srv/x", "exec", account(), None),
    ("/srv/r", "exec", account(), "/srv/r: sanctum cannot run it (mode 0744"),
    ("/srv/nope", "read", account(), "/srv/nope does not exist"),
])
def test_blocked_names_the_first_part_the_account_cannot_pass(
        path: str, want: service_plan.Want, who: Account, says: str | None) -> None:
    got = blocked(path, who, want, fake_stat(TREE))
    assert got == says if says is None else (got is not None and got.startswith(says)), got


@pytest.mark.parametrize(("mode", "uid", "says"), [
    (F | 0o600, 501, None),
    (F | 0o640, 501, "mode 0640 lets others read it (chmod 600)"),
    (F | 0o600, 0, "must be sanctum's own (sudo chown sanctum /k)"),
    (D | 0o700, 501, "not a regular file"),
])
def test_a_secret_is_the_accounts_own_and_private(mode: int, uid: int, says: str | None) -> None:
    got = service_plan.secret_problem("/k", account(), fake_stat({"/k": (mode, uid, 20)}))
    assert got == says if says is None else (got is not None and says in got), got


PMSET_SERVING = """System-wide power settings:
Currently in use:
 standby              0
 womp                 1
 autorestart          1
 sleep                0 (sleep prevented by sharingd)
 disksleep            10
"""
PMSET_LAPTOPISH = """Currently in use:
 womp                 0
 sleep                1
 displaysleep         10
"""


def test_power_advice_names_what_stops_serving_and_changes_nothing() -> None:
    assert power_advice(PMSET_SERVING) == []
    advice = power_advice(PMSET_LAPTOPISH)
    assert advice == [
        "the Mac sleeps after 1 idle minutes and then serves nothing: sudo pmset -a sleep 0",
        "it stays off after a power loss: sudo pmset -a autorestart 1",
        "it does not wake for network access: sudo pmset -a womp 1"]


def test_launchd_state_is_read_from_launchctl_print() -> None:
    text = ("system/com.sanctum.seatd = {\n\tactive count = 1\n\tpath = /Library/Launch"
            "Daemons/com.sanctum.seatd.plist\n\tstate = running\n\n\tpid = 812\n\t"
            "last exit code = (never exited)\n\tspawn type = interactive (4)\n}\n")
    assert service_plan.launchd_state(text) == {
        "state": "running", "pid": "812", "last exit code": "(never exited)"}


def daemon(service_name: str = "seatd", **kw: Any) -> dict[str, Any]:
    install = plists.Install("/opt/s/bin/sanctum", "/Users/sanctum", "/etc/s.toml",
                             user="sanctum", group="staff", env_file="/Users/sanctum/env",
                             **kw)
    return dict(plistlib.loads(plists.render(service_name, install)))


@pytest.mark.parametrize("service_name", plists.SERVICES)
def test_a_daemon_plist_runs_as_the_account_with_its_own_home_and_logs(
        service_name: str) -> None:
    data = daemon(service_name)
    assert data["UserName"] == "sanctum" and data["GroupName"] == "staff"
    assert data["Umask"] == 0o027
    assert data["RunAtLoad"] is True and data["KeepAlive"] == {"SuccessfulExit": False,
                                                               "Crashed": True}
    assert data["ThrottleInterval"] == plists.THROTTLE_S
    assert data["WorkingDirectory"] == "/Users/sanctum"
    env = data["EnvironmentVariables"]
    assert env["HOME"] == "/Users/sanctum" and env["PATH"] == plists.DEFAULT_PATH
    assert env["SANCTUM_LOG_FILE"] == f"/Library/Logs/Sanctum/{service_name}.log"
    assert env["SANCTUM_ENV_FILE"] == "/Users/sanctum/env"
    assert data["StandardOutPath"] == data["StandardErrorPath"] \
        == f"/Library/Logs/Sanctum/{service_name}.err.log"
    assert data["ProgramArguments"] == ["/opt/s/bin/sanctum", service_name, "--config",
                                        "/etc/s.toml"]
    assert plists.check(service_name, data) == []


@pytest.mark.parametrize(("key", "value", "problem"), [
    ("UserName", "root", "UserName must be a service account, not root"),
    ("Umask", 18, "Umask must be 027"),
    ("StandardOutPath", "/Users/sanctum/Library/Logs/Sanctum/seatd.log",
     "StandardOutPath must be under /Library/Logs/Sanctum"),
])
def test_a_daemon_plist_check_names_what_is_wrong(key: str, value: Any, problem: str) -> None:
    data = daemon()
    data[key] = value
    assert any(p.startswith(problem) for p in plists.check("seatd", data)), \
        plists.check("seatd", data)


def test_a_daemon_plist_holds_no_secret() -> None:
    with pytest.raises(ValueError, match="no secret \\(OPENAI_API_KEY\\)"):
        daemon(env={"OPENAI_API_KEY": "sk-live"})


@pytest.mark.skipif(shutil.which("plutil") is None, reason="plutil exists only on macOS")
def test_plutil_lints_the_daemon_plists(tmp_path: Path) -> None:
    for name in plists.SERVICES:
        path = tmp_path / f"{name}.plist"
        path.write_bytes(plistlib.dumps(daemon(name)))
        subprocess.run(["plutil", "-lint", str(path)], check=True)


SVC_UID = 4242


@pytest.fixture
def me(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Account:
    """The service account `svc` (uid 4242, no admin group, its home in tmp_path), which
    owns what this test's own account owns: the install sees paths as it would."""
    monkeypatch.delenv("SANCTUM_STATE_DIR", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    who = Account("svc", SVC_UID, 4242, "svc", str(home), frozenset({"svc"}),
                  frozenset({4242}))
    monkeypatch.setattr(service, "lookup_account",
                        lambda name: who if name == "svc" else None)

    def as_svc(path: str) -> os.stat_result:
        info = os.stat(path)
        if info.st_uid != os.getuid():
            return info
        fields = list(info[:10])
        fields[4] = SVC_UID
        return os.stat_result(fields)

    monkeypatch.setattr(service, "STAT", as_svc)
    return who


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_install_dry_run_prints_every_file_and_command(
        me: Account, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dry run prints, in order, the folders, the config check as the account, the
    rotation entry and each plist with its content, and launchd's commands; it writes
    nothing."""
    config = tmp_path / "s.toml"
    config.write_text('[[seat]]\nname = "demo"\nmodel = "builtin:demo"\n'
                      '[[route]]\nmodel = "demo"\nladder = ["demo"]\n')
    secrets = tmp_path / "env"
    secrets.write_text("OPENAI_API_KEY=sk-test\n")
    secrets.chmod(0o600)
    code, out, err = run_cli(["service", "install", "--user", "svc", "--config", str(config),
                              "--env-file", str(secrets), "--dry-run"], capsys)
    assert code == 0, err
    steps = [line for line in out.splitlines()
             if line.startswith(("mkdir ", "write ", "+ ", "rm "))]
    sanctum = service._sanctum_script()
    state = state_dir(parse_config(config.read_text()), me.home)
    assert steps == [
        "mkdir -p /Library/Logs/Sanctum (mode 0750, owner svc:svc)",
        f"mkdir -p {state} (mode 0700, owner svc:svc)",
        f"+ sudo -u svc -H {sanctum} check --config {config}",
        "write /etc/newsyslog.d/com.sanctum.conf (mode 0644, owner root:wheel)",
        "write /Library/LaunchDaemons/com.sanctum.seatd.plist (mode 0644, owner root:wheel)",
        "+ plutil -lint /Library/LaunchDaemons/com.sanctum.seatd.plist",
        "+ launchctl bootout system/com.sanctum.seatd || true",
        "+ launchctl enable system/com.sanctum.seatd",
        "+ launchctl bootstrap system /Library/LaunchDaemons/com.sanctum.seatd.plist",
        "write /Library/LaunchDaemons/com.sanctum.proxyd.plist (mode 0644, owner root:wheel)",
        "+ plutil -lint /Library/LaunchDaemons/com.sanctum.proxyd.plist",
        "+ launchctl bootout system/com.sanctum.proxyd || true",
        "+ launchctl enable system/com.sanctum.proxyd",
        "+ launchctl bootstrap system /Library/LaunchDaemons/com.sanctum.proxyd.plist",
    ]
    assert "/Library/Logs/Sanctum/seatd.log" in out and "svc:svc  640  7  10240  *  JN" in out
    # each plist printed whole, and what it says passes the daemon checks
    for name in plists.SERVICES:
        start = out.index(f"write /Library/LaunchDaemons/com.sanctum.{name}.plist")
        body = out[out.index("<?xml", start): out.index("</plist>", start) + 8]
        data = plistlib.loads(body.encode())
        assert data["UserName"] == "svc" and plists.check(name, data) == []
        assert "sk-test" not in body
    assert not Path("/Library/LaunchDaemons/com.sanctum.seatd.plist").exists()


@pytest.mark.parametrize("user", ["root-like", "admin-like", "missing"])
def test_install_refuses_an_account_that_is_not_a_service_account(
        user: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    found = {"root-like": account(uid=0),
             "admin-like": account(groups=frozenset({"admin", "staff"}))}.get(user)
    monkeypatch.setattr(service, "lookup_account", lambda name: found)
    code, out, err = run_cli(["service", "install", "--user", user, "--dry-run"], capsys)
    assert code == 1 and not out
    assert ("is root" if user == "root-like" else "administers" if user == "admin-like"
            else "no account named 'missing'") in err


def test_install_refuses_an_unreadable_model_and_a_loose_key_file(
        me: Account, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "config.json").chmod(0)
    keys = tmp_path / "keys"
    keys.write_text("sk-one\n")
    keys.chmod(0o644)
    config = tmp_path / "s.toml"
    config.write_text(f'[proxy]\napi_keys_file = "{keys}"\n[[seat]]\nname = "m"\n'
                      f'model = "{model}"\n[[route]]\nmodel = "m"\nladder = ["m"]\n')
    code, out, err = run_cli(["service", "install", "--user", "svc", "--config", str(config),
                              "--dry-run"], capsys)
    assert code == 1 and not out
    assert f"{model}/config.json: svc cannot read it (mode 0000" in err
    assert f"{keys}: mode 0644 lets others read it (chmod 600)" in err


def test_install_without_root_or_macos_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    if sys.platform == "darwin" and os.geteuid() == 0:
        pytest.skip("this machine could install for real")
    code, _, err = run_cli(["service", "install", "--user", "svc"], capsys)
    assert code == 1 and "needs macOS and root (sudo); --dry-run" in err


def test_uninstall_dry_run_boots_out_proxyd_then_seatd_and_keeps_the_logs(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["service", "uninstall", "--dry-run"], capsys)
    assert code == 0
    assert out.splitlines() == [
        "+ launchctl bootout system/com.sanctum.proxyd || true",
        "rm -f /Library/LaunchDaemons/com.sanctum.proxyd.plist",
        "+ launchctl bootout system/com.sanctum.seatd || true",
        "rm -f /Library/LaunchDaemons/com.sanctum.seatd.plist",
        "rm -f /etc/newsyslog.d/com.sanctum.conf"]
    code, out, _ = run_cli(["service", "uninstall", "--purge-logs", "--dry-run"], capsys)
    assert out.splitlines()[-1] == "rm -rf /Library/Logs/Sanctum"


def test_logs_prints_the_last_lines_of_each_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "seatd.log").write_text("".join(f"s{i}\n" for i in range(5)))
    (tmp_path / "proxyd.log").write_text("p0\np1\n")
    code, out, _ = run_cli(["service", "logs", "--lines", "2", "--log-dir", str(tmp_path)],
                           capsys)
    assert code == 0 and out.splitlines() == ["s3", "s4", "p0", "p1"]
    code, _, err = run_cli(["service", "logs", "--log-dir", str(tmp_path / "none")], capsys)
    assert code == 1 and "no logs in" in err


def test_logs_follow_goes_on_in_the_new_file_after_a_rotation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "seatd.log"
    log.write_text("old\n")
    def append(text: str) -> None:
        with log.open("a") as f:
            f.write(text)

    writes = iter([lambda: append("one\n"),
                   lambda: (log.rename(tmp_path / "seatd.log.0"), append("two\n")),
                   lambda: append("three\n")])
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    service.follow([log], sleep=lambda s: next(writes, lambda: None)(), rounds=4)
    assert out.getvalue() == "one\ntwo\nthree\n"


def test_a_log_file_is_opened_again_once_it_was_rotated(tmp_path: Path) -> None:
    """newsyslog renames the file away; the process's next write after the check goes
    to a new file at the same path, never to the renamed one (`N`: no signal)."""
    now = [0.0]
    path = tmp_path / "seatd.log"
    f = ReopeningFile(str(path), clock=lambda: now[0])
    f.write("a\n")
    f.flush()
    path.rename(tmp_path / "seatd.log.0")
    f.write("b\n")  # within the check's second: still the open (renamed) file
    now[0] = 1.5
    f.write("c\n")
    f.flush()
    assert (tmp_path / "seatd.log.0").read_text() == "a\nb\n"
    assert path.read_text() == "c\n"


def test_the_env_file_gives_secrets_only_from_a_private_file_of_this_account(
        tmp_path: Path) -> None:
    assert env_file.parse("# keys\nA=1\n\n B = x=y \n") == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="line 2: expected NAME=VALUE"):
        env_file.parse("A=1\nnot a pair\n")
    path = tmp_path / "env"
    path.write_text("SANCTUM_TEST_A=1\nSANCTUM_TEST_B=2\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="mode 0644 lets others read it"):
        env_file.load(str(path), {})
    path.chmod(0o600)
    environ = {"SANCTUM_TEST_B": "kept"}
    assert env_file.load(str(path), environ) == ["SANCTUM_TEST_A"]
    assert environ == {"SANCTUM_TEST_A": "1", "SANCTUM_TEST_B": "kept"}


def test_the_state_dir_of_another_account_is_under_its_home(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SANCTUM_STATE_DIR", raising=False)
    config = parse_config('[[seat]]\nname = "d"\nmodel = "builtin:demo"\n'
                          '[[route]]\nmodel = "d"\nladder = ["d"]\n')
    got = state_dir(config, "/Users/svc")
    assert str(got).startswith("/Users/svc/") and got.name.lower() == "sanctum"
    pinned = parse_config('[seatd]\nstate_dir = "~/state"\n[[seat]]\nname = "d"\n'
                          'model = "builtin:demo"\n[[route]]\nmodel = "d"\nladder = ["d"]\n')
    assert state_dir(pinned, "/Users/svc") == Path("/Users/svc/state")
