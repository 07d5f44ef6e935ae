"""`dflash-client`: prompt the daemon from a shell; fetch a job's result by id; status and jobs;
inspect and clear the prefix cache.

Every error is one line on stderr (a line of its own also after part of a streamed answer). Exit
codes: 0 done, 1 the job failed, 2 usage or bad request (including `--endpoint ""` and a prompt,
from stdin or an argument, that is not UTF-8: refused, never guessed at), 3 no worker / worker died
(a kept job's error prints the `result` command, with this run's --endpoint, --config and
--timeout), 4 busy (queue full), 5 no such job (or its result expired) or position
list, 6 the job was cancelled by someone else (`dflash-client cancel`, another client, or the client
streaming it went away: the text is cut short), 124 the job hit its time limit, 130 Ctrl-C (cancels a `prompt`; `result` only stops
waiting), 141 stdout was closed before all was written (`| head`: a `prompt`'s job is cancelled).
`cache clear` exits 1 when the cache process did not answer (L1 was cleared, L2 was not).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import sys
from typing import Any, Iterator, NoReturn

import click
from click.core import ParameterSource

from dflash.daemon import codec
from dflash.daemon import protocol as P
from dflash.daemon.config import tomllib  # tomli on Python 3.10
from dflash.daemon.cli import ShownFloat, ShownFloatRange, ShownInt, ShownIntRange

from . import errors as E
from .client import MAX_WAIT_S, DFlashClient, Result

EXIT = {E.BusyError: 4, E.BadRequestError: 2, E.WorkerUnavailableError: 3, E.WorkerGoneError: 3, E.NotFoundError: 5}


def exit_code(e: E.DFlashError) -> int:
    """The documented exit status of an error, by its nearest class in EXIT (1: none): a
    ProtocolVersionError is a BadRequestError, 2, where the exact class's lookup gave 1."""
    return next((EXIT[c] for c in type(e).__mro__ if c in EXIT), 1)


def _fail(e: E.DFlashError, lead: str = "") -> NoReturn:
    click.echo(f"{lead}dflash-client: {e.describe(_this_cli())}", err=True)
    sys.exit(exit_code(e))


def end_open_line() -> str:
    """Streamed text stopped mid-line: end that line so an error is a line of its own. The newline
    goes to stdout only when it is a terminal (redirected, stdout's bytes stay exactly the
    answer); when stderr is the very file or pipe stdout is (`2>&1`), it leads stderr's line,
    which is returned ("" otherwise)."""
    try:
        if sys.stdout.isatty():
            sys.stdout.write("\n")
            sys.stdout.flush()
            return ""
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # a stream without a file (closed, in-memory)
        return ""
    return "\n" if (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino) else ""


def interrupted_lead(open_line: bool = False) -> str:
    """What leads the line a Ctrl-C prints on stderr: a newline on a terminal (past the `^C` it
    echoed, and any open line of text there); otherwise only what ends an open streamed line
    (end_open_line), so a redirected stderr never gets an empty line, as after a worker error."""
    try:
        if sys.stderr.isatty():
            return "\n"
    except (ValueError, AttributeError):
        return ""
    return end_open_line() if open_line else ""


def cli_command(endpoint: str | None = None, config_path: str | None = None, timeout: float | None = None) -> str:
    """`dflash-client` with these options (None: left out), quoted for a POSIX shell."""
    args = ["dflash-client"]
    for flag, value in (("--endpoint", endpoint), ("--config", config_path),
                        ("--timeout", None if timeout is None else f"{timeout:g}")):
        if value is not None:
            args += [flag, value]
    return shlex.join(args)


def _this_cli() -> str:
    """This run's `dflash-client` with the options that reached its daemon, for a command that an
    error tells the user to run next: the bare command would go to the default endpoint."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return cli_command()
    root = ctx.find_root()
    timeout = root.params.get("timeout")
    given = timeout is not None and root.get_parameter_source("timeout") is not ParameterSource.DEFAULT
    return cli_command(root.params.get("endpoint"), root.params.get("config_path"), timeout if given else None)


def _usage_error(message: str) -> NoReturn:
    click.echo(f"dflash-client: {message}", err=True)
    sys.exit(2)


STDIN_HINT = "dflash-client: reading the prompt from stdin (end it with Ctrl-D)"  # `dflash generate`'s words


def _stdin_text() -> str:
    """stdin as UTF-8, strictly: bytes that are not UTF-8 are refused, never guessed at. A
    terminal is told it is being read (a bare `dflash-client prompt` would look hung)."""
    if sys.stdin is None:  # started with stdin closed (`<&-`, some service managers)
        _usage_error("no prompt: give TEXT, or pipe it on stdin (stdin is closed)")
    if sys.stdin.isatty():
        click.echo(STDIN_HINT, err=True)
    try:
        data = sys.stdin.buffer.read()
    except OSError as e:
        _usage_error(f"cannot read the prompt from stdin: {e.strerror or e}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        _usage_error(f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                     "convert it first, e.g. with iconv -t UTF-8")


def _require_utf8(value: str | None, what: str) -> None:
    """Refuse an argument that was not UTF-8 on the command line (Python keeps such bytes as
    surrogates, which cannot be sent)."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(value[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"{ascii(value[e.start])}"
        _usage_error(f"{what} is not UTF-8 text ({byte} at character {e.start}); convert it first, "
                     "e.g. with iconv -t UTF-8")


@contextlib.contextmanager
def _one_line_usage() -> Iterator[None]:
    """A usage error as one line and exit 2, like this CLI's other errors (click would print its
    usage block too); a bare group still prints its help."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise
    except click.UsageError as e:
        hint = f"; see {e.ctx.command_path} --help" if e.ctx is not None else ""
        _usage_error(e.format_message().rstrip(".") + hint)


BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command that `| head` cut short


def output_closed(prog: str, what: str = "") -> NoReturn:
    """stdout's reader went away (`| head`): one line and exit 141, not click's silent exit 1 (the
    code of a failed job). What cannot be written goes to /dev/null, so the interpreter's last
    flush cannot fail again (which would make the exit status 120); stderr may be the same
    closed pipe, so its line is best effort."""
    _to_devnull(sys.stdout)
    try:
        sys.stderr.write(f"{prog}: stdout was closed before all output was written{what}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        _to_devnull(sys.stderr)
    sys.exit(BROKEN_PIPE)


def _to_devnull(stream: Any) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


class _Cli(click.Group):
    """The root group: option parsing and every subcommand run under _one_line_usage; a Ctrl-C
    or a closed stdout that a command does not handle itself ends as documented (130, 141), not
    as click's "Aborted!" and exit 1."""

    def make_context(self, *args, **kw) -> click.Context:
        with _one_line_usage():
            return super().make_context(*args, **kw)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            with _one_line_usage():
                return super().invoke(ctx)
        except KeyboardInterrupt:
            with contextlib.suppress(OSError, ValueError):
                click.echo(f"{interrupted_lead()}dflash-client: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            output_closed("dflash-client")


def _finite(ctx, param, value):
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def sampling_options(f):
    """--temperature / --top-p / --top-k / --min-p / --min-tokens-to-keep / --seed, range-checked (None: not
    given)."""
    opts = [
        click.option("--temperature", "-t", type=ShownFloatRange(min=0), default=None, callback=_finite,
                     help="Sampling temperature; 0 = greedy. [default: the daemon's, normally 0]"),
        click.option("--top-p", type=ShownFloatRange(0, 1, min_open=True), default=None,
                     help="Nucleus sampling: keep the smallest set of tokens with this mass; 1 = off."),
        click.option("--top-k", type=ShownIntRange(min=0), default=None,
                     help="Keep the k most likely tokens; 0 = off."),
        click.option("--min-p", type=ShownFloatRange(0, 1), default=None, callback=_finite,
                     help="Keep the tokens at least this fraction as likely as the most likely one; 0 = off."),
        click.option("--min-tokens-to-keep", type=ShownIntRange(min=1), default=None,
                     help="With --min-p: the number of most likely tokens min-p always keeps (mlx-lm's "
                          "min_tokens_to_keep). [default: the daemon's, normally 1]"),
        click.option("--seed", type=ShownIntRange(0, (1 << 64) - 1), default=None,
                     help="Random seed; default: a random one (printed with --stats, and in --json). The same seed repeats the same ids when the daemon's verify_window is fixed."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def bias_option(ctx, param, values: tuple[str, ...]) -> dict[int, float] | None:
    """--logit-bias ID=BIAS (repeatable) as {id: bias}; None when not given."""
    from dflash.engine.processors import parse_bias_flags

    try:
        return parse_bias_flags(values)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def processor_options(f):
    """--logit-bias and the penalties (mlx-lm's logits processors), range-checked by the protocol's
    rule (None: not given, the daemon's default)."""
    opts = [click.option("--logit-bias", multiple=True, callback=bias_option, metavar="ID=BIAS",
                         help="Add BIAS to token ID's logit (repeatable).")]
    for kind, off in (("repetition", "1 = off; > 0"), ("presence", "0 = off"), ("frequency", "0 = off")):
        opts += [click.option(f"--{kind}-penalty", type=ShownFloat(), default=None, callback=_finite,
                              help=f"mlx-lm's {kind} penalty ({off}) over the last tokens."),
                 click.option(f"--{kind}-context-size", type=ShownIntRange(min=1), default=None,
                              help=f"Tokens the {kind} penalty looks back over (default 20).")]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _endpoint(ctx, param, value: str | None) -> str | None:
    """`--endpoint ""` (a `--endpoint "$UNSET"`) is refused, not taken for the default endpoint;
    an empty DFLASH_ENDPOINT still means the default one, as the daemon's config reads it."""
    if value == "":
        raise click.BadParameter("it is empty: an endpoint is ipc://PATH or tcp://HOST:PORT")
    return value


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--endpoint", envvar="DFLASH_ENDPOINT", default=None, callback=_endpoint,
              help="Worker endpoint (default: DFLASH_ENDPOINT, else from the config).")
@click.option("--config", "config_path", default=None, help="dflashd TOML config to read the endpoint from.")
@click.option("--timeout", default=30.0, show_default=True,
              type=ShownFloatRange(min=0, max=MAX_WAIT_S, min_open=True), callback=_finite,
              help=f"Seconds to wait for the worker to answer (> 0, at most {MAX_WAIT_S:g}: one day).")
@click.pass_context
def main(ctx, endpoint, config_path, timeout):
    """Talk to a running dflashd."""
    if sys.stdout is None:  # started with stdout closed (`>&-`): every answer was lost and it exited 0
        _usage_error("stdout is closed: there is nowhere to print the answer (nothing was sent)")
    try:
        ctx.obj = DFlashClient(endpoint, config=config_path, timeout=timeout)
    except (ValueError, OSError) as e:  # the config file (or a DFLASH_* setting) is unusable
        _usage_error(config_problem(e, config_path))


def config_problem(e: Exception, config_path: str | None) -> str:
    """Why the config could not be loaded, in one line that names the file: open()'s and
    tomllib's own words bury it in an errno or leave it out."""
    if isinstance(e, OSError):
        return f"cannot read the config file {e.filename or config_path}: {e.strerror or e}"
    if isinstance(e, tomllib.TOMLDecodeError):
        from dflash.daemon import paths

        file = config_path or os.environ.get("DFLASH_CONFIG") or paths.default_config_file()
        return f"the config file {file} is not valid TOML: {e}"
    return f"bad config: {e}"


def _window(ctx, param, value):
    """--verify-window: auto, full or a token count (checked against the block by the worker)."""
    if value is None:
        return None
    window = P.window_from_text(value)
    problem = P.verify_window_problem(window)
    if problem is not None:
        raise click.BadParameter(problem)
    return window


def _stops(ctx, param, value: tuple[str, ...]) -> tuple[str, ...]:
    """An empty stop sequence never matches, so the job would run on as if none were given (a
    `--stop "$UNSET"`): refused, as `dflash generate` refuses it."""
    if (problem := P.stops_problem(value)) is not None:
        raise click.BadParameter(problem)
    return value


MAX_POSITIONS = codec.DEFAULT_MAX_FRAME  # more than fit in one request frame: never sendable


def parse_positions(text: str) -> list[int]:
    """'0-63,100,128-255' -> [0..63, 100, 128..255] (ranges inclusive); a ValueError names the
    part that is wrong, so a reversed range is not sent as an empty list."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        start, end = _position_range(part)
        if len(out) + end - start + 1 > MAX_POSITIONS:  # checked before building a huge list
            raise ValueError(f"more than {MAX_POSITIONS} positions: a list that long cannot be sent")
        out.extend(range(start, end + 1))
    return out


def _position_range(part: str) -> tuple[int, int]:
    """'5' -> (5, 5), '0-63' -> (0, 63)."""
    lo, dash, hi = part.partition("-")
    try:
        start, end = int(lo), int(hi if dash else lo)
    except ValueError:
        raise ValueError(f"{P.shown(part)} is not a position (an index >= 0) or a range such as 0-63") from None
    if end < start:
        raise ValueError(f"bad range {P.shown(start)}-{P.shown(end)}: the end is before the start")
    return start, end


def _positions(ctx, param, value: str | None) -> list[int] | None:
    """--positions / SPEC as a list; a usage error naming the bad part."""
    if value is None:
        return None
    try:
        return parse_positions(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@main.command()
@click.argument("text", required=False)
@click.option("--max-tokens", "-m", default=256, show_default=True, type=ShownInt())
@click.option("--system", default=None, help="System message.")
@click.option("--stop", multiple=True, callback=_stops, help="Stop sequence (repeatable).")
@click.option("--priority", default=0, show_default=True, type=ShownInt(), help="Higher runs first.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats).")
@click.option("--cache", type=click.Choice(["use", "bypass", "refresh"]), default=None,
              help="Prefix cache policy (default: use; sparse prefill bypasses it).")
@click.option("--positions", default=None, callback=_positions,
              help="Sparse prefill: prompt token indices, e.g. '0-63,128-255,300'.")
@click.option("--positions-name", default=None, help="Sparse prefill with a stored position list.")
@click.option("--stats", "show_stats", is_flag=True, help="Print the job's stats line on stderr.")
@click.option("--verify-window", default=None, callback=_window,
              help="This job's tokens per verify: auto, full or 1..block size (1 = plain decoding). "
                   "[default: the daemon's, normally auto]")
@click.option("--compare-plain", is_flag=True,
              help="Then decode the same prompt plainly (verify window 1, prefix cache bypassed) and print "
                   "the measured speedup and whether the tokens are the same, on stderr (--json: under 'plain').")
@sampling_options
@processor_options
@click.pass_obj
def prompt(client: DFlashClient, text, max_tokens, system, stop, priority, raw, as_json, cache, positions,
           positions_name, show_stats, verify_window, compare_plain, temperature, top_p, top_k, min_p,
           min_tokens_to_keep, seed, **processors):
    """Generate from TEXT (stdin when omitted), streaming to stdout. Ctrl-C cancels the job.

    Sampling flags left out take the daemon's defaults (greedy unless its config says otherwise)."""
    text = _stdin_text() if text is None else text
    for what, value in (("TEXT", text), ("--system", system), *(("--stop", s) for s in stop)):
        _require_utf8(value, what)
    job = dict(max_tokens=max_tokens, system=system, stop=stop, priority=priority, raw=raw,
               positions=positions or None, positions_name=positions_name,  # --positions "": none, as before
               temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
               min_tokens_to_keep=min_tokens_to_keep, seed=seed, **processors)
    try:  # a value the client refuses (e.g. a --positions-name that is not UTF-8) is one line, exit 2
        stream = client.stream(text, cache=cache, verify_window=verify_window, **job)
    except E.DFlashError as e:
        _fail(e)
    open_line = False  # the streamed text so far does not end with a newline
    try:
        for delta in stream:
            if not as_json and delta.text:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                open_line = not delta.text.endswith("\n")
    except KeyboardInterrupt:
        stream.close()  # sends cancel
        click.echo(f"{interrupted_lead(open_line)}dflash-client: cancelled", err=True)
        sys.exit(130)
    except BrokenPipeError:  # `| head` has read enough: the rest is not wanted
        stream.close()  # sends cancel, now rather than whenever the stream is collected
        output_closed("dflash-client", f"; job {stream.job_id} was cancelled")
    except E.DFlashError as e:  # e.g. the worker died mid-answer: the error on a line of its own
        _fail(e, end_open_line() if open_line else "")
    res = stream.result
    plain = None
    text_shown = True
    if compare_plain and res.finish_reason != "timeout":
        if not as_json:  # this job's lines first: the plain run takes as long again
            click.echo("")
            text_shown = None
            if show_stats:
                _stats_line(res)
                show_stats = False
            from dflash.engine.generate import COMPARING

            click.echo(COMPARING, err=True)
        plain = _plain_run(client, text, job, res)
    _finish(res, as_json, show_stats, text_shown=text_shown, plain=plain)


def _plain_run(client: DFlashClient, text: str, job: dict, res: Result) -> dict:
    """The same prompt decoded plainly (window 1, the prefix cache bypassed so the first job's
    snapshots neither help nor change): its speed against `res`'s, and whether the ids agree."""
    sampling = res.stats.get("sampling") or {}
    seeded = {**job, "temperature": sampling.get("temperature"), "top_p": sampling.get("top_p"),
              "top_k": sampling.get("top_k"), "seed": sampling.get("seed"), "min_p": sampling.get("min_p"),
              "min_tokens_to_keep": sampling.get("min_tokens_to_keep")}
    try:
        other = client.generate(text, cache="bypass", verify_window=1, **seeded)
    except KeyboardInterrupt:
        click.echo(f"{interrupted_lead()}dflash-client: cancelled the plain run", err=True)
        sys.exit(130)
    except E.DFlashError as e:
        _fail(e)
    from dflash.engine.generate import plain_comparison

    return plain_comparison(res.token_ids, res.stats, other.token_ids, other.stats,
                            greedy=not sampling.get("temperature"))


def _stats_line(res: Result) -> None:
    """The stats line, then for a sampled job the sampling it ran with (its seed, drawn by the
    worker when none was sent: what repeats the job)."""
    from dflash.engine.generate import format_stats, sampling_line

    click.echo(format_stats({**res.stats, "finish_reason": res.finish_reason}), err=True)
    line = sampling_line(res.stats.get("sampling") or {})
    if line:
        click.echo(line, err=True)


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats).")
@click.option("--stats", "show_stats", is_flag=True, help="Print the job's stats line on stderr.")
@click.pass_obj
def result(client: DFlashClient, job_id, as_json, show_stats):
    """Wait for job JOB_ID and print its text, as `prompt` does (e.g. the job a worker_gone error
    names: held since its client left, it runs now). Ctrl-C stops waiting, not the job."""
    try:
        res = client.job(job_id).result()
    except KeyboardInterrupt:
        click.echo(f"{interrupted_lead()}dflash-client: stopped waiting; job {job_id} goes on (dflash-client cancel {job_id} "
                   "stops it)", err=True)
        sys.exit(130)
    except E.DFlashError as e:
        _fail(e)
    _finish(res, as_json, show_stats, text_shown=False, waited=True)


def _finish(res: Result, as_json: bool, show_stats: bool, text_shown: bool | None,
            plain: dict | None = None, waited: bool = False) -> None:
    """Print a finished job (its text unless already streamed, or one JSON object; the stats line
    and the plain comparison on stderr) and exit 124 when it hit its time limit. `text_shown`:
    True streamed (a newline ends it), None streamed and ended, False print it now. `waited`: a
    `result`, which another client streamed (its going away cancels the job too)."""
    if as_json:
        out = {"job_id": res.job_id, "text": res.text, "token_ids": res.token_ids,
               "finish_reason": res.finish_reason, "stats": res.stats}
        click.echo(json.dumps(out if plain is None else {**out, "plain": plain}))
    elif text_shown is not None:
        click.echo("" if text_shown else res.text)
    if show_stats:
        _stats_line(res)
    if plain is not None and not as_json:
        from dflash.engine.generate import comparison_line

        click.echo(comparison_line(plain, res.stats.get("decode_tps", 0.0)), err=True)
    if res.finish_reason == "timeout":
        sys.exit(124)
    if res.finish_reason == "cancelled":  # exit 0 let a script take the cut text as the answer
        who = ("dflash-client cancel, another client, or the client streaming it went away" if waited
               else "dflash-client cancel, or another client")
        click.echo(f"dflash-client: job {res.job_id} was cancelled ({who}): the text is cut short", err=True)
        sys.exit(6)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status(client: DFlashClient, as_json):
    """Worker health and counters."""
    try:
        st = client.stats()
    except E.DFlashError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    for key in ("state", "pid", "endpoint", "accel", "uptime_s", "queued", "running", "held", "jobs_done",
                "jobs_failed", "jobs_cancelled", "tokens_generated", "restarts"):
        click.echo(f"{key:18} {st.get(key)}")
    for note in store_notes(st):
        click.echo(f"{'job store note':18} {note}")
    for line in cache_lines(st.get("cache")):
        click.echo(line)


def store_notes(st: dict) -> list[str]:
    """Lines about damaged job stores the worker replaced, for as long as the damaged copy is kept
    (shared with `dflashd start` and `dflashd status`)."""
    return [P.damaged_store_line(n, "job store", "jobs and results") for n in st.get("job_store") or ()]


def cache_lines(cache: dict | None) -> list[str]:
    """Human lines for the `cache` map of the worker's stats (shared with `dflashd status`)."""
    if not cache or not cache.get("enabled"):
        return [f"{'cache':18} off"]
    l1, l2 = cache.get("l1", {}), cache.get("l2", {})
    return [
        f"{'cache':18} L2 {'up' if cache.get('l2_up') else 'DOWN (serving from L1)'} at {cache.get('endpoint')}",
        f"{'cache hits':18} {cache.get('hits', 0)} of {cache.get('lookups', 0)} lookups "
        f"({cache.get('hit_tokens', 0)} prompt tokens reused; L1 {l1.get('hits', 0)}, L2 {l2.get('hits', 0)})",
        f"{'cache L1':18} {l1.get('entries', 0)} entries, {_mib(l1.get('bytes', 0))}, {l1.get('evictions', 0)} evictions",
        f"{'cache L2':18} {l2.get('entries', 0)} entries, {_mib(l2.get('bytes', 0))}, {l2.get('evictions', 0)} evictions",
        *(f"{'cache note':18} {note}" for note in cache.get("notes", ())),
    ]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cache_detail_lines(cache: dict | None) -> list[str]:
    """What `cache show` adds to the status lines: traffic, write-behind, the L2 budget, the
    cache process's own counters and the position lists (which a clear keeps)."""
    if not cache or not cache.get("enabled"):
        return []
    proc = cache.get("l2_process") or {}
    lines = [
        f"{'cache snapshots':18} {cache.get('inserts', 0)} taken; {cache.get('misses', 0)} lookups found none",
        f"{'cache L2 writes':18} {cache.get('l2_writes', 0)} written, {cache.get('l2_dropped_writes', 0)} dropped "
        f"({cache.get('l2_lost_writes', 0)} of them lost from both tiers), {cache.get('l2_too_large', 0)} too large "
        f"for L2, {cache.get('l2_discarded_writes', 0)} of discarded snapshots",
        f"{'cache dropped':18} {cache.get('corrupt_dropped', 0)} corrupt, {cache.get('mismatch_dropped', 0)} not "
        f"fitting the model",
        f"{'cache L1 vs L2':18} {cache.get('l2_evicted_in_l1', 0)} L1 entries found gone from L2, written again "
        f"when L1 evicts them ({cache.get('l2_store_changed', 0)} store changes, "
        f"{cache.get('l2_unanswered_writes', 0)} unanswered writes)",
    ]
    if proc:
        lines += [
            f"{'cache L2 budget':18} {_mib(proc.get('bytes', 0))} of {_mib(proc.get('size_limit', 0))}",
            f"{'cache L2 process':18} " + ", ".join(f"{proc.get(k, 0)} {k.replace('_', ' ')}" for k in (
                "hits", "misses", "puts", "too_large", "write_errors", "orphans_removed"))
            + "".join(f", {proc[k]} {k.replace('_', ' ')}" for k in ("missing_files", "unrecorded_reads")
                      if proc.get(k)),  # rare (files deleted outside dflash, a full disk): shown when they happen
            f"{'position lists':18} {cache.get('position_lists', 0)} (kept by `cache clear`)",
        ]
    return lines


def cleared_lines(data: dict) -> list[str]:
    """A cache_clear answer in words: what each tier dropped and the position lists kept."""
    l1, l2 = data.get("l1") or {}, data.get("l2") or {}
    lines = [f"{'cleared L1':18} {l1.get('entries', 0)} entries, {_mib(l1.get('bytes', 0))}"]
    if data.get("l2_up"):
        lines += [f"{'cleared L2':18} {l2.get('entries', 0)} entries, {_mib(l2.get('bytes', 0))}",
                  f"{'position lists':18} {data.get('position_lists', 0)} kept"]
    return lines


@main.group()
def positions():
    """Named sparse-prefill position lists (kept by the cache process, shared by every app)."""


@positions.command("put")
@click.argument("name")
@click.argument("spec", callback=_positions)
@click.pass_obj
def positions_put(client: DFlashClient, name, spec):
    """Store SPEC, prompt token indices such as '0-63,128-255', under NAME."""
    _print(lambda: client.put_positions(name, spec))


@positions.command("get")
@click.argument("name")
@click.pass_obj
def positions_get(client: DFlashClient, name):
    """Print the list stored under NAME (JSON)."""
    _print(lambda: client.get_positions(name))


@positions.command("list")
@click.pass_obj
def positions_list(client: DFlashClient):
    """Print the stored lists' names (JSON)."""
    _print(client.list_positions)


@positions.command("delete")
@click.argument("name")
@click.pass_obj
def positions_delete(client: DFlashClient, name):
    """Delete the list stored under NAME."""
    _print(lambda: {"name": name, "deleted": client.delete_positions(name)})


def _print(call) -> None:
    try:
        click.echo(json.dumps(call()))
    except E.DFlashError as e:
        _fail(e)


@main.group(invoke_without_command=True)
@click.pass_context
def cache(ctx: click.Context):
    """The prefix cache: `cache` or `cache show` prints its state, `cache clear` empties it."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(cache_show)


@cache.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print the cache section of the worker's stats.")
@click.pass_obj
def cache_show(client: DFlashClient, as_json: bool = False):
    """Entries, bytes, hits and evictions per tier (as `status`), then traffic and L2 detail."""
    try:
        st = client.stats()
    except E.DFlashError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(st.get("cache"), indent=2))
        return
    lines = cache_lines(st.get("cache"))
    if (st.get("cache") or {}).get("enabled") and not st["cache"].get("l2_up"):
        from dflash.daemon.supervisor import child_error, live_pid

        try:  # why, when the daemon's supervisor runs here (as `dflashd status` says it)
            run_dir = client._cfg.runtime_path()
            why = child_error(run_dir, live_pid(run_dir), "cache", client.endpoint)
        except OSError:
            why = None
        if why:
            lines[0] += f"; stopped: {why}"
    for line in lines + cache_detail_lines(st.get("cache")):
        click.echo(line)


@cache.command("clear")
@click.option("--json", "as_json", is_flag=True, help="Print the worker's answer as JSON.")
@click.pass_obj
def cache_clear(client: DFlashClient, as_json: bool):
    """Drop every prompt snapshot, in the worker's RAM (L1) and on disk (L2); named position lists
    are kept. A running job finishes its prefill first. Output is the same as before, only the
    next prompts prefill from scratch."""
    try:
        data = client.clear_cache()
    except E.DFlashError as e:
        _fail(e)
    click.echo(json.dumps(data) if as_json else "\n".join(cleared_lines(data)))
    if not data.get("l2_up"):
        click.echo("dflash-client: the cache process (L2) did not answer: its snapshots were not cleared "
                   "(it restarts by itself; retry)", err=True)
        sys.exit(1)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def jobs(client: DFlashClient, as_json):
    """Running and queued jobs, in run order."""
    try:
        rows = client.jobs()
    except E.DFlashError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no jobs")
    for r in rows:
        click.echo(f"{r['job_id']}  {r['state']:8} pos {r['position']:3}  prio {r['priority']:4}  "
                   f"max_tokens {r['max_tokens']}  attempts {r['attempts']}")


@main.command()
@click.argument("job_id")
@click.pass_obj
def cancel(client: DFlashClient, job_id):
    """Cancel a job by id."""
    try:
        click.echo(json.dumps(client.cancel(job_id)))
    except E.DFlashError as e:
        _fail(e)


if __name__ == "__main__":
    main()
