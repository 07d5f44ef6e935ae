"""dflash.launchd: the agent templates `dflashd install` renders (a data-only package).

com.dflash.worker.plist and com.dflash.cache.plist are launchd agents (macOS); dflashd.service
is the systemd user unit written instead on Linux.
"""
