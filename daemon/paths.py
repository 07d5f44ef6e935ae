"""Per-user directories: the runtime dir (sockets, pid files; mode 0700) and the state dir.

Other users must not reach the worker's socket, so the runtime dir is created 0700, checked to
be ours, and its mode repaired if someone loosened it. ipc:// socket files are chmod 0600 too.
The supervisor, the worker, the gateway and `dflashd start` call `private_umask` first (the cache
process sets the same umask in cache/l2.py), so whatever they create (job stores, results, logs,
pid and lock files) is 0600 in 0700 directories whatever the user's umask.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "dflash"
    # Not $TMPDIR: launchd agents and shells see different ones, and both must find the socket.
    return Path("/tmp") / f"dflash-{os.getuid()}"


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "dflash"


def default_config_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "dflash" / "config.toml"


def private_umask() -> None:
    """From now on this process creates files 0600 and directories 0700: they hold users' prompts."""
    os.umask(0o077)


def private_dir(path: str | Path) -> Path:
    """Create (or check) a directory only this user can enter; refuse one owned by someone else.
    Missing parents are created 0700 too (mkdir's parents=True would give them the umask's mode)."""
    p = Path(path)
    for d in [*reversed(p.parents), p]:
        if not d.exists():
            try:
                d.mkdir(mode=0o700)
            except FileExistsError:  # made meanwhile by another process
                pass
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{p} is not a plain directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{p} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(p, 0o700)
    return p


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, or None for other transports and for an abstract
    `ipc://@name` (no file: "@name" was read as a file in the working directory)."""
    if not endpoint.startswith("ipc://") or ipc_abstract(endpoint) is not None:
        return None
    return Path(endpoint[len("ipc://") :])


def ipc_abstract(endpoint: str) -> bytes | None:
    """The socket address of a Linux abstract-namespace endpoint `ipc://@name` ("\\0name", as
    ZeroMQ binds it), or None for any other endpoint (elsewhere ZeroMQ makes a file "@name")."""
    if not endpoint.startswith("ipc://@") or not sys.platform.startswith("linux"):
        return None
    return b"\0" + os.fsencode(endpoint[len("ipc://@") :])


def secure_ipc_socket(endpoint: str) -> None:
    """Tighten a freshly bound ipc socket to 0600 (its directory is 0700 already)."""
    path = ipc_path(endpoint)
    if path is not None and path.exists():
        os.chmod(path, 0o600)
