"""client.exchange_plan: the one retry / heartbeat rule the sync and async clients both drive.

Driven here step by step with replies made by hand (no socket), so each branch of the rule is
seen: re-sending, answering, errors, the wait heartbeats extend, and giving up.
"""

from __future__ import annotations

import time

import pytest

from dflash.client import errors as E
from dflash.client.client import SEND, exchange_plan
from dflash.daemon import protocol as P

RID = 7


def _plan(end_in: float, retry: float = 0.05, beat: float = 0.2, beats: bool = False):
    return exchange_plan(RID, time.monotonic() + end_in, retry, beat, beats, "ipc:///nowhere")


def test_sends_first_then_waits_and_returns_the_answer() -> None:
    plan = _plan(5.0)
    assert next(plan) is SEND
    wait = next(plan)
    assert 0 < wait <= 0.05
    # another request's answer and a stray heartbeat are not this one's
    wait = plan.send(P.Info(rid=RID + 1))
    assert isinstance(wait, float)
    wait = plan.send(P.Heartbeat(rid=RID))  # no `beats`: not an answer, and no change of rule
    assert isinstance(wait, float)
    with pytest.raises(StopIteration) as done:
        plan.send(P.Info(rid=RID, data={"ok": True}))
    assert done.value.value == P.Info(rid=RID, data={"ok": True})


def test_resends_every_retry_interval_until_the_end() -> None:
    plan = _plan(0.25, retry=0.05)
    sends, step = 0, next(plan)
    with pytest.raises(E.WorkerUnavailableError):
        while True:
            if step is SEND:
                sends += 1
                step = next(plan)
            else:
                time.sleep(step)  # nothing came in the wait
                step = plan.send(None)
    assert 3 <= sends <= 7  # ~0.25 s / 0.05 s, with the host's slack


def test_an_error_reply_raises_its_typed_error() -> None:
    plan = _plan(5.0)
    next(plan), next(plan)
    with pytest.raises(E.DFlashError) as err:
        plan.send(P.Error(rid=RID, code=P.BUSY, message="queue full"))
    assert err.value.code == P.BUSY
    # an error the worker could tie to no rid (a frame too broken to read one) is this request's
    plan = _plan(5.0)
    next(plan), next(plan)
    with pytest.raises(E.DFlashError) as err:
        plan.send(P.Error(rid=0, code=P.TOO_LARGE, message="frame over the cap"))
    assert err.value.code == P.TOO_LARGE


def test_heartbeats_stop_resending_and_their_silence_means_the_worker_is_gone() -> None:
    plan = _plan(0.05, retry=0.05, beat=0.2, beats=True)
    assert next(plan) is SEND
    next(plan)
    step = plan.send(P.Heartbeat(rid=RID))  # the worker has it: wait on, past the first end
    assert step is not SEND and step > 0.1
    started = time.monotonic()
    with pytest.raises(E.WorkerGoneError):
        while True:
            assert step is not SEND  # never re-sent once heartbeats came
            time.sleep(step)
            step = plan.send(None)
    assert time.monotonic() - started >= 0.15
