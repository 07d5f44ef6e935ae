"""`dflash draft-vocab`: rank the tokens of a training data cache's answers into a draft's
draft_vocab.json (engine/draftvocab.py says why a draft proposes only its frequent tokens)."""

from __future__ import annotations

from pathlib import Path

import click

from .. import draftvocab
from . import data as td


def rank_samples(samples: list[td.Sample]) -> tuple[list[int], int]:
    """(ranked ids, tokens counted) over the answers of the training samples."""
    return draftvocab.rank(s.response_ids for s in samples if s.split == "train")


def rank_cache(data_dir: str | Path, kind: str = "all") -> tuple[list[int], int, int]:
    """(ranked ids, tokens counted, responses used) over the cached answers of `kind`."""
    samples = td.load_all_samples(Path(data_dir))
    if not samples:
        raise ValueError(f"no responses*.jsonl with answers in {data_dir}")
    samples = td.responses_of_kind(samples, kind)
    return (*rank_samples(samples), len(samples))


def check_draft(draft: str | Path) -> None:
    """Refuse a folder that is not a DFlash draft, by the draft loader's own reading of its
    config.json (draft.read_config): a target model's folder has a config.json too, and a
    draft_vocab.json written into it would be read by nothing."""
    from ..draft import read_config

    cfg_file = Path(draft) / "config.json"
    if not cfg_file.is_file():
        raise click.ClickException(f"no draft in {draft} (no config.json)")
    try:
        read_config(draft)
    except OSError as e:
        raise click.ClickException(f"cannot read {cfg_file}: {e.strerror or e}") from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@click.command("draft-vocab")
@click.option("--data", "data_dir", required=True, help="A training data cache (responses*.jsonl, as train-draft writes it).")
@click.option("--draft", required=True, help="The draft directory to write draft_vocab.json into.")
@click.option("--size", default=draftvocab.DEFAULT_SIZE, show_default=True, type=click.IntRange(0), help="Default number of tokens the draft proposes on the CPU (0: all).")
@click.option("--responses", default="all", show_default=True, type=click.Choice(["all", "greedy", "sampled"]), help="Which cached answers are counted.")
def draft_vocab_command(data_dir, draft, size, responses):
    """Rank the target's answer tokens by frequency into DRAFT/draft_vocab.json."""
    check_draft(draft)  # before the cache is read, not after
    path = Path(draft) / draftvocab.FILE
    had = path.is_file()
    try:
        ranked, total, n = rank_cache(data_dir, responses)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # an unreadable cache file: one line naming it
        raise click.ClickException(f"cannot read {e.filename or data_dir}: {e.strerror or e}") from None
    try:
        draftvocab.write(draft, ranked, size, f"{n} {responses} responses of {data_dir}", total)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # a read-only draft folder, a full disk: write leaves no draft_vocab.tmp
        raise click.ClickException(f"cannot write {path}: {e.strerror or e}") from None
    click.echo(f"{path}{' (replaced the earlier one)' if had else ''}: {len(ranked)} distinct tokens "
               f"ranked from {total} answer tokens of {n} responses; default size {size or 'all'}")
