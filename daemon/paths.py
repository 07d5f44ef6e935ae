"""Per-user directories: the runtime dir (sockets, pid files; mode 0700) and the state dir.

Other users must not reach the worker's socket, so the runtime dir is created 0700, checked to
be ours, and its mode repaired if someone loosened it. ipc:// socket files are chmod 0600 too.
"""

from __future__ import annotations

import os
import stat
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


def private_dir(path: str | Path) -> Path:
    """Create (or check) a directory only this user can enter; refuse one owned by someone else."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{p} is not a plain directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{p} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(p, 0o700)
    return p


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ipc:// endpoint, or None for other transports."""
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def secure_ipc_socket(endpoint: str) -> None:
    """Tighten a freshly bound ipc socket to 0600 (its directory is 0700 already)."""
    path = ipc_path(endpoint)
    if path is not None and path.exists():
        os.chmod(path, 0o600)
