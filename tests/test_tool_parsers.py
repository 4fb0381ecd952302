"""Tool calls out of answers as real model families emit them (seatd/tool_calls.py):
mlx-lm's parser for each family, the markers found however the text is cut into
chunks, a call that does not parse dropped, never sent as its markup."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from seatd.tool_calls import (
    Family,
    ToolSplitter,
    call_id,
    calls_of,
    family_named,
    seat_family,
    splitter_for,
    tool_finish,
)
from shared import protocol
from shared.builtin import resolve_model
from shared.prompt import load_tokenizer
from tests.worker_rig import Recorder, demo_worker, drive, serving

DATA = Path(__file__).parent / "data" / "tool_calls"
TOOLS: list[Any] = json.loads((DATA / "tools.json").read_text())
RECORDINGS = sorted(p.stem for p in DATA.glob("*.txt"))


def recording(stem: str) -> tuple[str, dict[str, Any]]:
    """A recorded answer and what it holds: its family, its text outside calls, its calls."""
    return (DATA / f"{stem}.txt").read_text(), json.loads((DATA / f"{stem}.json").read_text())


def run(family: Family, pieces: list[str], tools: list[Any] | None = TOOLS,
        parallel: bool = True) -> tuple[str, list[dict[str, Any]], ToolSplitter]:
    """Feed `pieces` and close: (the text sent, the calls as name and decoded arguments)."""
    splitter = ToolSplitter(family, tools, "req-1", parallel)
    texts: list[str] = []
    calls = []
    for piece in [*pieces, None]:
        got = splitter.close() if piece is None else splitter.feed(piece)
        texts.append(got.text)
        calls.extend(got.calls)
    assert [c.index for c in calls] == list(range(len(calls)))
    assert [c.id for c in calls] == [call_id("req-1", i) for i in range(len(calls))]
    return "".join(texts), [{"name": c.name, "arguments": json.loads(c.arguments)}
                            for c in calls], splitter


def cuts(text: str) -> list[list[str]]:
    """The text whole, one character at a time, at every single cut, and in random pieces."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(len(text))
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        out.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return out


def test_every_family_of_the_list_is_recorded() -> None:
    """The families the issue names, each with at least one recorded answer."""
    families = {recording(stem)[1]["family"] for stem in RECORDINGS}
    assert {"json_tools", "qwen3_coder", "mistral", "pythonic", "glm47", "kimi_k2",
            "minimax_m2", "gemma4", "function_gemma", "longcat", "minicpm5"} <= families


@pytest.mark.parametrize("stem", RECORDINGS)
def test_a_recorded_answer_gives_its_calls_however_it_is_cut(stem: str) -> None:
    """The calls and the text around them, the same whatever chunks the text came in."""
    text, want = recording(stem)
    family = family_named(want["family"])
    for pieces in cuts(text):
        sent, calls, splitter = run(family, pieces)
        assert (sent, calls) == (want["text"], want["calls"]), pieces
        assert splitter.failures == 0 and splitter.made == len(want["calls"])


def test_text_before_a_call_is_sent_before_the_call_completes() -> None:
    """Plain text is never held longer than a possible start marker."""
    splitter = ToolSplitter(family_named("json_tools"), TOOLS, "r")
    assert splitter.feed("Sure, <tool") == ("Sure, ", ())
    assert splitter.feed("bar> and") == ("<toolbar> and", ())
    assert splitter.feed(" <tool_call>\n{\"name\": ") == (" ", ())
    got = splitter.feed('"get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>.')
    assert got.text == "." and [c.name for c in got.calls] == ["get_time"]


MALFORMED = [
    # bad JSON inside the markers
    ("json_tools", 'A<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n'
                   "</tool_call>B"),
    # a call of a function the request did not give
    ("json_tools", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
    # arguments that are not an object
    ("json_tools", '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>'),
    # no call in the family's syntax between its markers
    ("pythonic", "<|tool_call_start|>[get_weather(city=<|tool_call_end|>"),
    # unclosed at the end of the answer, in a family whose end marker is not optional
    ("json_tools", 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"),
    # cut short where the end marker is optional (the answer ran out of tokens)
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
]


@pytest.mark.parametrize(("family", "text"), MALFORMED)
def test_a_malformed_call_is_dropped_never_sent_as_its_markup(family: str, text: str) -> None:
    """Nothing made up, and no markup in the text (an agent could not act on it): the
    text around the call as it was, the call dropped, one failure counted."""
    f = family_named(family)
    start = text.index(f.start)
    end = text.find(f.end, start) if f.end else -1
    outside = text[:start] + (text[end + len(f.end):] if end != -1 else "")
    for pieces in cuts(text):
        sent, calls, splitter = run(f, pieces)
        assert (sent, calls, splitter.failures) == (outside, [], 1), pieces


def test_a_malformed_call_beside_a_good_one() -> None:
    """Each call stands alone: the good one parses, the bad one is dropped."""
    bad = '<tool_call>\n{"name": "get_time", "arguments": \n</tool_call>'
    good = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    sent, calls, splitter = run(family_named("json_tools"), ["Ok. " + bad + "\n" + good])
    assert sent == "Ok. " and calls == [{"name": "get_time",
                                        "arguments": {"timezone": "UTC"}}]
    assert (splitter.made, splitter.failures) == (1, 1)


GOOD = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "get_time", "arguments": }\n</tool_call>'
OTHER = GOOD.replace("UTC", "CET")  # another call (the same one again ends the answer)


@pytest.mark.parametrize(("text", "want", "calls"), [
    (GOOD + "\n" + OTHER + "\n\n", "", 2),  # the syntax's newlines are no content
    (GOOD + "\n \nDone.", "\n \nDone.", 1),  # blanks before text are the text's
    ("Hi\n" + GOOD, "Hi\n", 1),  # blanks before a first call are text
    (GOOD + "\n" + BAD, "", 1),  # a call dropped drops the blanks before it
    (GOOD + "\n" + GOOD[:30], "", 1),  # so does an unclosed one
    (BAD + "\nDone.", "\nDone.", 0),  # blanks before text are the text's
])
def test_blanks_between_calls(text: str, want: str, calls: int) -> None:
    for pieces in cuts(text):
        sent, got, _ = run(family_named("json_tools"), pieces)
        assert (sent, len(got)) == (want, calls), pieces


def resumed(head: str, sent: str) -> ToolSplitter:
    splitter = ToolSplitter(family_named("json_tools"), TOOLS, "req-1")
    splitter.resume(head, sent)
    return splitter


def test_a_continued_answer_goes_on_from_the_calls_it_has() -> None:
    """Another seat began the answer and failed: its client has the text and the calls
    it got apart; replaying the answer's text so far, this seat sends only what is new,
    numbers its calls on from there, and completes a call left open."""
    head = "Sure.\n" + GOOD + "\nDone"
    seen = "Sure.\n\nDone"  # what the seat that began it sent as text
    splitter = resumed(head, seen)
    assert (splitter.made, splitter.replayed) == (1, 1)
    assert splitter.feed(" now.") == (" now.", ())
    got = splitter.feed(OTHER)
    assert [(c.index, c.id) for c in got.calls] == [(1, call_id("req-1", 1))]
    # the client lacks text the other seat still held, or has a character still to come
    assert resumed(head, "Sure.\n").feed("!").text == "\nDone!"
    assert resumed(head, seen + " ").feed(" x").text == "x"
    # a call left open by the seat that failed
    splitter = resumed("Sure." + GOOD[:30], "Sure.")
    got = splitter.feed(GOOD[30:])
    assert got.text == "" and [c.index for c in got.calls] == [0]
    assert splitter.replayed == 0
    with pytest.raises(ValueError):
        resumed(head, "Other text")


def test_an_unclosed_call_is_parsed_where_the_end_marker_is_optional() -> None:
    """Mistral's calls run to the end of the answer; an end marker that is an EOS token
    never shows in the text, so a call ending the answer is complete."""
    text, want = recording("mistral_json")
    assert run(family_named("mistral"), [text])[:2] == (want["text"], want["calls"])
    eos_end = family_named("json_tools", end_is_eos=True)
    sent, calls, _ = run(eos_end, ['<tool_call>{"name": "get_time", "arguments": {}}'])
    assert (sent, calls) == ("", [{"name": "get_time", "arguments": {}}])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    """The client asked for one call: later ones are dropped, neither calls nor text."""
    for stem in ("json_tools", "pythonic", "kimi_k2", "mistral"):
        text, want = recording(stem)
        sent, calls, splitter = run(family_named(want["family"]), [text], parallel=False)
        assert (sent, calls) == (want["text"], want["calls"][:1]), stem
        assert (splitter.made, splitter.dropped) == (1, len(want["calls"]) - 1), stem


def test_calls_of_normalises_what_the_parsers_return() -> None:
    """A dict or a list; arguments as an object or its JSON text; "parameters" as
    Llama-style JSON names them; anything else is refused."""
    names = frozenset({"f"})
    assert calls_of({"name": "f", "arguments": {"x": "é"}}, names) == [("f", '{"x": "é"}')]
    assert calls_of([{"name": "f", "arguments": '{"x": 1}'}, {"name": "f"}], names) == \
        [("f", '{"x": 1}'), ("f", "{}")]
    assert calls_of({"name": "f", "parameters": {"x": 1}}, None) == [("f", '{"x": 1}')]
    for bad in ([], "f", {"arguments": {}}, {"name": "g", "arguments": {}},
                {"name": "f", "arguments": "not json"}, {"name": "f", "arguments": 3}):
        with pytest.raises(ValueError):
            calls_of(bad, names)


def test_call_ids_are_deterministic_and_distinct() -> None:
    """The same request and index give the same id; ids are call_ and 24 hex digits."""
    assert call_id("a", 0) == call_id("a", 0)
    ids = {call_id(r, i) for r in ("a", "b") for i in range(3)}
    assert len(ids) == 6
    assert all(i.startswith("call_") and len(i) == 29 and int(i[5:], 16) >= 0 for i in ids)


@pytest.mark.parametrize(("tools", "choice", "active"), [
    (TOOLS, None, True),
    (TOOLS, "auto", True),
    (TOOLS, "required", True),
    (TOOLS, "function:get_time", True),
    (TOOLS, "none", False),
    ([], None, False),
    (None, None, False),
])
def test_the_splitter_runs_only_for_requests_with_tools(tools: list[Any] | None,
                                                        choice: str | None,
                                                        active: bool) -> None:
    tools_json = None if tools is None else json.dumps(tools)
    got = splitter_for(family_named("json_tools"), tools_json, choice, "r", True)
    assert (got is not None) == active


def test_a_seat_without_a_parser_uses_sanctums_own_syntax() -> None:
    """The demo models' ChatML template knows no tools: json_tools, end marker required."""
    family = seat_family(load_tokenizer(resolve_model("builtin:demo")))
    assert (family.name, family.start, family.end, family.end_optional) == \
        ("json_tools", "<tool_call>", "</tool_call>", False)


def test_a_seat_with_a_parser_uses_its_family() -> None:
    """A tokenizer whose template renders tools, with mlx-lm's parser for its family
    (as mlx-lm's loader sets it up): that family; an end marker that is one EOS token
    makes it optional."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import qwen3_coder

    demo = load_tokenizer(resolve_model("builtin:demo"))
    hf = demo._tokenizer
    hf.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"
    eos = hf.convert_ids_to_tokens(sorted(demo.eos_token_ids)[0])
    for end, optional in (("</tool_call>", False), (eos, True)):
        wrapped = TokenizerWrapper(hf, eos_token_ids=demo.eos_token_ids,
                                   tool_parser=qwen3_coder.parse_tool_call,
                                   tool_call_start="<tool_call>", tool_call_end=end)
        family = seat_family(wrapped)
        assert (family.start, family.end, family.end_optional) == ("<tool_call>", end, optional)
        assert family.parse is qwen3_coder.parse_tool_call


@pytest.mark.parametrize(("finish", "calls", "want"), [
    ("stop", 1, "tool_calls"),
    ("stop", 0, "stop"),
    ("length", 2, "length"),  # cut short: the client must not take it as complete
    ("length", 0, "length"),
])
def test_finish_reason(finish: str, calls: int, want: str) -> None:
    assert tool_finish(finish, calls) == want


# -- through the seat worker (in process: its socket replaced by a recorder) ----------

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
# Characters the call's text does not hold, one of which the demo's Python soon writes.
STOPS = (*(c for c in "()[]=#.;+-*'0123456789\t" if c not in CALL), "def")


def answer(state: Path, requests: list[protocol.Generate]
           ) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Each request's frames from a real seat worker (the demo model), one request at a
    time, and the seat's counters after them."""
    worker = demo_worker(state)
    out: dict[str, list[Any]] = {}

    async def scenario() -> None:
        async with serving(worker) as served:
            served.prepare()
            for request in requests:
                sock = Recorder()
                worker.sock = sock
                worker.handle(b"peer", request)
                await sock.finals(1)
                out[request.request_id] = sock.frames

    drive(worker, scenario())
    return out, worker.counters.snapshot()


def chunks(frames: list[Any]) -> list[protocol.Chunk]:
    return [f for f in frames if isinstance(f, protocol.Chunk)]


def sent(frames: list[Any]) -> str:
    return "".join(c.text for c in chunks(frames))


REQUIRED = protocol.SamplingParams(temperature=0.7, seed=7, max_tokens=64)


@pytest.fixture(scope="module")
def seat(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """One worker's answers to the requests the tests below read."""
    tok = load_tokenizer(resolve_model("builtin:demo"))
    ids = tuple(tok.encode(CALL, add_special_tokens=False))
    params = protocol.SamplingParams(temperature=0.0, max_tokens=len(ids) + 64, stop=STOPS)
    assert not any(stop in "\nOK" for stop in STOPS)
    messages = (protocol.ChatMessage("user", "What time is it in UTC?"),)
    both, one = json.dumps(TOOLS), json.dumps(TOOLS[1:])  # one: a shorter prompt

    after = tuple(tok.encode(CALL + "\nOK", add_special_tokens=False))

    def continued(rid: str, **kw: Any) -> protocol.Generate:
        return protocol.Generate(rid, True, params, messages=messages,
                                 **{"prefix": "", "prefix_ids": ids, **kw})

    def fresh(rid: str, tools: str, **kw: Any) -> protocol.Generate:
        return protocol.Generate(rid, False, REQUIRED, messages=messages, tools_json=tools,
                                 **kw)

    return answer(tmp_path_factory.mktemp("state"), [
        continued("t1", tools_json=one),
        continued("t2", tools_json=one, tool_choice="none"),
        continued("t3"),
        continued("c2", tools_json=one, prefix_ids=after),  # the client lacks "\nOK"
        fresh("r1", both, tool_choice="required", parallel_tool_calls=False),
        fresh("r2", one, tool_choice="function:get_time", parallel_tool_calls=False),
        fresh("r3", one, tool_choice="function:rm_rf"),
    ])


def test_the_worker_continues_an_answer_after_its_call(seat: Any) -> None:
    """The seat that began the answer sent a call (and, for c2, text the client still
    lacks) and failed: this seat sends only what is new, no call again, and the answer's
    finish_reason still says tool_calls.  With tool_choice none the same tokens are text
    (the same prompt lists the tools, so the same answer follows)."""
    frames, _ = seat
    for rid, lacks in (("t1", ""), ("c2", "\nOK")):
        final = frames[rid][-1]
        assert isinstance(final, protocol.Final) and isinstance(final.outcome, protocol.Ok)
        assert final.finish_reason == "tool_calls"
        assert not any(c.tool_calls for c in chunks(frames[rid]))
        assert sent(frames[rid]).startswith(lacks) and "tool_call" not in sent(frames[rid])
    assert (sent(frames["t2"]), frames["t2"][-1].finish_reason) == \
        (CALL + sent(frames["t1"]), "stop")
    assert sent(frames["t3"]).startswith(CALL)
    assert frames["t3"][-1].finish_reason != "tool_calls"
    for rid in ("t2", "t3"):
        assert not any(c.tool_calls for c in chunks(frames[rid]))


def test_a_forced_call_is_constrained_and_parsed(seat: Any) -> None:
    """tool_choice required or a named function: the seat's grammar makes the demo model,
    which never learned a tool syntax, write one call that parses; no text around it."""
    frames, _ = seat
    for rid, names in (("r1", {"get_weather", "get_time"}), ("r2", {"get_time"})):
        final = frames[rid][-1]
        assert isinstance(final.outcome, protocol.Ok), final
        calls = [c for ch in chunks(frames[rid]) for c in ch.tool_calls]
        assert final.finish_reason == "tool_calls", (rid, sent(frames[rid]), calls)
        assert len(calls) == 1 and calls[0].name in names and sent(frames[rid]) == ""
        assert isinstance(json.loads(calls[0].arguments), dict)


def test_a_grammar_refusal_is_a_400_naming_its_parameter(seat: Any) -> None:
    frames, _ = seat
    final = frames["r3"][-1]
    assert isinstance(final.outcome, protocol.Rejected)
    assert (final.outcome.status, final.outcome.code, final.outcome.extra) == \
        (400, "invalid_value", {"param": "tool_choice"})


def test_the_seat_counts_calls_and_constrained_requests(seat: Any) -> None:
    _, counters = seat
    # the calls of continued answers were their first seat's
    assert (counters["tool_calls"], counters["tool_parse_failures"]) == (2, 0)
    assert counters["constrained"] == 2


def cut_run(family: str, text: str, forced: str | None = None, tools: list[Any] | None = TOOLS,
            parallel: bool = True) -> tuple[str, list[tuple[str, str]], ToolSplitter]:
    """Feed `text` and close as an answer the budget cut: (the text sent, each call's name
    and raw arguments)."""
    splitter = ToolSplitter(family_named(family), tools, "req-1", parallel, forced)
    first = splitter.feed(text)
    last = splitter.close(cut=True)
    calls = [*first.calls, *last.calls]
    return first.text + last.text, [(c.name, c.arguments) for c in calls], splitter


@pytest.mark.parametrize(("family", "text", "forced", "want"), [
    # cut inside the arguments: the name it wrote, the arguments so far
    ("json_tools", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     None, ("Sure.", [("get_weather", '{"city": "Par')])),
    # cut before the arguments began: the forced function, no arguments yet
    ("json_tools", '<tool_call>\n{"name": "get_', "get_time", ("", [("get_time", "")])),
    # Mistral's syntax: its arguments marker
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', None,
     ("", [("get_weather", '{"city": "Par')])),
    # qwen3's XML: the name from the text, arguments in a syntax of its own (none so far)
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None,
     ("", [("get_weather", "")])),
    # a good call, then one cut: both, in order
    ("json_tools", '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n'
                   '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"ci',
     None, ("", [("get_time", '{"timezone": "UTC"}'), ("get_weather", '{"ci')])),
])
def test_a_call_the_budget_cut_is_a_cut_call_not_text(
        family: str, text: str, forced: str | None, want: tuple[str, list[Any]]) -> None:
    """Never the call's markup as text: its name and the arguments generated so far."""
    sent, calls, splitter = cut_run(family, text, forced)
    assert (sent, calls) == want
    assert splitter.failures == 0


def test_a_cut_call_with_no_name_to_give_is_dropped_and_counted() -> None:
    """Several tools, none named yet, none forced: nothing to call, and no markup sent."""
    sent, calls, splitter = cut_run("json_tools", 'Hm.<tool_call>\n{"na')
    assert (sent, calls, splitter.failures) == ("Hm.", [], 1)
    # a name begun that only one tool has: that tool; one that two share: nothing
    sent, calls, _ = cut_run("json_tools", '<tool_call>\n{"name": "get_we')
    assert calls == [("get_weather", "")]
    sent, calls, _ = cut_run("json_tools", '<tool_call>\n{"name": "get_')
    assert (sent, calls) == ("", [])
    # one tool only: it is the call
    sent, calls, _ = cut_run("json_tools", '<tool_call>\n{"na', tools=TOOLS[:1])
    assert calls == [(TOOLS[0]["function"]["name"], "")]


def test_an_answer_not_cut_drops_an_unclosed_call() -> None:
    """Ended by itself (not the budget): an unclosed call in a family whose end marker is
    required is no call, and is dropped, never its markup sent; one failure counted."""
    splitter = ToolSplitter(family_named("json_tools"), TOOLS, "req-1")
    text = 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}'
    got = [splitter.feed(text), splitter.close()]
    assert "".join(g.text for g in got) == "Sure." and splitter.failures == 1


def test_the_forced_function_reaches_the_splitter() -> None:
    tools = json.dumps(TOOLS)
    named = splitter_for(family_named("json_tools"), tools, "function:get_time", "r", True)
    assert named is not None and named.forced == "get_time"
    required = splitter_for(family_named("json_tools"), tools, "required", "r", True)
    assert required is not None and required.forced is None


def test_a_call_made_again_is_never_sent_and_ends_the_answer() -> None:
    """The same name and arguments a second time: dropped, the splitter says the answer
    is complete (`repeated`), and nothing after it goes out; a call with other
    arguments is a new call."""
    splitter = ToolSplitter(family_named("json_tools"), TOOLS, "req-1")
    utc = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
    cet = utc.replace("UTC", "CET")
    got = [splitter.feed(utc), splitter.feed(cet), splitter.feed(utc), splitter.feed("more"),
           splitter.close()]
    calls = [(c.name, json.loads(c.arguments)) for g in got for c in g.calls]
    assert calls == [("get_time", {"timezone": "UTC"}), ("get_time", {"timezone": "CET"})]
    assert splitter.repeated and "".join(g.text for g in got) == ""
    assert splitter.made == 2
