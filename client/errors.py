"""Typed exceptions for what a dflashd request can end in (one per wire error code family)."""

from __future__ import annotations

from dflash.daemon import protocol as P


class DFlashError(Exception):
    """Any failure answered by, or about, the daemon. `code` is the wire error code; `param` the
    request field it is about ("" when none)."""

    def __init__(self, code: str, message: str, job_id: str = "", param: str = ""):
        self.code = code
        self.message = message
        self.job_id = job_id
        self.param = param
        super().__init__(self.describe())

    def describe(self, cli: str = "dflash-client") -> str:
        """The one-line text; `cli` is the shell command a hint tells the user to run, with the
        connection options (endpoint, config) that reach this daemon."""
        return f"[{self.code}] {self.message}{self._about(cli)}"

    def _about(self, cli: str) -> str:
        """What the text adds to the message: the job's id, unless the message names it."""
        return f" (job {self.job_id})" if self.job_id and self.job_id not in self.message else ""


class BusyError(DFlashError):
    """The queue is full; nothing was queued. Retry later."""


class BadRequestError(DFlashError):
    """The request was malformed or out of range."""


class NotFoundError(DFlashError):
    """No such job (never submitted, or its result expired)."""


class JobFailedError(DFlashError):
    """The job was accepted but could not produce a result."""


class WorkerUnavailableError(DFlashError):
    """No worker answered at the endpoint in time (not started, or restarting)."""


class WorkerGoneError(DFlashError):
    """The worker stopped answering while a job was in flight (heartbeats stopped). The job is
    persisted: after the worker restarts it runs again once asked for, and
    `client.job(e.job_id).result()` (in a shell: `dflash-client result ID`) fetches its result."""

    def _about(self, cli: str) -> str:
        """The job id and the command that fetches its re-run, for a shell user who saw this."""
        if not self.job_id:
            return ""
        return f"; job {self.job_id} is kept: `{cli} result {self.job_id}` runs it again and prints it"


class ProtocolVersionError(BadRequestError):
    """The other side speaks another version of the wire protocol (the message names both):
    the client and the daemon come from different dflash releases; upgrade the older one."""


class CacheUnavailableError(DFlashError):
    """The cache process (which keeps position lists) did not answer; it restarts by itself."""


class ClientTimeoutError(DFlashError):
    """The caller's own time limit ran out while waiting for a job."""


class ClientClosedError(DFlashError):
    """The client was closed (`close()`, or the end of its `with` block) before or during this
    call: a closed client makes no new sockets, so nothing it opened outlives close()."""


_BY_CODE = {
    P.BUSY: BusyError,
    P.BAD_REQUEST: BadRequestError,
    P.BAD_FRAME: BadRequestError,
    P.TOO_LARGE: BadRequestError,
    P.UNKNOWN_OP: BadRequestError,
    P.BAD_VERSION: ProtocolVersionError,
    P.BAD_SAMPLING: BadRequestError,
    P.NOT_FOUND: NotFoundError,
    P.BAD_POSITIONS: BadRequestError,
    P.SPARSE_WITH_CACHE: BadRequestError,
    P.CACHE_UNAVAILABLE: CacheUnavailableError,
    # the worker stopped under the job, which is kept and runs again once asked for: the same
    # promise (and the same recovery, `client.job(id).result()`) as a worker that died
    P.SHUTTING_DOWN: WorkerGoneError,
}


def from_reply(err: P.Error) -> DFlashError:
    return _BY_CODE.get(err.code, JobFailedError)(err.code, err.message, err.job_id, err.param)
