"""The MLX thread's own checks of a job, for jobs the socket thread accepted before it could know
(the worker takes jobs while the model loads: it checks what needs the model when the job runs)."""

from __future__ import annotations

from dflash.daemon import protocol as P
from dflash.daemon.compute import Compute
from dflash.daemon.config import DaemonConfig
from dflash.daemon.queue import Job, JobQueue
from dflash.daemon.store import JobStore


def _compute(tiny_dirs, tmp_path) -> Compute:
    d = tiny_dirs["llama"]
    cfg = DaemonConfig(model=str(d), draft=str(d / "draft"), runtime_dir=str(tmp_path / "run"),
                       state_dir=str(tmp_path / "state"), cache=False)
    c = Compute(cfg, JobQueue(max_len=4), JobStore(tmp_path / "jobs", retention_s=60), lambda: None)
    c._load()
    assert c.pair is not None, c.load_error
    return c


def test_a_bias_past_the_vocabulary_accepted_while_loading_is_bad_sampling(tiny_dirs, tmp_path):
    c = _compute(tiny_dirs, tmp_path)
    past = c.vocab_size + 5
    job = Job(job_id="j1", seq=1, request={"token_ids": [1, 2, 3], "max_tokens": 4,
                                           "sampling": {"temperature": 0.0, "logit_bias": {str(past): 2.0}}})
    result, state = c._generate(job)
    assert state == "error" and isinstance(result, P.Error)
    assert result.code == P.BAD_SAMPLING and result.param == "logit_bias" and str(past) in result.message
    # the same job with an id inside the vocabulary runs
    job.request["sampling"]["logit_bias"] = {str(c.vocab_size - 1): 2.0}
    result, state = c._generate(job)
    assert state == "done", result
