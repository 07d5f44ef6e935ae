"""`dflashd`: start, stop, status, restart, logs, install, uninstall the local daemon."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, NoReturn

import click

from . import paths, supervisor
from . import protocol as P
from .config import ConfigError, DaemonConfig, load_config


class _ShownNumber:
    """Click's number types with the value an error names clipped as the daemon's errors clip it
    (protocol.shown): click echoed every digit of `--seed 1000...` (300 digits), and all 5,000
    characters of a value too long for int() to read. The one implementation for `dflash`,
    `dflash-client` and `dflashd`; valid values convert exactly as click's own types do."""

    number: type  # int or float

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, str):
            try:
                value = self.number(value)
            except ValueError:  # not a number, or past 4300 digits (int() refuses to read those)
                self.fail(f"{P.shown(value)} is not a valid {self.name}.", param, ctx)
        try:
            return super().convert(value, param, ctx)  # type: ignore[misc]
        except click.BadParameter as e:  # out of range: click names the whole number
            e.message = e.message.replace(str(value), P.shown(value), 1)
            raise


class ShownInt(_ShownNumber, click.types.IntParamType):
    number = int


class ShownIntRange(_ShownNumber, click.IntRange):
    number = int


class ShownFloat(_ShownNumber, click.types.FloatParamType):
    number = float


class ShownFloatRange(_ShownNumber, click.FloatRange):
    number = float


class BadConfig(click.ClickException):
    """A bad setting: exit 2, as docs/daemon.md says and as the worker exits (a service manager
    running `dflashd start --foreground` under the bundled unit's RestartPreventExitStatus=2 3
    then does not restart it in a loop)."""

    exit_code = 2


def _config_options(f: Any) -> Any:
    """Flags that override the config file and env (None = not given)."""
    opts = [
        click.option("--config", "config_path", default=None, help="TOML config (default: $DFLASH_CONFIG or ~/.config/dflash/config.toml)."),
        click.option("--model", default=None, help="Target model directory."),
        click.option("--draft", default=None, help="Draft directory (default: from the registry)."),
        click.option("--dtype", default=None, type=click.Choice(["float32", "bfloat16", "float16"])),
        click.option("--endpoint", default=None, help="ipc://PATH or tcp://HOST:PORT."),
        click.option("--state-dir", default=None, help="Jobs, results and logs."),
        click.option("--runtime-dir", default=None, help="Sockets and pid files (mode 0700)."),
        click.option("--max-queue", default=None, type=ShownInt()),
        click.option("--blas", default=None, type=click.Choice(["auto", "mkl", "none"])),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _resolve(config_path: str | None, **flags: Any) -> DaemonConfig:
    try:
        cfg = load_config(config_path, flags)
        cfg.validate()
    except (ValueError, OSError) as e:
        from dflash.client.cli import config_problem

        raise BadConfig(config_problem(e, config_path)) from e
    return cfg


def _seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A wait in seconds must be a finite number: nan made `start` give up at once ("did not
    become ready in nans") and `stop` send SIGTERM without waiting."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds")
    return value


def _check_places(cfg: DaemonConfig) -> None:
    """Refuse (exit 2), before anything is started, a runtime or state dir that cannot be made
    ours and an ipc:// socket that cannot be bound: they ended in a traceback, or in "the worker
    keeps crashing" with the reason only in the log."""
    for what, folder in (("runtime_dir", cfg.runtime_path()), ("state_dir", cfg.state_path()),
                         ("log folder", cfg.log_path())):
        try:
            paths.private_dir(folder)
        except OSError as e:
            raise BadConfig(f"cannot use {folder} as the {what}: {e.strerror or e}") from None
    _refuse_endpoints(cfg, ipc_problem)


def _endpoints(cfg: DaemonConfig) -> list[tuple[str, str]]:
    """(setting, endpoint) of each socket the daemon's children bind."""
    return [("endpoint", cfg.resolved_endpoint())] + (
        [("cache_endpoint", cfg.resolved_cache_endpoint())] if cfg.cache else [])


def _refuse_endpoints(cfg: DaemonConfig, problem_of: Callable[[str], str | None]) -> None:
    """Exit 2 on the first socket `problem_of` says cannot be bound, naming its setting."""
    for what, endpoint in _endpoints(cfg):
        if (problem := problem_of(endpoint)) is not None:
            raise BadConfig(f"{what} {endpoint} cannot be used: {problem}")


def _check_ports(cfg: DaemonConfig) -> None:
    """Refuse (exit 2) a tcp:// endpoint the worker or the cache could not bind, an ipc://
    socket another process serves, and a cache_dir a cache process of no daemon uses (another
    daemon's supervisor is refused at _claim). Run after the orphans a dead supervisor
    left are stopped: a port, socket or folder one of them held is ours to take."""
    _refuse_endpoints(cfg, tcp_problem)
    _refuse_endpoints(cfg, ipc_in_use)
    if cfg.cache and supervisor.lock_held(cfg.cache_path() / "l2.lock"):
        raise BadConfig(cache_dir_problem(cfg.cache_path(), "another cache process"))


def _claim(cfg: DaemonConfig) -> IO[str] | None:
    """Claim the daemon this start starts (supervisor.claim_daemon: the cache_dir, or with the
    cache off the runtime_dir), before the checks: of two starts at the same instant, the second
    is refused here (exit 1 for the same daemon, 2 naming another one on the cache_dir) having
    touched nothing of the first's; both used to pass the checks. None: a cache_dir that cannot
    be made (the cache process says why; the daemon serves L1)."""
    lock = supervisor.claim_file(cfg)
    try:
        claim = supervisor.claim_daemon(cfg)
    except OSError:
        return None
    if claim is None:
        owner = supervisor.claim_owner(lock) or {}
        if not cfg.cache or owner.get("runtime_dir") == str(cfg.runtime_path()):  # this daemon, twice at once
            raise click.ClickException(f"dflashd is already running or starting at {cfg.resolved_endpoint()} "
                                       f"(pid {owner.get('supervisor_pid')} holds {lock})")
        who = (f"the daemon at {owner['endpoint']} (runtime_dir {owner.get('runtime_dir')})"
               if isinstance(owner.get("endpoint"), str) else "another daemon")
        raise BadConfig(cache_dir_problem(cfg.cache_path(), who))
    return claim


def ipc_in_use(endpoint: str) -> str | None:
    """Why this ipc:// endpoint must not be bound (None: nothing serves it, or it is not ipc://):
    a process accepts connections on its socket. ZeroMQ binds an ipc:// path by removing what is
    there, so a second daemon given another's endpoint or cache_endpoint took that socket from it
    without an error: the other daemon's clients (or worker) then reached this one. A Linux
    abstract `ipc://@name` (no file) is probed the same way, at its address "\\0name"."""
    import socket

    abstract, path = paths.ipc_abstract(endpoint), paths.ipc_path(endpoint)
    if abstract is None and (path is None or not path.exists()):
        return None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(abstract or os.fsencode(path))
    except OSError:  # nothing listens on it (any more: a stopped daemon's socket file), or no socket
        return None
    finally:
        probe.close()
    if abstract is not None:  # no file to replace: zmq's bind fails, and the worker kept crashing
        return "another process (another daemon?) serves that socket; binding it again fails (address in use)"
    return "another process (another daemon?) serves that socket; binding it would take it from that process"


def cache_dir_problem(cache_dir: Path, who: str) -> str:
    """Why this daemon cannot have `cache_dir`, which `who` uses: one cache process per folder,
    so a second daemon's would only wait (serving from L1) for the first to stop."""
    return (f"cache_dir {cache_dir} is in use by {who}: two daemons cannot share one cache folder; "
            "set cache_dir (or DFLASH_CACHE_DIR) to another folder, or stop that daemon")


def ipc_problem(endpoint: str) -> str | None:
    """Why a socket cannot be bound at this ipc:// endpoint (None: it can, or it is not ipc://):
    a path longer than a Unix socket address holds, or a folder where no file can be made."""
    import zmq

    path, abstract = paths.ipc_path(endpoint), paths.ipc_abstract(endpoint)
    if path is None and abstract is None:
        return None
    limit = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 103
    # an abstract name counts its "@" (ZeroMQ's own check), as the address's leading NUL
    size = len(os.fsencode(path)) if path is not None else len(abstract)
    if size > limit:
        return (f"its path is {size} bytes, more than the {limit} a Unix socket's address holds "
                "(choose a shorter runtime_dir or endpoint)")
    if path is None:  # abstract: no folder, no file
        return None
    try:  # os.access cannot tell: root passes it even where nothing can be made (/proc)
        with tempfile.TemporaryFile(dir=path.parent, prefix=".dflash-probe-"):
            pass
    except OSError as e:
        return f"cannot make a file in {path.parent}: {e.strerror or e}"
    return None


def tcp_problem(endpoint: str) -> str | None:
    """Why the worker could not bind this tcp:// endpoint (None: it can, or it is not tcp://),
    found by binding it once the way the worker will: a port another program holds, or an
    address this host does not have, used to end in "the worker keeps crashing" with the
    reason only in the log. (An endpoint our own daemon serves is found before this.)"""
    import zmq

    if not endpoint.startswith("tcp://"):
        return None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        reason = os.strerror(e.errno) if e.errno in errno.errorcode else str(e)  # zmq's adds the address
        hint = " (another program holds that port: choose another)" if e.errno == errno.EADDRINUSE else ""
        return f"{reason}{hint}"
    finally:
        sock.close()
        ctx.term()
    return None


def _stop_orphans(cfg: DaemonConfig) -> list[str]:
    """supervisor.stop_orphans, with a runtime dir that is not a folder one line (exit 2)."""
    try:
        return supervisor.stop_orphans(cfg)
    except OSError as e:
        raise BadConfig(f"cannot use {cfg.runtime_path()} as the runtime_dir: {e.strerror or e}") from None


def _client(cfg: DaemonConfig, timeout: float):
    from dflash.client.client import DFlashClient

    return DFlashClient(cfg.resolved_endpoint(), config=cfg, timeout=timeout, retry_interval=timeout)


def _supervisor_pid(cfg: DaemonConfig) -> int | None:
    """The live supervisor's pid (files a dead one left are ignored: supervisor.live_pid)."""
    return supervisor.live_pid(cfg.runtime_path())


def _worker_restarts(cfg: DaemonConfig, sup_pid: int) -> int:
    """Worker restarts so far under the supervisor `sup_pid` (not under a dead predecessor)."""
    try:
        return int(supervisor.child_state(cfg.runtime_path(), sup_pid, "worker").get("restarts", 0))
    except (TypeError, ValueError):
        return 0


def _cache_failure(cfg: DaemonConfig, sup_pid: int, wait_s: float = 2.0) -> str | None:
    """Why the cache process (L2) is down just after a start; None when it serves (or cache is
    off). It starts alongside the worker and has usually failed or started serving long before
    the model is loaded: the bounded wait covers one the supervisor has not reaped yet."""
    if not cfg.cache:
        return None
    from dflash.cache.client import CacheClient

    probe = CacheClient(cfg.resolved_cache_endpoint(), timeout_s=0.2, connect_timeout_s=0.1, retry_after_s=0.0)
    end = time.monotonic() + wait_s
    try:
        while True:
            error = supervisor.child_error(cfg.runtime_path(), sup_pid, "cache")
            if error or probe.ping() or time.monotonic() >= end:
                return error
            time.sleep(0.1)
    finally:
        probe.close()


def _stats(cfg: DaemonConfig, timeout: float) -> dict | None:
    from dflash.client.errors import DFlashError

    try:
        with _client(cfg, timeout) as c:
            return c.stats()
    except DFlashError:
        return None


def _model(cfg: DaemonConfig, timeout: float) -> dict | None:
    """What the running worker serves (its `models` answer: model, draft, dtype, loaded), or None
    when nothing answered."""
    from dflash.client.errors import DFlashError

    try:
        with _client(cfg, timeout) as c:
            models = c.models()
    except DFlashError:
        return None
    return models[0] if models and isinstance(models[0], dict) else None


def _model_words(m: dict | None) -> str:
    """`model M (draft D, dtype T)` for a `models` answer; "" for none."""
    if not m or not m.get("model"):
        return ""
    extra = [f"draft {m['draft']}" if m.get("draft") else "draft from the registry"]
    if m.get("dtype"):
        extra.append(f"dtype {m['dtype']}")
    if m.get("loaded") is False:
        extra.append("not loaded")
    return f"model {m['model']} ({', '.join(extra)})"


class _Cli(click.Group):
    """Ctrl-C in a command that does not handle it ends with one line and 130, not click's
    "Aborted!" and exit 1 (`start` also stops what it started: _interrupted)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ndflashd: interrupted", err=True)
            sys.exit(130)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """dflashd: the local DFlash daemon (worker, job queue, supervisor)."""


@main.command()
@_config_options
@click.option("--foreground", is_flag=True, help="Run the supervisor attached (launchd/systemd).")
@click.option("--wait", "wait_s", default=120.0, show_default=True, type=ShownFloatRange(min=0, min_open=True),
              callback=_seconds, help="Seconds to wait for the model to load.")
def start(config_path, foreground, wait_s, **flags):
    """Start the supervisor, which starts the worker (and restarts it if it dies)."""
    cfg = _resolve(config_path, **flags)
    if not cfg.model:
        raise BadConfig("no model configured: pass --model, set DFLASH_MODEL or `model` in the config")
    if _supervisor_pid(cfg) or _stats(cfg, 0.5):
        serving = _model_words(_model(cfg, 0.5))
        raise click.ClickException(f"dflashd is already running at {cfg.resolved_endpoint()}"
                                   + (f", serving {serving}" if serving else "")
                                   + ": `dflashd restart` with your flags replaces it, `dflashd stop` ends it")
    _check_places(cfg)
    claim = _claim(cfg)  # held from here on by this process, then by the supervisor
    orphans = _stop_orphans(cfg)  # they would hold the locks the new children need
    if orphans:
        click.echo("stopped what a dead supervisor left running: " + ", ".join(orphans), err=True)
    _check_ports(cfg)
    paths.private_umask()  # the log file and dirs made here, and the supervisor it starts
    if foreground:
        _run_foreground(cfg, claim)
    log_dir = paths.private_dir(cfg.log_path())
    log = open(log_dir / "dflashd.log", "ab")
    os.fchmod(log.fileno(), 0o600)  # one an older version made 0644
    handover = ["--claim-fd", str(claim.fileno())] if claim is not None else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.daemon.supervisor", "--config-json", cfg.to_json(), *handover],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        pass_fds=[claim.fileno()] if claim is not None else [],
    )
    if claim is not None:
        claim.close()  # the supervisor holds it now: the claim ends with the supervisor, not this command
    try:
        st = _wait_ready(proc, cfg, wait_s, log_dir / "dflashd.log")
        cache_error = _cache_failure(cfg, proc.pid)
    except KeyboardInterrupt:  # click said "Aborted!", exit 1, and left the daemon loading
        _interrupted(proc, cfg)
    click.echo(f"dflashd started (supervisor {proc.pid}, worker {st['pid']}) at {cfg.resolved_endpoint()}; {st['accel']}")
    from dflash.client.cli import store_notes

    for note in store_notes(st):
        click.echo("warning: " + note, err=True)
    if cache_error:  # the daemon still serves, with L1 only
        click.echo(f"warning: the cache process (L2) stopped: {cache_error}; serving from L1 only", err=True)


def _run_foreground(cfg: DaemonConfig, claim: IO[str] | None) -> NoReturn:
    """Run the supervisor attached (systemd, launchd) and exit with its code. A model that fails to
    load ends it with 2 and the reason (exit_on_load_failure), so the service manager shows a
    failure instead of a daemon idling in the "failed" state. `claim`: the daemon's (_claim), kept."""
    rc, reason = supervisor.run_attached(dataclasses.replace(cfg, exit_on_load_failure=True), claim)
    if rc and reason:
        click.echo(f"dflashd: {reason}", err=True)
    sys.exit(rc)


def _wait_ready(proc: subprocess.Popen, cfg: DaemonConfig, wait_s: float, log_file: Path) -> dict:
    """The worker's stats once its model is loaded. A start that failed stops the daemon it
    started first, so the next `dflashd start` does not find it "already running"."""
    started = time.time()
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if proc.poll() is not None:  # e.g. the worker exited 2 (exit_on_load_failure set in the config)
            reason = supervisor.read_exit_reason(supervisor.reason_path(cfg.runtime_path(), "worker"), since=started)
            raise click.ClickException(f"dflashd exited with {proc.returncode}" + (f": {reason}" if reason else "")
                                       + f"; see {log_file}")
        crashes = _worker_restarts(cfg, proc.pid)
        if crashes >= 2:
            _stop_started(proc, cfg)
            raise click.ClickException(f"the worker keeps crashing ({crashes} restarts); see {log_file};"
                                       " the daemon was stopped")
        st = _stats(cfg, 0.5)
        if st and st["state"] == "failed":
            _stop_started(proc, cfg)
            error = _one_line(st["error"] or "")
            kind = BadConfig if error.startswith(f"{ConfigError.__name__}:") else click.ClickException
            raise kind(f"worker up but the model failed to load: {error}; the daemon was stopped")
        if st and st["state"] != "loading":
            return st
    raise click.ClickException(f"dflashd did not become ready in {wait_s:g}s; see {log_file}")


def _stop_started(proc: subprocess.Popen, cfg: DaemonConfig, grace_s: float = 30.0) -> None:
    """Stop the supervisor this command started; it stops the worker and the cache process."""
    proc.terminate()
    try:
        proc.wait(grace_s)  # the supervisor gives its children 20 s, then kills them
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    supervisor.stop_orphans(cfg)  # what a supervisor killed here could not stop


def _interrupted(proc: subprocess.Popen, cfg: DaemonConfig) -> NoReturn:
    """Ctrl-C while `start` waits: stop what it started, as a start that fails does, and exit 130.
    A second Ctrl-C is ignored meanwhile: it would leave the supervisor half stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    click.echo(f"\ndflashd: interrupted: stopping the daemon this start started (supervisor {proc.pid}, which "
               "stops its worker and cache process)", err=True)
    _stop_started(proc, cfg)
    sys.exit(130)


def _one_line(text: str) -> str:
    """An error message for one output line (an exception's text may span several)."""
    return " ".join(text.split())


@main.command()
@_config_options
@click.option("--timeout", default=30.0, show_default=True, type=ShownFloatRange(min=0), callback=_seconds)
def stop(config_path, timeout, **flags):
    """Ask the worker to shut down (a running job is re-queued), wait for the supervisor, then stop
    whatever a supervisor that died (kill -9) left running."""
    cfg = _resolve(config_path, **flags)
    pid = _supervisor_pid(cfg)
    from dflash.client.errors import DFlashError

    answered = True
    try:
        with _client(cfg, 2.0) as c:
            c.shutdown()
    except DFlashError:
        answered = False
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
    end = time.monotonic() + timeout
    while pid is not None and time.monotonic() < end:
        try:  # reap it when it is our own child (`dflash serve` started it), else it stays a zombie
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except OSError:
            break
        time.sleep(0.1)
    else:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
    orphans = _stop_orphans(cfg)
    if orphans:
        click.echo("stopped what a dead supervisor left running: " + ", ".join(orphans))
    elif not answered and pid is None:
        raise click.ClickException("dflashd is not running")
    click.echo("dflashd stopped")


@main.command()
@_config_options
@click.option("--json", "as_json", is_flag=True)
def status(config_path, as_json, **flags):
    """Supervisor and worker state: pid, model, accelerator setup, queue, counters."""
    cfg = _resolve(config_path, **flags)
    st = _stats(cfg, 2.0)
    sup = _supervisor_pid(cfg)
    l2_down = bool(st and (st.get("cache") or {}).get("enabled") and not st["cache"].get("l2_up"))
    cache_error = supervisor.child_error(cfg.runtime_path(), sup, "cache") if l2_down else None  # why the cache process stopped
    model = _model(cfg, 2.0) if st is not None else None  # the pair it serves: model, draft, dtype
    info = {"endpoint": cfg.resolved_endpoint(), "supervisor_pid": sup, "worker": st, "cache_error": cache_error,
            "model": model}
    if as_json:
        click.echo(json.dumps(info, indent=2))
    elif st is None:
        click.echo(f"dflashd: not running at {info['endpoint']}" + (f" (supervisor {sup} is up)" if sup else ""))
    else:
        error = f" : {_one_line(st['error'])}" if st.get("error") else ""  # why it failed
        click.echo(f"dflashd: {st['state']} at {info['endpoint']}{error}")
        click.echo(f"  supervisor {f'pid {sup}' if sup else 'none'}, worker pid {st['pid']}, up {st['uptime_s']:.0f}s,"
                   f" restarts {st['restarts']}")
        if serving := _model_words(model):
            click.echo(f"  {serving}")
        from dflash.client.cli import cache_lines, store_notes

        for note in store_notes(st):
            click.echo("  " + note)
        click.echo(f"  accelerator: {st['accel']}")
        click.echo(f"  queue: {st['queued']} waiting (max {st['max_queue']}), running {st['running']},"
                   f" {st.get('held', 0)} held (streamed jobs whose client left: `dflash-client result ID` runs one)")
        if "limits" in st:  # workers before session 31 do not report them
            lim = st["limits"]
            click.echo(f"  limits: max_tokens {lim['max_tokens_limit']}, prompt {lim['max_prompt_tokens']} tokens,"
                       f" request {lim['max_frame_bytes'] >> 10} KiB, {lim['max_attempts']} attempts a job")
        click.echo(f"  jobs: {st['jobs_done']} done, {st['jobs_failed']} failed, {st['jobs_cancelled']} cancelled;"
                   f" {st['tokens_generated']} tokens; {st['bad_frames']} bad frames")
        lines = cache_lines(st.get("cache"))
        if cache_error:
            lines[0] += f"; stopped: {cache_error}"
        for line in lines:
            click.echo("  " + _one_line(line))
    if st is None:
        sys.exit(3)


@main.command()
@_config_options
@click.option("--wait", "wait_s", default=120.0, show_default=True, type=ShownFloatRange(min=0, min_open=True),
              callback=_seconds)
@click.pass_context
def restart(ctx, config_path, wait_s, **flags):
    """stop (if running), then start."""
    cfg = _resolve(config_path, **flags)
    if _supervisor_pid(cfg) or _stats(cfg, 0.5):
        ctx.invoke(stop, config_path=config_path, timeout=30.0, **flags)
    ctx.invoke(start, config_path=config_path, foreground=False, wait_s=wait_s, **flags)


@main.command()
@_config_options
@click.option("-n", "lines", default=50, show_default=True, type=ShownIntRange(min=0),
              help="Print the last N lines (0: none, e.g. with -f).")
@click.option("-f", "follow", is_flag=True, help="Keep printing new lines (until Ctrl-C).")
def logs(config_path, lines, follow, **flags):
    """Print the daemon's log (supervisor and worker)."""
    cfg = _resolve(config_path, **flags)
    path = cfg.log_path() / "dflashd.log"
    if not path.is_file():
        raise click.ClickException(f"no log at {path}")
    try:
        with open(path, "rb") as fh:
            for line in fh.readlines()[-lines:] if lines else ():  # [-0:] would be every line
                click.echo(line.decode(errors="replace"), nl=False)
            while follow:
                line = fh.readline()
                if line:
                    click.echo(line.decode(errors="replace"), nl=False)
                else:
                    time.sleep(0.3)
    except KeyboardInterrupt:  # how -f ends: 130, as `tail -f`, not click's "Aborted!" and 1
        sys.exit(130)


@main.command()
@_config_options
@click.option("--dest", default=None, help="Write the agent files here instead of the system location.")
@click.option("--no-load", is_flag=True, help="Only write the files; do not bootstrap/enable them.")
@click.option("--kind", type=click.Choice(["auto", "launchd", "systemd"]), default="auto", show_default=True)
def install(config_path, dest, no_load, kind, **flags):
    """Install launchd agents (macOS) or a systemd user unit (Linux) that keep dflashd running."""
    from .install import install_agents

    cfg = _resolve(config_path, **flags)
    if not cfg.model:  # a configuration error, exit 2 as for `start` (docs/daemon.md, exit codes)
        raise BadConfig("no model configured: pass --model, set DFLASH_MODEL or `model` in the config")
    try:
        lines = install_agents(cfg, Path(dest) if dest else None, load=not no_load, kind=kind)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from e
    for line in lines:
        click.echo(line)


@main.command()
@click.option("--dest", default=None)
@click.option("--no-load", is_flag=True)
@click.option("--kind", type=click.Choice(["auto", "launchd", "systemd"]), default="auto", show_default=True)
def uninstall(dest, no_load, kind):
    """Remove what `dflashd install` wrote (and unload it)."""
    from .install import uninstall_agents

    for line in uninstall_agents(Path(dest) if dest else None, unload=not no_load, kind=kind):
        click.echo(line)


if __name__ == "__main__":
    main()
