"""The physical bound of batched decoding: mlx-lm's bare loop of batched forwards.

A throughput figure says little alone: 1,000 tokens/s is most of what one machine can do
with one model, or a fifth of it.  The bound arm runs, in a process of its own, the loop
any server's decode is built on and nothing else: B rows of one prompt prefilled
together, then `tokens` steps of one forward of all B rows through mlx-lm's own KV
cache (`mlx_lm.models.cache.make_prompt_cache`), each step's greedy token fed to the
next (evaluated asynchronously, as mlx-lm's `generate_step` does), on the weights our
seat computes with (`seatd.model_load.load_for_compute`: the same model, the same
dtype, and the attention the seat computes exactly on this backend).  No HTTP, no
scheduling, no sampling rule, no stop check: what is left of a server's figure over
this one is its own work.

    agg_tps     B * tokens / seconds from the prefill's start to the last token, as a
                server's aggregate counts its requests' tokens over its slot's wall time
                (the B prompts go in as one batched forward: the cheapest way in)
    prefill_ms  the prefill and the first token
    step_ms     milliseconds per decode step of all B rows after it
    mlx_*_mb    what MLX held in the process after it (live arrays, freed buffers kept
                for reuse) and the most live at once during it, MiB: as a seat's
                `mlx_*_bytes` gauges, beside the device's figure for the process; then
                the freed buffers are handed back, as an idle seat's are

Served over a small HTTP endpoint so the interleaved schedule can call it like any
other arm (`BoundArm`), and stopped and proven stopped like them
(`sanctum.bench.servers`):

    python -m sanctum.bench.bound MODEL_DIR PORT
    POST /run {"batch": B, "tokens": N, "prompt": [token ids]}
        -> {"agg_tps", "prefill_ms", "step_ms"}
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from sanctum.bench.concurrent import PREFILL, mlx_figures
from seatd.memory import mlx_memory

BOUND = "bound"
REQUEST_TIMEOUT_S = 600.0


def decode_loop(model: Any, prompt: Sequence[int], batch: int, tokens: int) -> dict[str, float]:
    """One measurement: `batch` copies of `prompt` prefilled together, then batched
    decode steps up to `tokens` tokens a row (the prefill's own token the first)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([list(prompt)] * batch)
    mx.reset_peak_memory()
    started = time.perf_counter()
    logits = model(x, cache=cache)
    y = mx.argmax(logits[:, -1, :], axis=-1)  # the first token, as a server's
    mx.eval(y)
    prefilled = time.perf_counter()
    for _ in range(tokens - 1):
        logits = model(y[:, None], cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.async_eval(y)  # type: ignore[no-untyped-call]  # MLX ships it unannotated
    mx.eval(y)
    ended = time.perf_counter()
    return {"agg_tps": batch * tokens / (ended - started),
            "prefill_ms": 1e3 * (prefilled - started),
            "step_ms": 1e3 * (ended - prefilled) / max(1, tokens - 1),
            **mlx_figures(mlx_memory())}


def serve(model_dir: str, port: int) -> None:
    from pathlib import Path

    import mlx.core as mx

    from seatd.model_load import load_for_compute

    model = load_for_compute(Path(model_dir)).model

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, {"ok": True})

        def do_POST(self) -> None:
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                got = decode_loop(model, [int(t) for t in body["prompt"]],
                                  int(body["batch"]), int(body["tokens"]))
            except (ValueError, KeyError, TypeError) as exc:  # a request it cannot run
                self._send(400, {"error": repr(exc)})
                return
            except RuntimeError as exc:  # MLX failed it (out of memory, a kernel)
                self._send(500, {"error": repr(exc)})
                return
            finally:
                # Its freed buffers handed back between runs, as an idle seat's are
                # (`seatd.idle_trim`): the arms share one GPU's memory.
                mx.clear_cache()
            self._send(200, got)

        def log_message(self, *args: Any) -> None:
            pass

    # One measurement at a time, as every arm of the schedule.
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


@contextmanager
def bound_server(model_dir: str, port: int, timeout: float = 300) -> Iterator[str]:
    """The bound's process on `model_dir`; yields its base URL."""
    from sanctum.bench import servers
    from seatd.blas import worker_env

    with servers.workdir() as wd:
        proc = servers.start(BOUND, [sys.executable, "-m", "sanctum.bench.bound", model_dir,
                                     str(port)], wd, worker_env(dict(os.environ)))
        url = f"http://127.0.0.1:{port}"
        try:
            servers.wait_until(proc, lambda: bool(servers.get_json(url + "/")), timeout)
            yield url
        finally:
            proc.stop()


class BoundArm:
    """The bound at slot `c=N`: batch N, `tokens` steps, on `prompt` (token ids).  The
    PREFILL slot is not its to measure."""

    def __init__(self, url: str, prompt: Sequence[int], tokens: int) -> None:
        self.url, self.prompt, self.tokens = url, list(prompt), tokens

    def __call__(self, name: str) -> dict[str, float]:
        if name == PREFILL or not name.startswith("c="):
            return {}
        body = json.dumps({"batch": int(name.removeprefix("c=")), "tokens": self.tokens,
                           "prompt": self.prompt}).encode()
        req = urllib.request.Request(self.url + "/run", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                got = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # its reason, as the other arms give theirs
            raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from exc
        return {k: float(v) for k, v in got.items()}


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
