"""`dflash`: generate (and benchmark, import, train-draft) from the command line."""

from __future__ import annotations

import json
import math
import sys

import click



@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def main(ctx: click.Context) -> None:
    """DFlash block-diffusion speculative decoding on MLX: the target's own output (greedy, or exact sampling), faster."""
    if ctx.invoked_subcommand in ("generate", "benchmark", "train-draft", "eval-draft"):
        from .accel import maybe_reexec

        maybe_reexec()  # a fast BLAS for MLX's CPU backend, when installed ($DFLASH_BLAS=none: off)


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def _kv_bits(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    from .rollback import kv_bits_problem  # the one rule, imported only when the option is given

    if value is not None and (problem := kv_bits_problem(value)) is not None:
        raise click.BadParameter(problem)
    return value


@main.command()
@click.option("--model", "model_path", required=True, help="Target model directory (mlx-lm format).")
@click.option("--draft", "draft_path", default=None, help="Draft directory; omitted: resolved from the registry.")
@click.option("--prompt", "-p", default=None, help="Prompt text; '-' or omitted reads stdin.")
@click.option("--max-tokens", "-m", default=256, show_default=True, type=click.IntRange(1))
@click.option("--system", default=None, help="System message (chat models).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--stop", multiple=True, help="Stop sequence (repeatable).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None, help="Cast target and draft (CPU: float32 is fastest).")
@click.option("--kv-bits", type=int, default=None, callback=_kv_bits,
              help="Quantize the target's KV cache to this many bits (2, 3, 4, 5, 6 or 8).")
@click.option("--verify-window", default="auto", show_default=True, help="Tokens per verify: auto, full, or 1..block size (1 = plain decoding).")
@click.option("--copy-draft/--no-copy-draft", default=True, show_default=True,
              help="When the text repeats itself, verify a copy of what followed its last tokens instead of the draft's block, where that is expected to pay.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token ids, stats, sampling).")
@click.option("--temperature", "-t", type=click.FloatRange(min=0), default=0.0, show_default=True,
              callback=_finite, help="Sampling temperature; 0 = greedy (lossless: the target's argmax).")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Nucleus sampling: keep the smallest set of tokens with this mass; 1 = off.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep the k most likely tokens; 0 = off.")
@click.option("--seed", type=click.IntRange(0, (1 << 64) - 1), default=None,
              help="Random seed for sampling; default: a random one, printed. The same seed repeats the same ids under a fixed --verify-window (auto follows timings).")
@click.option("--compare-plain", is_flag=True,
              help="Then decode the same prompt plainly (verify window 1) and print the measured speedup and "
                   "whether the tokens are the same (--json: under 'plain').")
def generate(model_path, draft_path, prompt, max_tokens, system, raw, stop, dtype, kv_bits, verify_window, copy_draft,
             as_json, temperature, top_p, top_k, seed, compare_plain):
    """Generate with DFlash (greedy by default); prints text as it streams, then the stats."""
    from .generate import (COMPARING, Finished, comparison_line, format_stats, plain_comparison, sampling_line,
                           stream_dflash_generate)
    from .loading import load_pair
    from .prompting import build_prompt

    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if temperature > 0 and seed is None:  # drawn here and reported, so the run can be repeated
        import secrets

        seed = secrets.randbits(63)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    try:
        pair = load_pair(model_path, draft_path, dtype=dtype)
        ids = build_prompt(pair.tokenizer, prompt, system=system, raw=raw)
        final = None
        for ev in stream_dflash_generate(
            pair.target, pair.drafter, pair.tokenizer, ids, max_tokens, stop=stop, kv_bits=kv_bits,
            verify_window=verify_window, copy_draft=copy_draft, **sampling,
        ):
            if isinstance(ev, Finished):
                final = ev
            elif not as_json:
                click.echo(ev.text, nl=False)
                sys.stdout.flush()
        plain = None
        if compare_plain:
            if not as_json:
                click.echo()
                click.echo(format_stats(final.stats.to_dict()), err=True)
                click.echo(COMPARING, err=True)
            other = None
            for ev in stream_dflash_generate(pair.target, pair.drafter, pair.tokenizer, ids, max_tokens, stop=stop,
                                             kv_bits=kv_bits, verify_window=1, **sampling):
                other = ev if isinstance(ev, Finished) else other
            plain = plain_comparison(final.token_ids, final.stats.to_dict(), other.token_ids,
                                     other.stats.to_dict(), greedy=temperature == 0)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:  # Ctrl-C: what streamed stays on screen; exit as a shell expects
        click.echo("\ncancelled", err=True)
        sys.exit(130)
    s = final.stats
    if as_json:
        out = {"text": final.text, "token_ids": final.token_ids, "stats": s.to_dict(), "sampling": sampling}
        click.echo(json.dumps(out if plain is None else {**out, "plain": plain}))
        return
    if plain is None:
        click.echo()
        click.echo(format_stats(s.to_dict()), err=True)
    else:
        click.echo(comparison_line(plain, s.decode_tps), err=True)
    if temperature > 0:
        click.echo(sampling_line(sampling), err=True)


@main.command("make-tiny")
@click.argument("out_dir")
@click.option("--arch", default="qwen3", show_default=True, help="Tiny target family.")
@click.option("--draft-layers", default=1, show_default=True)
def make_tiny(out_dir, arch, draft_layers):
    """Write a tiny random-weight target (OUT_DIR) and draft (OUT_DIR/draft) for trying things."""
    from pathlib import Path

    from .tiny import build_draft, build_target

    out = Path(out_dir)
    build_target(out, arch)
    build_draft(out / "draft", out, num_layers=draft_layers)
    click.echo(f"tiny {arch} target in {out}, draft in {out / 'draft'} (random weights)")


from .benchmark import benchmark_command  # noqa: E402

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
