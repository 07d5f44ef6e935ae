"""dflash.client: DFlashClient (sync and asyncio) and the dflash-client CLI."""

from .aio import AsyncDFlashClient
from .client import DFlashClient, Delta, JobHandle, Result, Stream
from .errors import (
    BadRequestError,
    BusyError,
    CacheUnavailableError,
    ClientClosedError,
    ClientTimeoutError,
    DFlashError,
    JobFailedError,
    NotFoundError,
    ProtocolVersionError,
    WorkerGoneError,
    WorkerUnavailableError,
)

__all__ = [
    "AsyncDFlashClient",
    "BadRequestError",
    "BusyError",
    "CacheUnavailableError",
    "ClientClosedError",
    "ClientTimeoutError",
    "DFlashClient",
    "DFlashError",
    "Delta",
    "JobFailedError",
    "JobHandle",
    "NotFoundError",
    "ProtocolVersionError",
    "Result",
    "Stream",
    "WorkerGoneError",
    "WorkerUnavailableError",
]
