"""dflash.daemon: dflashd, the worker, job queue, wire protocol and supervisor."""
