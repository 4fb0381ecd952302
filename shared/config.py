"""The TOML config, decoded into frozen msgspec Structs and validated.

An unknown key or a bad value is a `ConfigError` whose message names the key
(msgspec reports the path, e.g. ``$.seat[0].kv``).  The one settings object
built here is passed down explicitly; nothing reads the TOML twice.

A hosted seat's `upstream_fields` lists the sampling fields beyond OpenAI's own that
its upstream takes (vLLM and SGLang take all three by these names): "top_k", "min_p",
"repetition_penalty".  A request that sets one of them off its neutral value is
forwarded to such a rung with it, and skipped by a rung that does not list it
(`skipped:unsupported_field`): a rung never answers without a field it was given.
Unset: none (OpenAI's own API takes none of them).  The OpenAI fields (tools,
tool_choice, parallel_tool_calls, response_format, presence_penalty,
frequency_penalty, seed, logprobs) are always forwarded; logit_bias never is (its
token ids are the route's local tokenizer's), so a hosted rung always skips it.
The rules are `proxyd.ladder.unsupported`'s.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec

from shared import protocol
from shared.endpoints import EndpointError, parse_endpoint

DEFAULT_CONFIG_NAME = "default_config.toml"

Positive = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
# The sampling fields beyond OpenAI's own that a hosted upstream may take.
UpstreamField = Literal["top_k", "min_p", "repetition_penalty"]
SeatName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]


class ConfigError(ValueError):
    """The config cannot be used; the message names the offending key."""


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    listen: str = "127.0.0.1:8800"
    tokenizer_margin: Annotated[int, msgspec.Meta(ge=0)] = 64
    # Client keys (proxyd/auth.py): comma-separated in the variable api_keys_env
    # names, and/or one per line in api_keys_file (with optional route allow-lists
    # and request rates).  Neither set: no authentication.  Never in this file.
    api_keys_env: str | None = None
    api_keys_file: str | None = None
    # Origins whose browser pages may call the port (proxyd/cors.py), as
    # "scheme://host[:port]"; "*" for any.  Empty: no CORS header at all.
    cors_origins: tuple[str, ...] = ()
    # A request whose every ready-able rung is still loading waits this long for one
    # to be ready, then gets 503 `loading` with Retry-After; 0 = answer at once.
    load_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    # Input limits of the HTTP doors: bigger is refused with 400 or 413 naming the field.
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    max_messages: PositiveInt = 1024
    max_content_chars: PositiveInt = 1024 * 1024   # one message's text, or one prompt
    # Each within what a seat accepts on the wire (shared/protocol.py), so the proxy
    # never passes on a request that a seat would refuse as a bad frame.
    max_completion_tokens: Annotated[int, msgspec.Meta(gt=0, le=protocol.MAX_NEW_TOKENS)] = 65536
    max_stop: Annotated[int, msgspec.Meta(gt=0, le=protocol.MAX_STOPS)] = 16
    max_stop_chars: Annotated[int, msgspec.Meta(gt=0, le=protocol.MAX_STOP_CHARS)] = 256
    max_tools: PositiveInt = 128
    max_schema_bytes: PositiveInt = 64 * 1024      # one tool's parameters, or a schema
    # Hosted rungs are counted by an upper-bound estimate, so they hold back more.
    hosted_margin: Annotated[int, msgspec.Meta(ge=0)] = 1024
    # Seconds between the proxy's pings to each seat; a seat silent for
    # `liveness` intervals is lost.
    heartbeat_s: Positive = 1.0
    liveness: PositiveInt = 3
    # A begun stream with nothing to send for this long (a tool call held until it
    # parses, a stall within its budget) gets its door's keep-alive (an SSE comment;
    # Anthropic's `ping` event), so that clients and proxies between never take the
    # quiet for a dead connection.
    keepalive_s: Positive = 10.0
    # A rung's circuit opens after this many real failures in a row and admits one
    # probe (one try) after the cool-down; each failed probe doubles the cool-down, up
    # to breaker_cooldown_max_s, and a probe that succeeds closes the circuit.
    breaker_threshold: PositiveInt = 3
    breaker_cooldown_s: Positive = 1.0
    breaker_cooldown_max_s: Positive = 30.0
    # This proxy's own CURVE key pair (its secret certificate, `sanctum keys`), shown to
    # seats marked `remote`; their seatd's machine lists its public half in the seat's
    # curve_clients.  Local seats are reached with their own key pair instead.
    curve_cert: str | None = None


# An on-demand seat's idle seconds before it sleeps, unless it sets its own.
KEEP_ALIVE_S = 300.0
# seatd's memory budget when the config sets none: this share of physical memory.
MEMORY_SHARE = 0.75


class SeatdConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Where sockets, counters and pid files live.  Empty: the platform default.
    state_dir: str = ""
    heartbeat_s: Positive = 1.0
    liveness: PositiveInt = 3
    drain_s: Positive = 20.0
    # Crash budget before a seat goes FATAL, and the back-off between restarts.
    max_crashes: PositiveInt = 5
    crash_window_s: Positive = 60.0
    backoff_initial_s: Positive = 0.5
    backoff_max_s: Positive = 30.0
    # A FATAL seat is retried after this long; unset = it waits for `sanctum restart`.
    fatal_cooldown_s: Positive | None = None
    # What loaded seats may hold together (seatd/room.py): an on-demand seat is loaded
    # only where its estimated size fits beside the others, the least recently used
    # idle on-demand seat put to sleep to make room.  0 = MEMORY_SHARE of physical
    # memory.  max_loaded: at most this many seats loaded at once; 0 = no count limit.
    memory_budget_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_loaded: Annotated[int, msgspec.Meta(ge=0)] = 0


class DrafterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: Literal["model", "lookup"]
    path: str | None = None


class SeatConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: SeatName
    kind: Literal["mlx", "openai"] = "mlx"
    # local (mlx) seats
    model: str | None = None
    drafter: DrafterConfig | None = None
    kv: Literal["fp16", "q8"] = "fp16"
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    speculation: bool = True
    # Draft tokens per speculative round; unset = chosen per request from measured
    # acceptance and round cost (seatd/adaptive.py).
    draft_depth: Annotated[int, msgspec.Meta(ge=0, le=16)] | None = None
    # None: 65,536 where the model's context allows it (shared/caps.py).
    max_prompt_tokens: PositiveInt | None = None
    # The proxy's own cap for this seat; by default the seat's cap less the margin.
    proxy_max_prompt_tokens: PositiveInt | None = None
    memory_budget_mb: PositiveInt | None = None
    # A model or tokenizer folder that names code of its own (config.json's
    # `model_file` or `auto_map`, tokenizer_config.json's `auto_map`) is refused
    # unless this is true: that code would run in the worker.
    trust_remote_code: bool = False
    # local (mlx) seats: where the worker listens (shared/endpoints.py).  Unset: an ipc
    # socket in the state directory.  "tcp://HOST:PORT": the worker binds there on the
    # machine whose seatd runs it and the proxy connects there; a host other than
    # loopback needs CURVE keys (curve_cert).  The same string on both machines.
    endpoint: str | None = None
    # The proxy's side of a seat that seatd runs on another machine: this machine's
    # seatd neither spawns nor watches it; proxyd connects to `endpoint` and heartbeats.
    remote: bool = False
    # CURVE (shared/curve.py), files made by `sanctum keys`.  The seat's certificate:
    # where seatd runs the seat, its secret one (NAME.key_secret, mode 0600); on the
    # proxy's machine of a remote seat, its public one (NAME.key).  curve_clients, where
    # seatd runs the seat: a folder of the public certificates of the clients allowed
    # in besides the seat's own key pair (which its seatd and a proxyd on that machine
    # use), i.e. the remote proxies' proxy.curve_cert halves.
    curve_cert: str | None = None
    curve_clients: str | None = None
    # both kinds; unset = the kind's default (`first_token_s`, `stall_s`).  A local
    # seat's first-token clock starts when it takes the request off its queue (before
    # that, queue_timeout_s applies); a hosted rung's when the request is sent, so a
    # silent provider is left within 10 s.
    first_token_timeout_s: Positive | None = None
    stall_timeout_s: Positive | None = None
    # hosted (openai) seats
    base_url: str | None = None
    api_key_env: str | None = None
    upstream_model: str | None = None
    offbox: bool = False
    # hosted (openai) seats: the non-OpenAI sampling fields the upstream takes (above).
    upstream_fields: tuple[UpstreamField, ...] = ()
    # hosted (openai) seats: whether the upstream takes an assistant prefill (a chat
    # ending with an assistant turn to go on from).  false: a begun answer is continued
    # here by asking afresh and sending on only what extends the text already sent
    # (proxyd/replay.py).  An upstream that answers a prefill with a 400 is remembered
    # as false until the proxy restarts.
    prefill: bool = True
    # hosted (openai) seats: timeouts and retries of one request (proxyd/hosted.py).
    # A request gets total_timeout_s on this rung, retries and pauses included;
    # transient faults (reset before any byte, 429, 500, 502, 503, 504) are tried
    # up to max_attempts times with jittered back-off; a longer Retry-After than
    # retry_after_max_s moves to the next rung at once.
    connect_timeout_s: Positive = 10.0
    total_timeout_s: Positive = 600.0
    max_attempts: PositiveInt = 3
    backoff_initial_s: Positive = 0.5
    backoff_max_s: Positive = 8.0
    retry_after_max_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    # local (mlx) seats: the prompt cache (seatd/prompt_cache.py).  Megabytes of KV
    # kept for prompt prefixes, within kv_budget_mb; 0 = off.
    prompt_cache_mb: Annotated[int, msgspec.Meta(ge=0)] = 512
    # local (mlx) seats: requests decoded together, each a row of one batched forward
    # (seatd/batch.py), at most max_batch of them and only while their KV fits in
    # kv_budget_mb with the prompt cache's entries (seatd/kv_budget.py).  A request
    # alone is always taken.
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    kv_budget_mb: PositiveInt = 2048
    # local (mlx) seats: requests waiting for a row in the batch; one more is
    # refused at once (the proxy tries the next rung, or answers 503 with Retry-After).
    max_queued: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    # local (mlx) seats: how long a request may wait in that queue; then it is taken
    # back and, like a full queue, counts as busy, never as the seat failing.
    queue_timeout_s: Positive = 120.0
    # local (mlx) seats: "always" loads at start and stays; "on_demand" loads on its
    # first request and sleeps (no worker process) after keep_alive_s idle seconds:
    # unset = KEEP_ALIVE_S, 0 = after each answer, -1 = never.  A request may set its
    # own (`"sanctum": {"keep_alive": S}`).
    load: Literal["always", "on_demand"] = "always"
    keep_alive_s: Annotated[float, msgspec.Meta(ge=-1)] | None = None

    @property
    def on_demand(self) -> bool:
        return self.kind == "mlx" and self.load == "on_demand"

    @property
    def keep_alive(self) -> float:
        """Idle seconds before this on-demand seat sleeps (-1: never)."""
        return KEEP_ALIVE_S if self.keep_alive_s is None else self.keep_alive_s


    @property
    def first_token_s(self) -> float:
        """The first-token budget: as configured, else the kind's default."""
        if self.first_token_timeout_s is not None:
            return self.first_token_timeout_s
        return FIRST_TOKEN_S[self.kind]

    @property
    def stall_s(self) -> float:
        """The longest gap between two pieces of text: as configured, else the kind's."""
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return STALL_S[self.kind]


# Defaults by seat kind.  A local seat may prefill a long prompt before its first token
# (65,536 tokens take minutes on a small Mac); a hosted provider that sends nothing for
# 10 s is failed over (so a fallback's answer still lands inside a client's common 15 s
# budget), as is one whose stream stops for 15 s.
FIRST_TOKEN_S: dict[str, float] = {"mlx": 120.0, "openai": 10.0}
STALL_S: dict[str, float] = {"mlx": 30.0, "openai": 15.0}


class RouteConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    ladder: Annotated[list[str], msgspec.Meta(min_length=1)]
    offbox: Literal["deny", "allow", "header"] = "deny"
    # The config claims every local rung shares one tokenizer; `sanctum check` verifies.
    same_tokenizer: bool = False


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seat: Annotated[list[SeatConfig], msgspec.Meta(min_length=1)]
    route: Annotated[list[RouteConfig], msgspec.Meta(min_length=1)]
    proxy: ProxyConfig = ProxyConfig()
    seatd: SeatdConfig = SeatdConfig()
    # Where the file came from, to resolve relative model paths.  Not a TOML key.
    base_dir: str = ""

    def seat_by_name(self, name: str) -> SeatConfig:
        for seat in self.seat:
            if seat.name == name:
                return seat
        raise KeyError(name)

    @property
    def local_seats(self) -> list[SeatConfig]:
        return [s for s in self.seat if s.kind == "mlx"]

    @property
    def supervised_seats(self) -> list[SeatConfig]:
        """The local seats this machine's seatd runs (not those marked remote)."""
        return [s for s in self.local_seats if not s.remote]


def _check(config: Config) -> None:
    """What the schema cannot say: names unique, each seat's keys fit its kind, routes
    name seats, the proxy's address parses.  The first problem found is raised."""
    names = [s.name for s in config.seat]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"seat[{i}].name: duplicate seat name {name!r}")
    for i, seat in enumerate(config.seat):
        where = f"seat[{i}] ({seat.name})"
        if seat.kind == "mlx":
            _check_local(seat, where)
        else:
            _check_hosted(seat, where)
        _check_endpoint(config, seat, where)
        if seat.drafter is not None and seat.drafter.kind == "model" and not seat.drafter.path:
            raise ConfigError(f"{where}.drafter.path: a model drafter needs a path")
    bound: dict[str, str] = {}
    for seat in config.seat:
        if seat.endpoint is not None:
            if seat.endpoint in bound:
                raise ConfigError(f"seat {seat.name}.endpoint: {seat.endpoint} is seat "
                                  f"{bound[seat.endpoint]}'s already")
            bound[seat.endpoint] = seat.name
    _check_routes(config, names)
    host, _, port = config.proxy.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"proxy.listen: expected HOST:PORT, got {config.proxy.listen!r}")
    for i, origin in enumerate(config.proxy.cors_origins):
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ConfigError(f"proxy.cors_origins[{i}]: an origin is scheme://host[:port] "
                              f"with no path, or \"*\"; got {origin!r}")


_ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+")


def _check_local(seat: SeatConfig, where: str) -> None:
    """A local (mlx) seat: a model, and none of a hosted seat's keys."""
    if not seat.model:
        raise ConfigError(f"{where}.model: a local seat needs a model")
    if seat.offbox:
        raise ConfigError(f"{where}.offbox: a local (mlx) seat is on the box")
    for key in ("base_url", "api_key_env", "upstream_model"):
        if getattr(seat, key) is not None:
            raise ConfigError(f"{where}.{key}: only for kind = \"openai\"")
    if seat.keep_alive_s is not None and seat.load != "on_demand":
        raise ConfigError(f"{where}.keep_alive_s: only for load = \"on_demand\" (an "
                          "always-loaded seat never sleeps)")
    if seat.keep_alive_s is not None and -1 < seat.keep_alive_s < 0:
        raise ConfigError(f"{where}.keep_alive_s: seconds >= 0, or -1 for never")
    if seat.on_demand and seat.remote:
        raise ConfigError(f"{where}.load: a remote seat's own seatd loads it; "
                          "on_demand is set there")
    if seat.upstream_fields:
        raise ConfigError(f"{where}.upstream_fields: only for kind = \"openai\" "
                          "(a local seat honours every field)")
    if not seat.prefill:
        raise ConfigError(f"{where}.prefill: only for kind = \"openai\" (a local seat "
                          "continues an answer from its exact tokens)")


def _check_hosted(seat: SeatConfig, where: str) -> None:
    """A hosted seat: an http(s) base_url, and none of a local seat's keys."""
    if not seat.base_url:
        raise ConfigError(f"{where}.base_url: a hosted seat needs base_url")
    if not _http_url(seat.base_url):
        raise ConfigError(f"{where}.base_url: an http:// or https:// URL with a host, "
                          f"not {seat.base_url!r}")
    if seat.model is not None or seat.drafter is not None:
        raise ConfigError(f"{where}.model: a hosted seat uses upstream_model")
    for key in ("endpoint", "curve_cert", "curve_clients"):
        if getattr(seat, key) is not None:
            raise ConfigError(f"{where}.{key}: only for local (mlx) seats")
    if seat.remote:
        raise ConfigError(f"{where}.remote: only for local (mlx) seats")
    if seat.load != "always" or seat.keep_alive_s is not None:
        raise ConfigError(f"{where}.load: only local (mlx) seats load and sleep")


def _check_routes(config: Config, names: list[str]) -> None:
    routes = [r.model for r in config.route]
    for i, route in enumerate(config.route):
        if route.model in routes[:i]:
            raise ConfigError(f"route[{i}].model: duplicate route {route.model!r}")
        for rung in route.ladder:
            if rung not in names:
                raise ConfigError(f"route[{i}].ladder: unknown seat {rung!r}")


def _http_url(text: str) -> bool:
    """An http(s) URL with a host name that can go on the wire (IDNA) and a numeric port."""
    url = urlsplit(text)
    try:
        port = url.port  # raises for a port that is not a number in range
        (url.hostname or "").encode("idna")
    except (UnicodeError, ValueError):
        return False
    return url.scheme in ("http", "https") and bool(url.hostname) and port != 0


def _check_endpoint(config: Config, seat: SeatConfig, where: str) -> None:
    """Endpoint and CURVE keys of one seat: the rules that need no file (the files
    themselves are `sanctum check`'s, shared/capcheck.py)."""
    if seat.endpoint is None:
        if seat.remote:
            raise ConfigError(f"{where}.endpoint: a remote seat needs its tcp:// endpoint")
        for key in ("curve_cert", "curve_clients"):
            if getattr(seat, key) is not None:
                raise ConfigError(f"{where}.{key}: CURVE keys are for a tcp:// endpoint")
        return
    try:
        loopback = parse_endpoint(seat.endpoint).loopback
    except EndpointError as exc:
        raise ConfigError(f"{where}.endpoint: {exc}") from None
    if not loopback and seat.curve_cert is None:
        raise ConfigError(
            f"{where}.endpoint: {seat.endpoint} is not a loopback address, so it needs "
            "CURVE keys: set curve_cert (and, where seatd runs the seat, curve_clients); "
            "`sanctum keys DIR` makes them")
    if seat.remote and seat.curve_clients is not None:
        raise ConfigError(f"{where}.curve_clients: the allowed clients are listed where "
                          "seatd runs the seat, not on the proxy's side of a remote seat")
    if seat.remote and seat.curve_cert is not None and config.proxy.curve_cert is None:
        raise ConfigError(f"{where}.curve_cert: a remote seat with CURVE keys needs "
                          "proxy.curve_cert, this proxy's own key pair")
    if seat.curve_clients is not None and seat.curve_cert is None:
        raise ConfigError(f"{where}.curve_clients: needs curve_cert, the seat's own key pair")


def parse_config(text: str, base_dir: str = "") -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}") from None
    if "base_dir" in raw:
        raise ConfigError("Object contains unknown field `base_dir` - at `$`")
    raw["base_dir"] = base_dir
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    _check(config)
    return config


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Load `path`, or the packaged default config when `path` is None."""
    if path is None:
        text = resources.files("shared").joinpath(DEFAULT_CONFIG_NAME).read_text()
        return parse_config(text)
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    return parse_config(text, base_dir=str(p.resolve().parent))


def with_port(config: Config, port: int) -> Config:
    host = config.proxy.listen.rpartition(":")[0]
    proxy = msgspec.structs.replace(config.proxy, listen=f"{host}:{port}")
    return msgspec.structs.replace(config, proxy=proxy)


def listen_address(config: Config) -> tuple[str, int]:
    host, _, port = config.proxy.listen.rpartition(":")
    return host.strip("[]"), int(port)


def state_dir(config: Config, home: str | None = None) -> Path:
    """Sockets, counters and pid files.  `SANCTUM_STATE_DIR` overrides the config.
    `home`: another account's home, for `~` (the service account's, at install)."""

    def expand(path: str) -> Path:
        if home is not None and (path == "~" or path.startswith("~/")):
            return Path(home + path[1:])
        return Path(path).expanduser()

    chosen = os.environ.get("SANCTUM_STATE_DIR") or config.seatd.state_dir
    if chosen:
        return expand(chosen)
    if sys.platform == "darwin":
        return expand("~/Library/Application Support/Sanctum")
    runtime = os.environ.get("XDG_STATE_HOME") if home is None else None
    base = Path(runtime) if runtime else expand("~/.local/state")
    return base / "sanctum"


def worker_endpoint(config: Config, seat: str) -> str:
    """The seat's `endpoint` when it names one, else its ipc socket in the state dir."""
    chosen = next((s.endpoint for s in config.seat if s.name == seat), None)
    if chosen is not None:
        return chosen
    return f"ipc://{state_dir(config) / f'seat-{seat}.sock'}"


def control_endpoint(config: Config) -> str:
    return f"ipc://{state_dir(config) / 'seatd.sock'}"


def unlink_endpoint(endpoint: str) -> None:
    """ZeroMQ leaves ipc socket files behind; the binder removes its own on exit."""
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://") :])
        except FileNotFoundError:
            pass


def resolve_path(config: Config, spec: str) -> str:
    """A model spec relative to the config file's folder; builtin: specs unchanged."""
    if spec.startswith("builtin:"):
        return spec
    p = Path(spec).expanduser()
    if not p.is_absolute() and config.base_dir:
        p = Path(config.base_dir) / p
    return str(p)
