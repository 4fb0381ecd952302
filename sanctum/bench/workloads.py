"""Benchmark workloads, taken from demo-corpus files held out from training.

Source, in order: `tests/data/heldout/*.py` when the repository has them, else the
standard-library files of the running Python chosen by the demo corpus's held-out
rule (deploy/demo_models/corpus.py: `sha256(relpath)[:8] % 20 == 0`), sorted by path.

Workloads (building them is pure: files and a token counter in, prompts out):

    code-short   completion: the head of a file, ~100 tokens
    code-long    completion: consecutive files, ~3000 tokens (less if the seat cap is lower)
    doc2body     chat: a function's signature and docstring; the model writes the body
    rename       chat: a function of a few hundred tokens and "rename X to Y" (copy-heavy)
    repeat       chat: the same function and "repeat it exactly" (copy-heavy)
    template     completion: three instances of a wrapper template filled for names of
                 held-out functions, the list of the rest above them (copy-heavy)
    prose        completion: the longest docstring, as English prose
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import sysconfig
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HELDOUT_MOD = 20  # the demo corpus's rule; keep in step with deploy/demo_models/corpus.py
REPO_HELDOUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "heldout"


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    kind: str  # "completion" | "chat"
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    prompt_tokens: int = 0
    # Turns of a conversation sent, untimed, before the timed one (prompt-cache runs).
    history: tuple[tuple[str, str], ...] = field(default=())
    # Overrides the comparison's temperature (runs that sweep temperatures).
    temperature: float | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The prompt's tokens as a model gets them in-process: a chat through the
        tokenizer's chat template (its generation prompt added), a completion as it is."""
        if self.kind == "chat":
            ids = tokenizer.apply_chat_template(self.chat_messages(),
                                                add_generation_prompt=True, tokenize=True)
            return [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) else ids)]
        return [int(t) for t in tokenizer.encode(self.prompt)]

    def salted(self, k: int) -> Workload:
        """The k-th request of this workload, with a short distinct first line.

        A server with a prompt cache (mlx_lm.server has one) would otherwise serve a
        repeated prompt from its cache and time something else.  Both arms' k-th
        requests get the same salt, so a pair still compares equal prompts.
        """
        # The temperature too: the t=0 and t=0.7 copies of one workload go to the same
        # seat, and the k-th of each must not find the other's prompt in its cache.
        at = "" if self.temperature is None else f" at t={self.temperature:g}"
        salt = f"# request {k}{at}\n"
        if self.kind == "chat":
            (role, content), *rest = self.messages
            if self.history:  # the same salt, so the earlier turns stay a prefix
                (hrole, hcontent), *hrest = self.history
                return dataclasses.replace(self, messages=((role, salt + content), *rest),
                                           history=((hrole, salt + hcontent), *hrest))
            return dataclasses.replace(self, messages=((role, salt + content), *rest))
        return dataclasses.replace(self, prompt=salt + self.prompt)


def is_heldout(relpath: str) -> bool:
    digest = hashlib.sha256(relpath.encode()).hexdigest()
    return int(digest[:8], 16) % HELDOUT_MOD == 0


def heldout_files(limit: int = 40) -> tuple[str, list[tuple[str, str]]]:
    """(where they came from, [(name, text)]) for the held-out source files."""
    if REPO_HELDOUT.is_dir() and any(REPO_HELDOUT.glob("*.py")):
        paths = sorted(REPO_HELDOUT.glob("*.py"))
        return "tests/data/heldout", [(p.name, p.read_text(errors="replace")) for p in paths]
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, str]] = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or not is_heldout(rel):
            continue
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        found.append((rel, text))
        if len(found) >= limit:
            break
    return "held-out standard-library files (sha256(relpath) % 20 == 0)", found


def _head(text: str, count: Callable[[str], int], target: int) -> str:
    """Whole lines from the start of `text` until at least `target` tokens, without the
    last line break: a prompt ending in a bare newline token reads as the end of a file
    to a code model (the demo model answers it with end-of-text and nothing else)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    for line in lines:
        out.append(line)
        if len(out) % 8 == 0 and count("".join(out)) >= target:
            break
    return "".join(out).rstrip("\n")


def _functions(text: str) -> list[tuple[str, str, ast.FunctionDef]]:
    """(signature+docstring, whole function, node) for documented functions."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        if not ast.get_docstring(node) or len(node.body) < 2:
            continue
        doc = node.body[0]
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        head = textwrap.dedent("\n".join(lines[start : doc.end_lineno or doc.lineno]))
        whole = textwrap.dedent("\n".join(lines[start : node.end_lineno]))
        found.append((head.rstrip(), whole.rstrip(), node))
    return found


def _wrapper(name: str) -> str:
    """One instance of the template workload: a logged wrapper of function `name`."""
    return (f"def logged_{name}(*args, **kwargs):\n"
            f'    """Call {name}, logging its arguments and its result."""\n'
            f'    log.debug("{name} called with %r %r", args, kwargs)\n'
            f"    result = {name}(*args, **kwargs)\n"
            f'    log.debug("{name} returned %r", result)\n'
            f"    return result\n\n\n")


def _rename_target(node: ast.FunctionDef) -> str | None:
    """The function's first real parameter: renaming it touches many lines."""
    for arg in node.args.args:
        if arg.arg not in ("self", "cls") and len(arg.arg) > 2:
            return arg.arg
    return None


def build_workloads(files: Sequence[tuple[str, str]], count: Callable[[str], int],
                    max_prompt_tokens: int, long_target: int = 3000) -> list[Workload]:
    if not files:
        raise ValueError("no held-out files to build workloads from")
    out: list[Workload] = []
    name0, text0 = files[0]
    short = _head(text0, count, 100)
    out.append(Workload("code-short", f"complete the head of {name0}", "completion",
                        prompt=short, prompt_tokens=count(short)))

    target = min(long_target, max_prompt_tokens - 64)
    joined = "\n\n".join(t for _, t in files)
    long = _head(joined, count, target)
    while count(long) > target:  # the 8-line stride may overshoot a small cap
        long = long[: int(len(long) * 0.9)]
    out.append(Workload("code-long", "complete consecutive held-out files", "completion",
                        prompt=long, prompt_tokens=count(long)))

    funcs = [(n, h, w, node) for n, t in files for h, w, node in _functions(t)]
    doc = next(((n, h) for n, h, w, _ in funcs if 40 <= count(h) <= 400), None)
    if doc is not None:
        msg = (("user", doc[1]),)
        out.append(Workload("doc2body", f"write the body of a function from {doc[0]}", "chat",
                            messages=msg, prompt_tokens=count(doc[1])))

    for n, _h, whole, node in funcs:
        old = _rename_target(node)
        if old is None or not 250 <= count(whole) <= 900 or whole.count(old) < 4:
            continue
        new = f"{old}_value"
        ask = f"Rename `{old}` to `{new}` in this function. Reply with the whole function.\n\n"
        text = ask + whole
        out.append(Workload("rename", f"rename a parameter in a function of {n}", "chat",
                            messages=(("user", text),), prompt_tokens=count(text)))
        again = f"Repeat this function exactly, then stop.\n\n{whole}"
        out.append(Workload("repeat", f"repeat a function of {n} word for word", "chat",
                            messages=(("user", again),), prompt_tokens=count(again)))
        break

    names = sorted({node.name for _, _, _, node in funcs if not node.name.startswith("_")})
    if len(names) >= 6:
        filled = "".join(_wrapper(name) for name in names[:3])
        rest = ", ".join(names[:12])
        text = (f"# Logged wrappers for: {rest}\nimport logging\n\n"
                f"log = logging.getLogger(__name__)\n\n{filled}")
        out.append(Workload("template", "fill a wrapper template for held-out function names",
                            "completion", prompt=text.rstrip("\n"),
                            prompt_tokens=count(text.rstrip("\n"))))

    docs = []
    for n, t in files:
        try:
            tree = ast.parse(t)
        except SyntaxError:
            continue
        for found in ast.walk(tree):
            if isinstance(found, ast.Module | ast.ClassDef | ast.FunctionDef):
                d = ast.get_docstring(found)
                if d:
                    docs.append((len(d), n, d))
    if docs:
        _, n, d = max(docs)
        prose = _head(d, count, 300)
        out.append(Workload("prose", f"continue the longest docstring ({n})", "completion",
                            prompt=prose, prompt_tokens=count(prose)))
    return out
