"""Worker exit codes that tell seatd why a seat stopped.

A config or model that cannot load is FATAL at once: restarting cannot fix it.
"""

OK = 0
CRASH = 1
CONFIG = 78  # sysexits EX_CONFIG
MODEL_LOAD = 79
PARENT_GONE = 80

FATAL_AT_ONCE = {CONFIG: "config_error", MODEL_LOAD: "model_load_failed"}


def describe(returncode: int) -> str:
    """A short exit reason: `exit:79 (model_load_failed)` or `signal:SIGKILL`."""
    import signal

    if returncode < 0:
        try:
            return f"signal:{signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal:{-returncode}"
    named = FATAL_AT_ONCE.get(returncode) or {PARENT_GONE: "parent_gone"}.get(returncode)
    return f"exit:{returncode} ({named})" if named else f"exit:{returncode}"
