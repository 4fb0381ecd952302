"""Benchmark workloads: built from held-out files by a stated rule, sized in tokens."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from sanctum.bench.workloads import build_workloads, is_heldout

SOURCE = '''"""A module about widgets.

Widgets are small things. This docstring is long enough to be prose: it goes on
about widgets, their history, and why anyone would want one in the first place.
"""


def scale_widget(widget, factor, *, clamp=True):
    """Scale a widget by a factor.

    The widget keeps its proportions; with clamp, the factor is limited to 10.
    Scaling applies to every part of the widget, named or numbered, and the
    volume is computed again afterwards from the new width, height and depth.
    """
    if clamp:
        factor = min(factor, 10)
    widget.width = widget.width * factor
    widget.height = widget.height * factor
    widget.depth = widget.depth * factor
    widget.volume = widget.width * widget.height * widget.depth
{extra}    return widget
'''.replace("{extra}", "".join(f"    widget.part{i} = widget.part{i} * factor + {i}\n"
                                 for i in range(50)))


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


def test_every_workload_kind_is_built_from_the_files() -> None:
    """Two completions of code, a chat pair, three copy-heavy ones (rename, repeat, a
    template to fill), prose."""
    names = "".join(f"def tool_{c}(x):\n    \"\"\"Tool {c}.\"\"\"\n    x += 1\n    return x\n\n"
                    for c in "abcdefg")
    files = [(f"m{i}.py", SOURCE * 6) for i in range(3)] + [("tools.py", names)]
    ws = {w.name: w for w in build_workloads(files, words, max_prompt_tokens=4000,
                                             long_target=600)}
    assert set(ws) == {"code-short", "code-long", "doc2body", "rename", "repeat", "template",
                       "prose"}
    repeat = ws["repeat"].messages[0][1]
    assert repeat.startswith("Repeat this function exactly") and "return widget" in repeat
    template = ws["template"].prompt
    assert template.count("def logged_") == 3 and "tool_g" in template.splitlines()[0]
    assert "def logged_tool_d" not in template  # the fourth instance is the answer
    assert ws["code-short"].kind == "completion"
    assert 100 <= ws["code-short"].prompt_tokens < 200
    assert ws["doc2body"].kind == "chat"
    assert ws["doc2body"].messages[0][1].startswith("def scale_widget")
    assert "widget.height" not in ws["doc2body"].messages[0][1]  # the body is the answer
    rename = ws["rename"].messages[0][1]
    assert "`widget` to `widget_value`" in rename and "return widget" in rename
    assert ws["prose"].prompt.startswith("Scale a widget")  # the longest docstring


def test_long_prompt_respects_the_cap() -> None:
    """The long completion never exceeds the seat cap minus a margin."""
    files = [(f"m{i}.py", SOURCE * 20) for i in range(5)]
    ws = {w.name: w for w in build_workloads(files, words, max_prompt_tokens=500)}
    assert ws["code-long"].prompt_tokens <= 500 - 64
    assert ws["code-long"].prompt_tokens == words(ws["code-long"].prompt)


def test_no_files_is_an_error() -> None:
    with pytest.raises(ValueError):
        build_workloads([], words, 1000)


def test_heldout_rule_matches_the_demo_corpus() -> None:
    """The bench holds out exactly the files the demo models never trained on."""
    path = Path(__file__).parents[1] / "deploy" / "demo_models" / "corpus.py"
    if not path.exists():
        pytest.skip("demo corpus builder not in this checkout")
    spec = importlib.util.spec_from_file_location("corpus", path)
    assert spec and spec.loader
    corpus = importlib.util.module_from_spec(spec)
    sys.modules["corpus"] = corpus  # dataclasses look their module up there
    spec.loader.exec_module(corpus)
    names = ["json/decoder.py", "ast.py", "os.py", "asyncio/trsock.py", "a/b/c.py",
             *(f"pkg/mod{i}.py" for i in range(200))]
    assert [is_heldout(n) for n in names] == [corpus.is_heldout(n) for n in names]
    assert any(is_heldout(n) for n in names)


def test_salted_requests_differ_per_call_but_keep_the_body() -> None:
    """The k-th request of a workload gets its own first line; the rest is unchanged."""
    files = [(f"m{i}.py", SOURCE * 6) for i in range(3)]
    ws = {w.name: w for w in build_workloads(files, words, 4000, long_target=600)}
    a, b = ws["code-short"].salted(1), ws["code-short"].salted(2)
    assert a.prompt != b.prompt and a.prompt.endswith(ws["code-short"].prompt)
    chat = ws["doc2body"].salted(3)
    assert chat.messages[0][1] == "# request 3\n" + ws["doc2body"].messages[0][1]


def test_conversation_history_is_a_prefix_and_salts_alike() -> None:
    """The prompt-cache workload: earlier turns are a prefix of the timed turn, also salted."""
    from sanctum.bench.comparisons import conversation

    files = [("a.py", "def a():\n    return 1\n" * 200), ("b.py", "x = 2\n" * 400)]
    w = conversation(files, len, 1000)
    assert w.history and w.messages[: len(w.history)] == w.history
    assert len("".join(c for _, c in w.messages)) <= 1000
    s = w.salted(3)
    assert s.messages[: len(s.history)] == s.history and s.history != w.history


def test_a_short_chat_is_two_turns_under_its_token_count() -> None:
    """The short-chat workload: its first turn is a prefix of the timed second turn, and
    the whole chat stays within its tokens (here characters)."""
    from sanctum.bench.comparisons import short_chat

    files = [("a.py", "def a():\n    return 1\n" * 200)]
    w = short_chat(files, len, 300)
    assert w.history == w.messages[:1] and len(w.messages) == 3
    assert 200 < w.prompt_tokens <= 300
    s = w.salted(2)
    assert s.messages[:1] == s.history and s.history != w.history
