"""`dflash`: generate (and benchmark, import, train-draft) from the command line."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, NoReturn

import click

from dflash.daemon.cli import ShownFloat, ShownFloatRange, ShownInt, ShownIntRange

from .bench.cli import benchmark_command, finite_option, window_option
from .tiny import ARCH_CONFIGS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx: click.Context) -> None:
    """DFlash block-diffusion speculative decoding on MLX: the target's own output (greedy, or exact sampling), faster."""
    if ctx.invoked_subcommand == "generate" and sys.stdout is None:  # started with `>&-`
        raise BadInput("stdout is closed: there is nowhere to print the text")
    if ctx.invoked_subcommand in ("generate", "benchmark", "train-draft", "eval-draft"):
        from .accel import maybe_reexec

        maybe_reexec()  # a fast BLAS for MLX's CPU backend, when installed ($DFLASH_BLAS=none: off)


def _stops(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """An empty stop sequence would be silently ignored: refused instead."""
    if any(s == "" for s in value):
        raise click.BadParameter("a stop sequence cannot be empty")
    for s in value:
        _utf8(ctx, param, s)
    return value


def _utf8(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse an argument that was not UTF-8 on the command line: Python keeps such bytes as lone
    surrogates, which the tokenizer fails on with a traceback (a stop string would never match)."""
    if value is not None and (problem := utf8_problem(value)) is not None:
        raise click.BadParameter(problem)
    return value


def utf8_problem(text: str) -> str | None:
    """Why `text` (from argv or stdin) is not UTF-8 text, naming the first bad byte; None if it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else ascii(text[e.start])
        return f"not UTF-8 text ({byte} at character {e.start}); convert it first, e.g. with iconv -t UTF-8"
    return None


class BadInput(click.ClickException):
    """No prompt on stdin (closed), or one that is not UTF-8: exit 2, as for an option's bad value."""

    exit_code = 2


def _bias(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[int, float] | None:
    from .processors import parse_bias_flags

    try:
        return parse_bias_flags(values)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _processor(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A penalty or its context size checked by the engine's own rule (ProcessorParams) as the
    option is parsed: a usage error (exit 2) before the model loads, not a failure after it."""
    from .processors import ProcessorParams

    if value is not None:
        try:
            ProcessorParams(**{param.name: value})
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def _kv_bits(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    from .rollback import kv_bits_problem  # the one rule, imported only when the option is given

    if value is not None and (problem := kv_bits_problem(value)) is not None:
        raise click.BadParameter(problem)
    return value


@main.command()
@click.option("--model", "model_path", required=True, help="Target model directory (mlx-lm format).")
@click.option("--draft", "draft_path", default=None, help="Draft directory; omitted: resolved from the registry.")
@click.option("--prompt", "-p", default=None, callback=_utf8, help="Prompt text; '-' or omitted reads stdin.")
@click.option("--max-tokens", "-m", default=256, show_default=True, type=ShownIntRange(1))
@click.option("--system", default=None, callback=_utf8, help="System message (chat models).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--stop", multiple=True, callback=_stops, help="Stop sequence (repeatable).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None, help="Cast target and draft (CPU: float32 is fastest).")
@click.option("--kv-bits", type=ShownInt(), default=None, callback=_kv_bits,
              help="Quantize the target's KV cache to this many bits (2, 3, 4, 5, 6 or 8).")
@click.option("--verify-window", default="auto", show_default=True, callback=window_option,
              help="Tokens per verify: auto, full, or 1..block size (1 = plain decoding).")
@click.option("--copy-draft/--no-copy-draft", default=True, show_default=True,
              help="When the text repeats itself, verify a copy of what followed its last tokens instead of the draft's block, where that is expected to pay.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats, sampling).")
@click.option("--temperature", "-t", type=ShownFloatRange(min=0), default=0.0, show_default=True,
              callback=finite_option, help="Sampling temperature; 0 = greedy (lossless: the target's argmax).")
@click.option("--top-p", type=ShownFloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              callback=finite_option,
              help="Nucleus sampling (with --temperature > 0): keep the smallest set of tokens with this mass; 1 = off.")
@click.option("--top-k", type=ShownIntRange(min=0), default=0, show_default=True,
              help="Sampling (with --temperature > 0): keep the k most likely tokens; 0 = off.")
@click.option("--min-p", type=ShownFloatRange(0, 1), default=0.0, show_default=True, callback=finite_option,
              help="Sampling (with --temperature > 0): keep the tokens at least this fraction as likely as the "
                   "most likely one; 0 = off.")
@click.option("--min-tokens-to-keep", type=ShownIntRange(min=1), default=1, show_default=True,
              help="With --min-p: the number of most likely tokens min-p always keeps (mlx-lm's min_tokens_to_keep).")
@click.option("--logit-bias", multiple=True, callback=_bias, metavar="ID=BIAS",
              help="Add BIAS to token ID's logit (repeatable; mlx-lm's logits processors, greedy or sampled).")
@click.option("--repetition-penalty", type=ShownFloat(), default=None, callback=_processor,
              help="mlx-lm's repetition penalty (> 0; 1 = off) over the last --repetition-context-size tokens.")
@click.option("--repetition-context-size", type=ShownIntRange(min=1), default=20, show_default=True,
              callback=_processor)
@click.option("--presence-penalty", type=ShownFloat(), default=None, callback=_processor,
              help="Subtracted once from each token of the last --presence-context-size (0 = off).")
@click.option("--presence-context-size", type=ShownIntRange(min=1), default=20, show_default=True,
              callback=_processor)
@click.option("--frequency-penalty", type=ShownFloat(), default=None, callback=_processor,
              help="Subtracted per occurrence in the last --frequency-context-size (0 = off).")
@click.option("--frequency-context-size", type=ShownIntRange(min=1), default=20, show_default=True,
              callback=_processor)
@click.option("--seed", type=ShownIntRange(0, (1 << 64) - 1), default=None,
              help="Random seed for sampling; default: a random one, printed. The same seed repeats the same ids under a fixed --verify-window (auto follows timings).")
@click.option("--compare-plain", is_flag=True,
              help="Then decode the same prompt plainly (verify window 1) and print the measured speedup and "
                   "whether the tokens are the same (--json: under 'plain').")
def generate(model_path, draft_path, prompt, max_tokens, system, raw, stop, dtype, kv_bits, verify_window, copy_draft,
             as_json, temperature, top_p, top_k, min_p, min_tokens_to_keep, seed, compare_plain, **processors):
    """Generate with DFlash (greedy by default); prints text as it streams, then the stats.

    Ctrl-C stops after the current cycle and still prints the stats (--json: the JSON so far,
    finish_reason "cancelled"), exit status 130; a second Ctrl-C quits at once.
    """
    from .generate import COMPARING, context_problem, context_tokens, format_stats, plain_comparison
    from .loading import load_pair
    from .processors import ProcessorParams
    from .prompting import build_prompt

    if system is not None and raw:
        raise click.UsageError("--system goes into the chat template, which --raw leaves out")
    if temperature > 0 and seed is None:  # drawn here and reported, so the run can be repeated
        import secrets

        seed = secrets.randbits(63)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed, "min_p": min_p,
                "min_tokens_to_keep": min_tokens_to_keep}
    reported = {**sampling, **ProcessorParams(**processors).reported()}  # as the daemon's done.stats has it
    plain, shown = None, False  # shown: the DFlash run's stats line is printed already
    try:
        prompt = _read_prompt(prompt)
        if not prompt.strip():  # refused before the model loads, exit 2, as dflash-client's bad_request
            raise BadInput("empty prompt: give --prompt TEXT, or pipe it on stdin")
        pair = load_pair(model_path, draft_path, dtype=dtype)
        _check_pair(pair, compare_plain)
        ids = build_prompt(pair.tokenizer, prompt, system=system, raw=raw)
        if (problem := context_problem(len(ids), context_tokens(pair.target))) is not None:
            raise BadInput(problem)  # the daemon's rule and words: it refuses the same prompt
        common = dict(stop=stop, kv_bits=kv_bits, **sampling, **processors)
        with CtrlC() as cancel:
            final = _decode(pair, ids, max_tokens, not as_json, cancel, verify_window=verify_window,
                            copy_draft=copy_draft, **common)
            if compare_plain and not cancel.hit:
                if not as_json:
                    click.echo()
                    click.echo(format_stats(final.stats.to_dict()), err=True)
                    click.echo(COMPARING, err=True)
                    shown = True
                other = _decode(pair, ids, max_tokens, False, cancel, verify_window=1, **common)
                if not cancel.hit:
                    plain = plain_comparison(final.token_ids, final.stats.to_dict(), other.token_ids,
                                             other.stats.to_dict(), greedy=temperature == 0)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:  # a second Ctrl-C, or one while loading: what streamed stays on screen
        click.echo("\ncancelled", err=True)
        sys.exit(130)
    except BrokenPipeError:  # `| head` has read enough: decoding stopped with the failed write
        output_closed()
    try:
        _report(final, plain, reported, as_json, shown)
    except BrokenPipeError:
        output_closed()
    if cancel.hit:
        click.echo("cancelled", err=True)
        sys.exit(130)


def _check_pair(pair: Any, compare_plain: bool) -> None:
    """What the loaded pair cannot do, refused before any token (ValueError): a plain run on a
    sliding-window target would fail only after the DFlash run, losing its result (a system
    message without a chat template: build_prompt refuses it)."""
    from .rollback import plain_step_undoable

    if compare_plain and not plain_step_undoable(pair.target.make_cache()):
        raise ValueError("--compare-plain decodes plainly (verify window 1), which this target cannot: "
                         "its sliding-window cache cannot undo a single token")


def _report(final: Any, plain: dict | None, sampling: dict, as_json: bool, shown: bool) -> None:
    """The JSON object, or the stats / comparison lines on stderr (`shown`: the stats line is
    out already, before the plain run)."""
    from .generate import comparison_line, format_stats, sampling_line

    s = final.stats
    if as_json:
        out = {"text": final.text, "token_ids": final.token_ids, "stats": s.to_dict(), "sampling": sampling}
        click.echo(json.dumps(out if plain is None else {**out, "plain": plain}))
        return
    if plain is not None:
        click.echo(comparison_line(plain, s.decode_tps), err=True)
    elif not shown:
        click.echo()
        click.echo(format_stats(s.to_dict()), err=True)
    if sampling["temperature"] > 0:
        click.echo(sampling_line(sampling), err=True)


def _read_prompt(prompt: str | None) -> str:
    """The prompt as given, or stdin's text for '-' or none (a terminal is told so: a bare
    `dflash generate --model M` would look hung), as UTF-8 strictly: never guessed at."""
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise BadInput("no prompt: give --prompt, or pipe it on stdin (stdin is closed)")
    if sys.stdin.isatty():
        click.echo("[dflash] reading the prompt from stdin (end it with Ctrl-D)", err=True)
    data = sys.stdin.buffer.read()
    try:  # newlines as text-mode stdin read them before (universal newlines)
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise BadInput(f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                      "convert it first, e.g. with iconv -t UTF-8") from None


def output_closed() -> NoReturn:
    """stdout's reader went away (`| head`): one line and exit 141 (128 + SIGPIPE, as a shell
    reports a command a closed pipe stopped), not click's silent exit 1. What is left unwritten
    goes to /dev/null, so the interpreter's last flush cannot fail too (exit status 120); stderr
    may be the same closed pipe, so its line is best effort."""
    _to_devnull(sys.stdout)
    try:
        sys.stderr.write("dflash: stdout was closed before all output was written; generation stopped\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        _to_devnull(sys.stderr)
    sys.exit(141)


def _to_devnull(stream: Any) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


class CtrlC:
    """SIGINT while decoding: the first one asks the generator to stop after its cycle, so the
    tokens so far and their stats are still reported; the second interrupts at once."""

    def __init__(self) -> None:
        self.hit = False
        self._old: Any = None

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():  # only there can it be set
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def __call__(self) -> bool:
        return self.hit

    def _handle(self, signum: int, frame: Any) -> None:
        self.hit = True
        signal.signal(signal.SIGINT, self._old)
        click.echo("\n[dflash] stopping after this cycle (Ctrl-C again: at once)", err=True)


def _decode(pair: Any, ids: list[int], max_tokens: int, echo: bool, cancel: Callable[[], bool],
            **kwargs: Any) -> Any:
    """One generation to its Finished event, echoing the text as it streams when `echo`."""
    from .generate import Finished, stream_dflash_generate

    final = None
    for ev in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, max_tokens,
                                     should_cancel=cancel, **kwargs):
        if isinstance(ev, Finished):
            final = ev
        elif echo:
            click.echo(ev.text, nl=False)
            sys.stdout.flush()
    return final


@main.command("make-tiny")
@click.argument("out_dir")
@click.option("--arch", type=click.Choice(list(ARCH_CONFIGS)), default="qwen3", show_default=True,
              help="Tiny target family.")
@click.option("--draft-layers", default=1, show_default=True,  # 100000 was killed for memory, not a word
              type=ShownIntRange(1, min(c["num_hidden_layers"] for c in ARCH_CONFIGS.values())),
              help="Layers of the random draft (at most the tiny target's).")
@click.option("--force", is_flag=True, help="Replace OUT_DIR when it exists and is not empty.")
def make_tiny(out_dir: str, arch: str, draft_layers: int, force: bool) -> None:
    """Write a tiny random-weight target (OUT_DIR) and draft (OUT_DIR/draft) for trying things."""
    from .convert import staging
    from .launch import stops_once
    from .tiny import build_draft, build_target

    out = _tiny_out(out_dir, force)
    try:  # SIGTERM as Ctrl-C: killed outright, it left the hidden staging folder behind
        with stops_once(), staging(out) as tmp:  # built beside OUT_DIR, renamed into place
            build_target(tmp, arch)
            build_draft(tmp / "draft", tmp, num_layers=draft_layers)
    except KeyboardInterrupt:
        click.echo("cancelled (nothing written)", err=True)
        sys.exit(130)
    except OSError as e:  # a folder that cannot be written (read-only, /proc, a full disk)
        raise click.ClickException(f"cannot write {out_dir}: {e.strerror or e} (nothing written)") from None
    draft = str(Path(out_dir) / "draft")
    click.echo(f"tiny {arch} target in {out_dir}, draft in {draft} (random weights); try:\n"
               f"  dflash generate --model {shlex.quote(out_dir)} --draft {shlex.quote(draft)} -p Hello -m 32")


def _tiny_out(out_dir: str, force: bool) -> Path:
    """OUT_DIR absolute, refused when it is a file or (without --force) a folder with files: a
    tiny model written over a real one would destroy it. An empty OUT_DIR (an unset variable)
    would be the current directory."""
    if not out_dir.strip():
        raise click.BadParameter("must name the folder to write, not be empty", param_hint="OUT_DIR")
    out = Path(out_dir).absolute()
    if out.exists() and not out.is_dir():
        raise click.ClickException(f"{out_dir} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise click.ClickException(f"{out_dir} exists and is not empty (add --force to replace it)")
    if out.is_dir() and Path.cwd().resolve().is_relative_to(out.resolve()):
        raise click.ClickException(f"{out_dir} holds the current directory; refusing to replace it")
    above = next(d for d in out.parents if d.exists())
    if not above.is_dir():
        raise click.ClickException(f"{out_dir} cannot be made: {above} is not a folder")
    return out


main.add_command(benchmark_command)


from .convert import import_command  # noqa: E402
from .training.loop import train_draft_command  # noqa: E402
from .training.report import eval_draft_command  # noqa: E402
from .training.vocab import draft_vocab_command  # noqa: E402

main.add_command(import_command)
main.add_command(train_draft_command)
main.add_command(eval_draft_command)
main.add_command(draft_vocab_command)

try:  # the gateway needs pyzmq + the HTTP stack; the engine commands must not
    from dflash.daemon.gateway import serve_command  # noqa: E402
except ImportError:  # pragma: no cover (e.g. a bare GPU box with only MLX staged)
    serve_command = None

if serve_command is not None:
    main.add_command(serve_command)

if __name__ == "__main__":
    main()
