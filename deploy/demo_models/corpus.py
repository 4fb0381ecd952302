"""Collect the demo models' training corpus: Python sources found on the build machine.

Sources, in order: the CPython standard library (with its ``test`` package when the
interpreter ships it), then every ``site-packages`` directory of the running
interpreter. Files are deduplicated by content.

Held-out rule (stated once, used everywhere): a standard-library file is held out
when ``int(sha256(relpath).hexdigest()[:8], 16) % HELDOUT_MOD == 0``, where
``relpath`` is its POSIX path relative to the stdlib root (for example
``json/decoder.py``). Held-out files, and any other file with identical content, never
enter training.

Chat pairs: for functions with a docstring in training files, the signature and
docstring become the user turn and the complete function the assistant turn, in the
ChatML format of the tokenizer's chat template.
"""

from __future__ import annotations

import ast
import hashlib
import os
import site
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import Pool
from pathlib import Path

HELDOUT_MOD = 20
MAX_FILE_BYTES = 400_000
SPECIAL_STRINGS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SKIP_DIRS = {"__pycache__", ".git", "node_modules"}


def is_heldout(relpath: str) -> bool:
    """The held-out rule for standard-library files (POSIX path relative to the stdlib)."""
    digest = hashlib.sha256(relpath.encode()).hexdigest()
    return int(digest[:8], 16) % HELDOUT_MOD == 0


@dataclass
class SourceFile:
    origin: str  # "stdlib" or "site"
    relpath: str
    text: str


@dataclass
class Corpus:
    train: list[SourceFile] = field(default_factory=list)
    heldout: list[SourceFile] = field(default_factory=list)
    chat_pairs: list[tuple[str, str]] = field(default_factory=list)
    stats: dict[str, object] = field(default_factory=dict)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_roots() -> list[Path]:
    roots: list[Path] = []
    for p in [*site.getsitepackages(), site.getusersitepackages()]:
        path = Path(p)
        if path.is_dir() and path not in roots:
            roots.append(path)
    return roots


def _walk_py(root: Path, skip: set[Path]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and (here / d) not in skip)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield here / name


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip() or any(s in text for s in SPECIAL_STRINGS):
        return None
    return text


def _read_job(job: tuple[str, str, str]) -> SourceFile | None:
    origin, root, rel = job
    text = _read(Path(root) / rel)
    return None if text is None else SourceFile(origin, rel, text)


def collect(max_site_bytes: int | None = None, workers: int = 8) -> Corpus:
    """Read every stdlib and site-packages source once, split by the held-out rule."""
    std = stdlib_root()
    sites = site_roots()
    jobs: list[tuple[str, str, str]] = []
    skip = set(sites) | {std / "site-packages", std / "dist-packages"}
    for path in _walk_py(std, skip):
        jobs.append(("stdlib", str(std), path.relative_to(std).as_posix()))
    for root in sites:
        for path in _walk_py(root, set()):
            jobs.append(("site", str(root), path.relative_to(root).as_posix()))
    with Pool(workers) as pool:
        files = pool.map(_read_job, jobs, chunksize=64)
    corpus = Corpus()
    seen: dict[str, str] = {}
    heldout_hashes: set[str] = set()
    for f in files:
        if f is not None and f.origin == "stdlib" and is_heldout(f.relpath):
            corpus.heldout.append(f)
            heldout_hashes.add(hashlib.sha256(f.text.encode()).hexdigest())
    site_bytes = 0
    dup = 0
    # stdlib first, then site files in a hash order, so that a byte cap samples evenly.
    kept = [
        f for f in files if f is not None and not (f.origin == "stdlib" and is_heldout(f.relpath))
    ]
    kept.sort(key=lambda f: (f.origin != "stdlib", hashlib.sha256(f.relpath.encode()).hexdigest()))
    for f in kept:
        h = hashlib.sha256(f.text.encode()).hexdigest()
        if h in heldout_hashes or h in seen:
            dup += 1
            continue
        if f.origin == "site":
            if max_site_bytes is not None and site_bytes > max_site_bytes:
                continue
            site_bytes += len(f.text)
        seen[h] = f.relpath
        corpus.train.append(f)
    std_train = [f for f in corpus.train if f.origin == "stdlib"]
    corpus.stats = {
        "python": sys.version.split()[0],
        "stdlib_has_tests": (std / "test" / "test_grammar.py").exists(),
        "files_scanned": len(jobs),
        "train_files": len(corpus.train),
        "train_stdlib_files": len(std_train),
        "train_site_files": len(corpus.train) - len(std_train),
        "train_chars": sum(len(f.text) for f in corpus.train),
        "heldout_files": len(corpus.heldout),
        "heldout_chars": sum(len(f.text) for f in corpus.heldout),
        "duplicates_dropped": dup,
        "heldout_rule": f"sha256(stdlib relpath)[:8] as int % {HELDOUT_MOD} == 0",
        "site_packages_top": _top_packages(corpus.train),
    }
    return corpus


def _top_packages(files: list[SourceFile], n: int = 40) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for f in files:
        if f.origin == "site":
            top = f.relpath.split("/", 1)[0]
            sizes[top] = sizes.get(top, 0) + len(f.text)
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:n]
    return {k: v for k, v in ranked}


def _pairs_from_text(text: str, max_chars: int = 2400) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    pairs: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc or len(node.body) < 2 or node.end_lineno is None:
            continue
        doc_node = node.body[0]
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        head_end = doc_node.end_lineno or doc_node.lineno
        head = textwrap.dedent("\n".join(lines[start:head_end]))
        whole = textwrap.dedent("\n".join(lines[start : node.end_lineno]))
        if len(whole) > max_chars or len(whole) - len(head) < 40:
            continue
        pairs.append((head.rstrip(), whole.rstrip()))
    return pairs


def chat_pairs(
    files: list[SourceFile], workers: int = 8, limit: int = 60_000
) -> list[tuple[str, str]]:
    """(signature+docstring, complete function) pairs from training files."""
    with Pool(workers) as pool:
        per_file = pool.map(_pairs_from_text, [f.text for f in files], chunksize=32)
    out: list[tuple[str, str]] = []
    for pairs in per_file:
        out.extend(pairs)
    # Keep a deterministic, spread-out subset.
    out.sort(key=lambda p: hashlib.sha256(p[1].encode()).hexdigest())
    return out[:limit]


def chat_text(user: str, assistant: str) -> str:
    """One exchange rendered exactly as the tokenizer's chat template renders it."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"
