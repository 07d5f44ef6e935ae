"""The campaign's data cache on a lent GPU: unpack the staged parts, and pack what changed.

The data cache (prompts and responses, JSONL, ~300 MB) travels as xz parts of <= 15 MB (the
device tool brings back 8 files of 16 MiB a call). A session stages the base parts
(`campaign-data.tar.xz.NN`, a whole cache) and any deltas (`campaign-delta-<UTC>.tar.xz.NN`);
`unpack` rebuilds the cache from them, and `pack-delta` brings back only what the session added.
Session 49 packed the whole cache in the call that also trained; the call ended at the tool's
600 s two parts in, the new answers were last in the tar, and they were lost.

A delta holds, for each file that grew, its new bytes as `NAME.from-SIZE` (up to the last
newline: a line being appended is left for the next delta), a new or rewritten file whole, and
`.base`: the id of the base cache it continues (a delta found over another base is skipped). A
delta's bytes may overlap what the cache already has (two deltas of one session both start at
the staged size): the overlap must match, and only the rest is appended. `unpack` is all or
nothing: the cache is built beside `data/` and moved into place once every part has been read,
so a failed unpack leaves no half-built cache for a job to write into.

    python3 scripts/campaign_data.py unpack --stage /tmp/stage/files --train /tmp/train_out
    python3 scripts/campaign_data.py pack-delta --train /tmp/train_out --out $OUT
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import BinaryIO, Iterator

PART_BYTES = 15_000_000
LISTING = ".unpacked"  # in data/: the base id and each file's size and md5 when unpacked
BASE = ".base"  # in a delta's data/: the base id it continues


class Refused(Exception):
    """The staged parts cannot make a cache: what is wrong, for the job's log."""


class Parts(io.RawIOBase):
    """The concatenation of a set's part files, read as one stream (cat parts | xz -d)."""

    def __init__(self, files: list[Path]):
        self._files = iter(files)
        self._now: BinaryIO | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:  # type: ignore[no-untyped-def]
        while True:
            if self._now is None:
                nxt = next(self._files, None)
                if nxt is None:
                    return 0
                self._now = nxt.open("rb")
            n = self._now.readinto(buf)
            if n:
                return n
            self._now.close()
            self._now = None


def sets(stage: Path, pattern: str) -> dict[str, list[Path]]:
    """The staged sets matching `pattern` (e.g. campaign-delta-*), in name order: prefix -> parts."""
    found: dict[str, list[Path]] = {}
    for part in sorted(stage.glob(pattern + ".tar.xz.*")):
        found.setdefault(part.name.rsplit(".tar.xz.", 1)[0], []).append(part)
    return dict(sorted(found.items()))


def read_set(parts: list[Path]) -> dict[str, bytes]:
    """A set's files (name under its data/ -> bytes); ValueError for a set cut short or damaged."""
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BufferedReader(Parts(parts)), mode="r|xz") as tar:
            for m in tar:
                if m.isfile():
                    f = tar.extractfile(m)
                    assert f is not None
                    out[m.name.split("/", 1)[1] if m.name.startswith("data/") else m.name] = f.read()
    except (tarfile.TarError, lzma.LZMAError, EOFError) as e:
        raise ValueError(str(e) or type(e).__name__) from e
    return out


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def listing(data: Path) -> dict[str, list]:
    """Each file of a cache folder (not the listing itself): name -> [size, md5]."""
    return {p.name: [p.stat().st_size, md5(p.read_bytes())]
            for p in sorted(data.iterdir()) if p.is_file() and not p.name.startswith(".")}


def base_id(files: dict[str, list]) -> str:
    return md5(json.dumps(files, sort_keys=True).encode())[:16]


def apply_delta(data: Path, name: str, members: dict[str, bytes], base: str) -> str:
    """Apply one delta set to the cache being built; a line saying what was done or why skipped.
    Every member is checked before any is applied: a set applies whole or not at all."""
    if members.get(BASE, b"").decode() != base:
        return f"skipped {name}: made over another base cache ({members.get(BASE, b'none').decode()}, not {base})"
    plan: list[tuple[Path, bytes, bool]] = []  # (file, bytes, append?)
    for member, blob in sorted(members.items()):
        if member == BASE:
            continue
        if ".from-" in member:
            stem, start = member.rsplit(".from-", 1)
            target, start_at = data / stem, int(start)
            have = target.stat().st_size if target.exists() else -1
            if have < start_at:
                return f"skipped {name}: {stem} continues from byte {start_at}, but the cache has {have} (a delta missing before it)"
            overlap = have - start_at
            with target.open("rb") as f:
                f.seek(start_at)
                if f.read(overlap) != blob[:overlap]:
                    return f"skipped {name}: {stem}'s bytes from {start_at} differ from the cache's"
            plan.append((target, blob[overlap:], True))
        else:
            plan.append((data / member, blob, False))
    for target, blob, append in plan:
        with target.open("ab" if append else "wb") as f:
            f.write(blob)
    return f"applied {name} ({len(plan)} files)"


def unpack(stage: Path, train: Path, log=print) -> bool:
    """Build train/data from the staged base and deltas, once (False: there was nothing to do).
    Raises Refused, leaving train/ as it was, where the base cannot be read."""
    data = train / "data"
    if (data / LISTING).exists():
        return False
    bases = sets(stage, "campaign-data")
    if not bases:
        return False
    if data.exists():
        raise Refused(f"{data} exists but was not unpacked here: move it away first (nothing was overwritten)")
    build = train / ".data.unpacking"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    (prefix, parts), = bases.items()
    try:
        files = read_set(parts)
    except ValueError as e:
        shutil.rmtree(build, ignore_errors=True)
        raise Refused(f"the staged base {prefix} ({len(parts)} parts) cannot be read: {e}") from e
    for member, blob in files.items():
        (build / member).write_bytes(blob)
    for f in build.glob("*.jsonl"):  # a line cut by a pack taken while appending: the trainer drops it too
        blob = f.read_bytes()
        if blob and not blob.endswith(b"\n"):
            f.write_bytes(blob[: blob.rfind(b"\n") + 1])
    base = base_id(listing(build))
    log(f"unpack: {prefix}, {len(files)} files (base {base})")
    for name, parts in sets(stage, "campaign-delta-*").items():
        try:
            members = read_set(parts)
        except ValueError as e:
            log(f"unpack: skipped {name}: cut short or damaged ({e}); a later delta may hold its lines")
            continue
        log("unpack: " + apply_delta(build, name, members, base))
    (build / LISTING).write_text(json.dumps({"base": base, "files": listing(build)}))
    build.rename(data)
    return True


class PartWriter(io.RawIOBase):
    """Bytes written into part files of PART_BYTES (split -b), named prefix.NN."""

    def __init__(self, prefix: Path):
        self.prefix, self.n, self.f, self.left = prefix, 0, None, 0
        self.names: list[Path] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def]
        view, done = memoryview(b), 0
        while done < len(view):
            if self.f is None or self.left == 0:
                if self.f is not None:
                    self.f.close()
                path = Path(f"{self.prefix}.{self.n:02d}")
                self.names.append(path)
                self.f, self.left, self.n = path.open("wb"), PART_BYTES, self.n + 1
            k = min(self.left, len(view) - done)
            self.f.write(view[done:done + k])
            self.left -= k
            done += k
        return done

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        super().close()


def pack_delta(train: Path, out: Path, log=print) -> list[Path]:
    """What the cache gained since `unpack` as a delta set in `out` (no files: nothing new)."""
    data = train / "data"
    known = json.loads((data / LISTING).read_text())
    old: dict[str, list] = known["files"]
    members: dict[str, bytes] = {}
    for p in sorted(data.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        blob = p.read_bytes()
        blob = blob[: blob.rfind(b"\n") + 1] if p.suffix == ".jsonl" else blob  # whole lines only
        was = old.get(p.name)
        if was is None:
            if blob:
                members[p.name] = blob
        elif len(blob) >= was[0] and md5(blob[: was[0]]) == was[1]:
            if len(blob) > was[0]:
                members[f"{p.name}.from-{was[0]}"] = blob[was[0]:]
        else:  # rewritten: whole
            members[p.name] = blob
    if not members:
        log("packdata: nothing changed since the staged cache")
        return []
    members[BASE] = known["base"].encode()
    now = time.time_ns()  # to the microsecond: two packs of one second must not share a name
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9)) + f"-{now // 1000 % 10**6:06d}"
    writer = PartWriter(out / f"campaign-delta-{stamp}.tar.xz")
    with tarfile.open(fileobj=writer, mode="w|xz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(f"data/{name}")
            info.size, info.mtime = len(blob), int(time.time())
            tar.addfile(info, io.BytesIO(blob))
    writer.close()
    for name, blob in members.items():
        log(f"data/{name} {len(blob)}")
    return writer.names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("unpack", help="the staged base and deltas -> TRAIN/data (once)")
    u.add_argument("--stage", type=Path, required=True)
    u.add_argument("--train", type=Path, required=True)
    p = sub.add_parser("pack-delta", help="what TRAIN/data gained since unpack -> OUT (xz parts)")
    p.add_argument("--train", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "unpack":
            unpack(a.stage, a.train)
        else:
            pack_delta(a.train, a.out)
    except Refused as e:
        print(f"unpack: refused: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
