"""A sleeping on-demand seat woken by a request, against the same model loaded.

    wake    request to first token of a seat asleep (load = "on_demand", keep_alive_s = 0:
            it sleeps after every answer, so every request wakes it: a worker process
            starts, imports MLX and loads the weights)  vs  the same model always loaded

Both seats run in one `sanctum up`; the requests are interleaved (A B A B).  The cold
wake's time to first token is the figure a household sees when it asks for a model
that slept; `--model shape:8b` measures it for a model of some GB (random weights).
"""

from __future__ import annotations

from sanctum.bench import arms as A
from sanctum.bench import servers
from sanctum.bench.options import Options, interleaved, model_path
from sanctum.bench.results import Run
from sanctum.bench.runner import Measure
from sanctum.bench.workloads import Workload

ASK = "Say hello in one line."


def wake(opts: Options) -> Run:
    title = "A sleeping on-demand seat woken by a request, against the same model loaded"
    path = model_path(opts.model)
    port = servers.free_port()
    config = servers.sanctum_config(port, [
        ("sleepy", str(path), 1024, 'load = "on_demand"\nkeep_alive_s = 0\n'),
        ("awake", str(path), 1024, "")])
    ask = Workload("wake", "a one-line chat", "chat", messages=(("user", ASK),),
                   prompt_tokens=len(ASK.split()) + 8)
    by_name = {ask.name: ask}
    with servers.sanctum_up(config, ("awake",), port) as url:
        arms: dict[str, tuple[str, Measure]] = {
            "cold wake": ("on-demand seat asleep (keep_alive_s = 0): each request loads it",
                          A.OpenAIArm(url, "sleepy", 0.0, opts.tokens, by_name)),
            "loaded": ("the same model, always loaded",
                       A.OpenAIArm(url, "awake", 0.0, opts.tokens, by_name))}
        return interleaved(opts, "wake", title, "cold wake", arms, [ask], opts.model,
                           ["Time to first token includes the wake: a worker process "
                            "starting, MLX imported, the weights loaded, the prompt "
                            "prefilled.", f"{opts.tokens} new tokens per request."])
