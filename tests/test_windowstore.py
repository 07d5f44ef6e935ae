"""daemon/windowstore.py: the verify window's measurements on disk, per pair and decoding kind.

A worker reads them at load and writes them after each job; whatever is on disk (missing,
corrupt, foreign, out of range) never stops a worker, it only means starting fresh.
"""

from __future__ import annotations

import json
import logging

from dflash.daemon import windowstore
from dflash.engine.window import WindowMemory


def test_round_trip_keeps_each_pair_and_kind(tmp_path):
    a = windowstore.pair_key("models/a", "models/a/draft", "float32", "Device(cpu, 0)")
    b = windowstore.pair_key("models/b", "models/b/draft", None, "Device(gpu, 0)")
    assert a != b and "float32" in a and "native" in b
    greedy, sampled = WindowMemory(d=0.9, d_short=0.4, o=0.1, p=0.35, copy_p=0.5), WindowMemory(p=0.2)
    windowstore.save(tmp_path, a, {True: greedy, False: sampled})
    windowstore.save(tmp_path, b, {True: WindowMemory(d=0.2, p=0.7, full_tokens=5.5)})
    assert windowstore.load(tmp_path, a) == {True: greedy, False: sampled}
    assert windowstore.load(tmp_path, b) == {True: WindowMemory(d=0.2, p=0.7, full_tokens=5.5)}
    assert windowstore.load(tmp_path, "another pair") == {}
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temporary file, then replaced


def test_a_bad_file_means_starting_fresh(tmp_path, caplog):
    path = tmp_path / windowstore.FILE
    key = windowstore.pair_key("m", "d", None, "cpu")
    for text in ("{not json", json.dumps([1, 2]), json.dumps({"format": "other/9", "pairs": {}}),
                 json.dumps({"format": windowstore.FORMAT, "pairs": 3})):
        path.write_text(text)
        with caplog.at_level(logging.WARNING, logger="dflash.worker"):
            caplog.clear()
            assert windowstore.load(tmp_path, key) == {}
        assert "starts fresh" in caplog.text
    windowstore.save(tmp_path, key, {True: WindowMemory(p=0.5)})  # replaces the unreadable file
    assert windowstore.load(tmp_path, key) == {True: WindowMemory(p=0.5)}


def test_values_out_of_range_or_of_the_wrong_type_are_dropped(tmp_path):
    key = windowstore.pair_key("m", "d", None, "cpu")
    entry = {"greedy": {"d": -1.0, "o": "fast", "p": 1.5, "copy_p": 0.25},
             "sampled": {"d": float("inf"), "p": True, "o": 0.3}}
    text = json.dumps({"format": windowstore.FORMAT, "pairs": {key: entry}})
    (tmp_path / windowstore.FILE).write_text(text)
    assert windowstore.load(tmp_path, key) == {True: WindowMemory(copy_p=0.25), False: WindowMemory(o=0.3)}


def test_an_unwritable_state_dir_is_a_warning(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="dflash.worker"):
        windowstore.save(blocker / "state", "k", {True: WindowMemory(p=0.5)})
    assert "could not save" in caplog.text
