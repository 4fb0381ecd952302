"""Model trust: a folder that names code of its own is refused unless its seat trusts it.

The table reads small folders made here.  The real-process tests use a copy of the
packaged demo model (weights linked, config.json copied) whose config names
`evil.py`, a file that leaves a marker beside itself when it runs: the marker proves
whether any process executed it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from shared.builtin import resolve_model
from shared.capcheck import ModelFacts, check
from shared.config import parse_config
from shared.model_trust import OwnCode, own_code, refusal, seat_folders, trust_refusal
from tests.procs import Sanctum, assert_gone, free_port

AUTO_TOK = {"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizerFast"]}


@pytest.mark.parametrize(("config", "tokenizer", "expected"), [
    ({"model_type": "llama"}, {"tokenizer_class": "PreTrainedTokenizerFast"}, []),
    ({"model_type": "llama", "model_file": "evil.py"}, None,
     [("config.json", "model_file", "evil.py", "evil.py")]),
    ({"model_file": "sub/arch.py"}, None,
     [("config.json", "model_file", "sub/arch.py", "sub/arch.py")]),
    ({"auto_map": {"AutoConfig": "configuration_x.XConfig",
                   "AutoModelForCausalLM": "modeling_x.XModel"}}, None,
     [("config.json", "auto_map.AutoConfig", "configuration_x.XConfig", "configuration_x.py"),
      ("config.json", "auto_map.AutoModelForCausalLM", "modeling_x.XModel", "modeling_x.py")]),
    ({"auto_map": {"AutoConfig": "org/repo--configuration_x.XConfig"}}, None,
     [("config.json", "auto_map.AutoConfig", "org/repo--configuration_x.XConfig",
       "hub:org/repo (configuration_x.py)")]),
    ({}, {"auto_map": AUTO_TOK},
     [("tokenizer_config.json", "auto_map.AutoTokenizer[0]", "tokenization_x.XTokenizer",
       "tokenization_x.py"),
      ("tokenizer_config.json", "auto_map.AutoTokenizer[1]", "tokenization_x.XTokenizerFast",
       "tokenization_x.py")]),
    ({}, {"auto_map": ["tok.Slow", None]},  # the older list form, no fast class
     [("tokenizer_config.json", "auto_map[0]", "tok.Slow", "tok.py")]),
    ({}, {"auto_map": {}}, []),
    # Names that only pick the loaders' own code: not reasons.
    ({"model_type": "llama", "architectures": ["Evil"], "tokenizer_class": "EvilTokenizer"},
     {"tokenizer_class": "EvilTokenizer", "chat_template_type": "x", "tool_parser_type": "y"},
     []),
    ({"model_file": None}, {}, []),
    ({"model_file": 7}, None, [("config.json", "model_file", "7", "7")]),
    ("not json {", "[1, 2]", []),  # unreadable configs name nothing; the loader says why
])
def test_what_names_code(tmp_path: Path, config: Any, tokenizer: Any,
                         expected: list[tuple[str, str, str, str]]) -> None:
    """Each config key that makes a loader import Python is found, with the file it names."""
    for name, content in (("config.json", config), ("tokenizer_config.json", tokenizer)):
        if content is not None:
            text = content if isinstance(content, str) else json.dumps(content)
            (tmp_path / name).write_text(text)
    (tmp_path / "unnamed.py").write_text("raise SystemExit")  # named by nothing: not a reason
    assert [(c.file, c.key, c.value, c.code) for c in own_code(tmp_path)] == expected


def test_an_empty_folder_names_nothing(tmp_path: Path) -> None:
    """No config files at all: nothing to refuse (the loader reports the missing file)."""
    assert own_code(tmp_path / "missing") == [] and own_code(tmp_path) == []


def test_refusal_names_file_key_seat_and_the_fix() -> None:
    """The refusal says what names the code and which setting allows it."""
    text = refusal("demo", "model", Path("m"), [OwnCode("config.json", "model_file", "x.py",
                                                        "x.py")])
    assert text == ('model folder m names its own code (config.json model_file = "x.py"); '
                    'set trust_remote_code = true on seat "demo" to allow it')


SEAT_CONFIG = """
[[seat]]
name = "demo"
model = "{model}"
{extra}

[[route]]
model = "demo"
ladder = ["demo"]
"""


def _folder(path: Path, config: dict[str, Any]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(("model", "drafter", "trust", "refused"), [
    ("evil", None, False, "model"),
    ("evil", None, True, None),
    ("plain", None, False, None),
    ("plain", "evil", False, "drafter"),  # the drafter belongs to the seat
    ("plain", "evil", True, None),
    ("builtin:demo", "evil", False, "drafter"),
    ("builtin:demo", "builtin:demo-drafter", False, None),  # ours: not even read
])
def test_trust_refusal_covers_model_and_drafter(tmp_path: Path, model: str,
                                                drafter: str | None, trust: bool,
                                                refused: str | None) -> None:
    """A seat is refused for its model's or its drafter's folder, unless it trusts them."""
    _folder(tmp_path / "evil", {"model_file": "evil.py"})
    _folder(tmp_path / "plain", {"model_type": "llama"})
    extra = f"trust_remote_code = {'true' if trust else 'false'}\n"
    if drafter:
        extra += f'drafter = {{ kind = "model", path = "{drafter}" }}\n'
    config = parse_config(SEAT_CONFIG.format(model=model, extra=extra), base_dir=str(tmp_path))
    seat = config.seat_by_name("demo")
    got = trust_refusal(config, seat)
    if refused is None:
        assert got is None
    else:
        assert got is not None and got.startswith(f"{refused} folder {tmp_path / 'evil'} ")
        assert 'config.json model_file = "evil.py"' in got and 'on seat "demo"' in got
    assert all(not str(f).startswith("builtin:") for _, f in seat_folders(config, seat))


@pytest.mark.parametrize(("trust", "fatal", "warned"), [(False, True, False),
                                                        (True, False, True)])
def test_capcheck_reports_untrusted_code_as_fatal(tmp_path: Path, trust: bool, fatal: bool,
                                                  warned: bool) -> None:
    """`check`: an untrusted folder is a FATAL seat (not a config error); trusted, a warning."""
    extra = "trust_remote_code = true" if trust else ""
    config = parse_config(SEAT_CONFIG.format(model="m", extra=extra), base_dir=str(tmp_path))
    code = (OwnCode("config.json", "model_file", "evil.py", "evil.py"),)
    report = check(config, {"m": ModelFacts(2048, "aaaa", code)})
    assert report.errors == []
    assert bool(report.fatal) is fatal and bool(report.warnings) is warned
    said = (report.fatal or report.warnings)[0]
    assert 'config.json model_file = "evil.py"' in said and said.startswith("seat demo: ")


# -- real processes on a copy of the demo model --------------------------------------

EVIL = """\
from pathlib import Path

Path(__file__).with_name("ran").write_text("executed")
from mlx_lm.models.llama import Model, ModelArgs  # noqa: E402,F401
"""


@pytest.fixture
def evil(tmp_path: Path) -> Path:
    """The demo model's files, config.json naming evil.py, and evil.py itself."""
    demo = resolve_model("builtin:demo")
    folder = tmp_path / "evil-model"
    folder.mkdir()
    for f in demo.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((demo / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_file": "evil.py"}))
    (folder / "evil.py").write_text(EVIL)
    return folder


def _config(folder: Path, tmp_path: Path, trust: bool = False, drafter: bool = False) -> Path:
    if drafter:  # the seat's own model is ours; its drafter is the folder
        extra = f'drafter = {{ kind = "model", path = "{folder}" }}\n'
        model = "builtin:demo"
    else:
        extra, model = "", str(folder)
    extra += f"trust_remote_code = {'true' if trust else 'false'}\n"
    path = tmp_path / "sanctum.toml"
    path.write_text(SEAT_CONFIG.format(model=model, extra=extra))
    return path


def _sanctum(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sanctum.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("drafter", [False, True], ids=["model", "drafter"])
def test_check_refuses_untrusted_folder(evil: Path, tmp_path: Path, drafter: bool) -> None:
    """`sanctum check` exits non-zero naming the key, the seat and the fix; evil.py never runs."""
    done = _sanctum("check", "--config", str(_config(evil, tmp_path, drafter=drafter)))
    assert done.returncode == 1, done.stdout + done.stderr
    role = "drafter" if drafter else "model"
    line = next(x for x in done.stdout.splitlines() if x.startswith("FATAL: "))
    assert f"{role} folder {evil} names its own code" in line
    assert 'config.json model_file = "evil.py"' in line
    assert 'set trust_remote_code = true on seat "demo"' in line
    assert not (evil / "ran").exists()


def test_check_passes_a_trusted_folder(evil: Path, tmp_path: Path) -> None:
    """With trust_remote_code = true that part passes: exit 0, a warning that names the code."""
    done = _sanctum("check", "--config", str(_config(evil, tmp_path, trust=True)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FATAL" not in done.stdout and "runs its own code" in done.stdout
    assert done.stdout.rstrip().endswith("config ok")
    assert not (evil / "ran").exists(), "check reads configs; it never imports them"


def test_seatd_reports_the_seat_fatal_with_the_reason(evil: Path) -> None:
    """A real seatd: the seat is FATAL at once, `sanctum status` shows why, nothing ran."""
    from tests.test_supervisor_procs import cli, status, wait_for

    s = Sanctum(SEAT_CONFIG.format(model=str(evil), extra=""), port=free_port(),
                command="seatd")
    try:
        row = wait_for("demo FATAL", lambda: status(s)["demo"].state == "FATAL" and
                       status(s)["demo"], 60, s)
        assert row.restarts == 0 and row.pid is None
        assert row.last_exit.startswith("model_load_failed: model folder"), row.last_exit
        assert 'config.json model_file = "evil.py"' in row.last_exit
        assert 'set trust_remote_code = true on seat "demo"' in row.last_exit
        shown = cli(s, "status")
        line = next(x for x in shown.stdout.splitlines() if x.startswith("demo "))
        assert "FATAL" in line and "trust_remote_code" in line, shown.stdout
    except BaseException:
        s.kill_everything()
        raise
    assert s.stop() == 0, s.logs()[-3000:]
    assert not (evil / "ran").exists()


@pytest.mark.parametrize("drafter", [False, True], ids=["model", "drafter"])
def test_worker_refuses_untrusted_folder(evil: Path, tmp_path: Path, drafter: bool) -> None:
    """The worker itself (seatd's check aside) exits 79 with the reason; evil.py never runs."""
    config = _config(evil, tmp_path, drafter=drafter)
    reason = tmp_path / "reason"
    state = Path(tempfile.mkdtemp(prefix="sct-", dir="/tmp"))  # ipc paths are short
    env = dict(os.environ, SANCTUM_STATE_DIR=str(state), SANCTUM_EXIT_REASON_FILE=str(reason))
    proc = subprocess.Popen([sys.executable, "-m", "shared.lifecycle", "seatd.worker",
                             "--seat", "demo", "--config", str(config)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=120)
        assert_gone({proc.pid}, timeout=10)
        assert proc.returncode == 79, err[-2000:]
        role = "drafter" if drafter else "model"
        said = reason.read_text()
        assert said.startswith(f"{role} folder {evil} names its own code"), said
        assert 'set trust_remote_code = true on seat "demo"' in said
        assert not (evil / "ran").exists()
        assert not list(state.glob("*.sock")), "the worker removes its socket file"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("trust", [False, True], ids=["untrusted", "trusted"])
def test_the_proxy_loads_no_untrusted_tokenizer(evil: Path, tmp_path: Path, trust: bool) -> None:
    """proxyd counts prompts with a seat's tokenizer; it leaves an untrusted folder's alone
    (the seat is FATAL, and its code must not run in the proxy either)."""
    import asyncio

    from proxyd.admission import Admission
    from shared.config import load_config

    config = load_config(_config(evil, tmp_path, trust=trust))

    async def started() -> Admission:
        admission = Admission(config)
        await admission.start()
        await admission.stop()
        return admission

    admission = asyncio.run(started())
    assert ("demo" in admission.dirs) is trust
    assert not (evil / "ran").exists()  # model_file is the model's code, never the tokenizer's
