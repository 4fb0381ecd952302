"""The state directory and the files in it, readable by the service user only.

The state directory holds the seats' ipc sockets (anyone who can open one can
talk to a worker), their counters and exit reasons: it is made 0700, and one
found looser is tightened rather than refused, since an older Sanctum (or a
test, or a bench run) made it with the default mode and it holds only our own
files; one owned by another user is refused.  Files are written 0600,
atomically (a temporary file, then a rename), whatever the umask.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import structlog

log = structlog.get_logger()

DIR_MODE = 0o700
FILE_MODE = 0o600


class StateDirError(OSError):
    """The state directory cannot be made private; the message says why."""


def make_private_dir(path: Path) -> Path:
    """`path` (and missing parents) as a directory only this user can open."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise StateDirError(f"state directory {path} belongs to uid {st.st_uid}, not to this "
                            f"user ({os.getuid()}): choose another (seatd.state_dir)")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        log.warning("state_dir_tightened", path=str(path),
                    was=f"{stat.S_IMODE(st.st_mode):04o}", now=f"{DIR_MODE:04o}")
        path.chmod(DIR_MODE)
    return path


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, mode 0600 from the first byte on."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # an old temporary file keeps its mode through O_CREAT
        with os.fdopen(fd, "w") as f:
            fd = -1
            f.write(text)
    finally:
        if fd >= 0:
            os.close(fd)
    os.replace(tmp, path)
