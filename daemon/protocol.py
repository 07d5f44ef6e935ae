"""Every wire message of dflashd as a typed struct, with the protocol version (docs/protocol.md).

A message is one msgpack map: {"v": VERSION, "op": <request op>} or {"v": VERSION, "type": <reply
type>} plus the struct's fields. Field order is the schema: fields are only ever appended, and a
new field must have a default so older peers keep working. `parse_request` turns a decoded map
into a request struct or raises ProtocolError with a machine-readable code; nothing a client
sends can make it raise anything else.

Versions: 1 (the first); 2 appends temperature, top_p, top_k and seed to `submit` and adds the
`bad_sampling` code; 3 appends `verify_window` to `submit` (one job's verify window: "auto",
"full" or a token count; plain decoding with 1); 4 appends `min_p` and the logits processors
(`logit_bias`, the repetition / presence / frequency penalties and their context sizes) to `submit`;
5 appends `min_tokens_to_keep` (how many tokens min-p always keeps) to `submit`. A message of
another version is refused with `bad_version`, naming both
versions (`version_error`); the `error`, `done` and `status` layouts are unchanged since 1, so
an error answering a request of an older version is stamped with that version and an old client reads it as the
typed error it is, instead of failing to decode it. A new op (`cache_clear`) is not a new
version: no older client sends it, and an older worker answers it `unknown_op`, which every
client reads; the version changes only when an existing message's layout does.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Union

VERSION = 5
# Older versions whose error replies share this version's layout: an error answering a request of
# one of these is stamped with the request's version, so that peer can decode it.
OLDER_VERSIONS = (1, 2, 3, 4)
PARAM_SINCE = 3  # the version that appended `param` to `error` (older layouts lack it)

# Error codes (replies of type "error"); clients map them to exception classes.
BAD_FRAME = "bad_frame"  # not one frame, not msgpack, not a map
TOO_LARGE = "too_large"  # frame over the size cap
BAD_VERSION = "bad_version"
UNKNOWN_OP = "unknown_op"
BAD_REQUEST = "bad_request"  # missing or mistyped field, value out of range
BUSY = "busy"  # queue full
NOT_FOUND = "not_found"  # unknown job id
NOT_READY = "not_ready"  # model still loading / failed to load
CANCELLED = "cancelled"
TIMEOUT = "timeout"  # per-job time limit hit
JOB_FAILED = "job_failed"  # the engine raised, or the job crashed the worker too often
SHUTTING_DOWN = "shutting_down"
INTERNAL = "internal"
BAD_POSITIONS = "bad_positions"  # sparse positions out of order, out of range, or empty
SPARSE_WITH_CACHE = "sparse_with_cache"  # sparse prefill asked to use/refresh the prefix cache
CACHE_UNAVAILABLE = "cache_unavailable"  # the cache process (position lists) is not reachable
BAD_SAMPLING = "bad_sampling"  # temperature / top_p / top_k / seed (v2), min_p, processors (v4), min_tokens_to_keep (v5)

CACHE_POLICIES = ("use", "bypass", "refresh")


SEED_MAX = (1 << 64) - 1  # seeds are unsigned 64-bit (MLX's PRNG key)
# Always used with fullmatch: with match and "$", "id\n" would pass ("$" matches before a final newline).
JOB_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_NESTING = 32  # lists/maps inside a request field: deeper is refused before it reaches a job


def finite_number(v: Any) -> bool:
    """An int or float that is finite as a float (an int past 1.8e308 is not: math.isfinite
    raised OverflowError for it, out of a check that should only say no)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


SHOWN_DIGITS = 20  # an error message shows a number of up to this many digits whole
SHOWN_CHARS = 64  # and other values' text up to this many characters (a job id's longest)


def shown(value: Any) -> str:
    """`value` as an error message echoes it: its repr, with a huge number or a long text cut
    short ("1000000000000000000…(301 digits)"). A 300-digit seed echoed whole buried the message,
    and past 4300 digits Python refuses to write an int at all (the check raised ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool):
        sign = "-" if value < 0 else ""
        digits = abs(value)
        if digits < 10**SHOWN_DIGITS:
            return f"{value!r}"
        try:
            text = str(digits)
        except ValueError:  # past sys.get_int_max_str_digits() (4300): str() refuses it
            return f"{sign}a number of about {int(digits.bit_length() * math.log10(2)) + 1} digits"
        return f"{sign}{text[:SHOWN_DIGITS - 1]}…({len(text)} digits)"
    try:
        text = repr(value)
    except ValueError:  # a container holding an int past the 4300 digits
        return f"a {type(value).__name__}"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS - 24]}…({len(text)} characters)"


REASON_CHARS = 200  # an exception's text quoted in a one-line error


def reason_line(text: object, limit: int = REASON_CHARS) -> str:
    """An exception's text (or any) on one line and at most `limit` characters ("..." after):
    MLX's and mlx-lm's messages span lines and can list every parameter of a model."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + "..."


class ProtocolError(Exception):
    """A request that cannot be served; becomes an `Error` reply with this code. `peer_version`:
    the version a `bad_version` message spoke (None otherwise); `param`: the offending field."""

    def __init__(self, code: str, message: str, *, peer_version: Any = None, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.peer_version = peer_version
        self.param = param


def version_error(peer: Any, what: str, me: str) -> ProtocolError:
    """The `bad_version` error for a message (`what`) of version `peer`, naming both versions."""
    hint = ("clients and the daemon must come from the same dflash release: upgrade the older one"
            if isinstance(peer, int) and not isinstance(peer, bool) else "not a dflash protocol message")
    return ProtocolError(BAD_VERSION, f"dflash protocol version mismatch: the {what} is version {shown(peer)}, "
                         f"this {me} speaks version {VERSION} ({hint})", peer_version=peer)


# a submit's sampling, mlx-lm's names: the first four came with version 2, min_p with 4,
# min_tokens_to_keep with 5
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_p", "min_tokens_to_keep")


def sampling_problem(temperature: Any = None, top_p: Any = None, top_k: Any = None,
                     seed: Any = None, min_p: Any = None, min_tokens_to_keep: Any = None) -> tuple[str, str] | None:
    """(field, message) for the first sampling value out of range, else None (None = unset).

    temperature >= 0 (0 = greedy), 0 < top_p <= 1 (1 = off), top_k >= 0 (0 = off), seed in
    0..2^64-1, 0 <= min_p <= 1 (0 = off), min_tokens_to_keep an integer in 1..2^64-1 (1 =
    mlx-lm's default); the same rules as the engine's, checked here so a bad value never reaches
    a job."""
    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if temperature is not None and not (finite_number(temperature) and temperature >= 0):
        return "temperature", f"temperature must be a finite number >= 0 (0 = greedy), got {shown(temperature)}"
    if top_p is not None and not (finite_number(top_p) and 0 < top_p <= 1):
        return "top_p", f"top_p must be in (0, 1] (1 = off), got {shown(top_p)}"
    if top_k is not None and not (integer(top_k) and top_k >= 0):
        return "top_k", f"top_k must be an integer >= 0 (0 = off), got {shown(top_k)}"
    if seed is not None and not (integer(seed) and 0 <= seed <= SEED_MAX):
        return "seed", f"seed must be an integer in 0..2^64-1, got {shown(seed)}"
    if min_p is not None and not (finite_number(min_p) and 0 <= min_p <= 1):
        return "min_p", f"min_p must be in [0, 1] (0 = off), got {shown(min_p)}"
    if min_tokens_to_keep is not None and not (integer(min_tokens_to_keep) and 1 <= min_tokens_to_keep <= SEED_MAX):
        return ("min_tokens_to_keep", "min_tokens_to_keep must be an integer >= 1 (the tokens min-p always keeps; "
                f"1 = mlx-lm's default; at most 2^64-1), got {shown(min_tokens_to_keep)}")
    return None


# a submit's logits processors (v4), mlx-lm's make_logits_processors names; the penalties and their
# windows are [generation] defaults too, logit_bias only per request (token ids are the model's)
PENALTY_FIELDS = ("repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
                  "frequency_penalty", "frequency_context_size")
PROCESSOR_FIELDS = ("logit_bias", *PENALTY_FIELDS)
MAX_TOKEN_ID_DIGITS = 20  # 2^64 - 1 has 20: a longer key cannot be a token id
BIAS_MAX = 1e30  # a larger bias is inf in float32 (engine/processors.py checks with these too)
PENALTY_MAX = 1e30  # the penalties' float32-safe ranges (a repetition penalty of 1e-40 is 0
REPETITION_MIN = 1e-30  # there: garbage draws)


def processors_problem(values: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) for the first logits-processor value out of range in `values` (a map of
    PROCESSOR_FIELDS; None or absent = unset), else None. logit_bias maps token ids, as decimal
    strings (msgpack and JSON map keys), to numbers within +-BIAS_MAX; the vocabulary bounds them at the
    worker. repetition_penalty > 0 (1 = off), presence/frequency any finite number (0 = off),
    context sizes integers >= 1."""
    bias = values.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            return "logit_bias", f"logit_bias must map token ids to numbers, got {type(bias).__name__}"
        seen: dict[int, str] = {}
        for k, v in bias.items():
            if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= MAX_TOKEN_ID_DIGITS):
                return "logit_bias", f"logit_bias keys must be token ids (decimal integers >= 0), got {shown(k)}"
            if (first := seen.setdefault(int(k), k)) != k:  # "5" and "05": the engine refused it, job_failed
                return "logit_bias", f"logit_bias names token {int(k)} twice ({first!r} and {k!r})"
            if not finite_number(v):
                return "logit_bias", f"logit_bias values must be finite numbers, got {shown(v)} for token {k}"
            if abs(v) > BIAS_MAX:  # else accepted, then failed as job_failed when the engine refused it
                return "logit_bias", (f"logit_bias values must be within +-{BIAS_MAX:.0e} (logits are float32), "
                                      f"got {shown(v)} for token {k}")
    r = values.get("repetition_penalty")
    if r is not None and not (finite_number(r) and r > 0):
        return "repetition_penalty", f"repetition_penalty must be a finite number > 0 (1 = off), got {shown(r)}"
    if r is not None and not REPETITION_MIN <= r <= PENALTY_MAX:
        return "repetition_penalty", (f"repetition_penalty must be within {REPETITION_MIN:.0e}..{PENALTY_MAX:.0e} "
                                      f"(logits are float32), got {shown(r)}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = values.get(name)
        if v is not None and not finite_number(v):
            return name, f"{name} must be a finite number (0 = off), got {shown(v)}"
        if v is not None and abs(v) > PENALTY_MAX:
            return name, f"{name} must be within +-{PENALTY_MAX:.0e} (logits are float32), got {shown(v)}"
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        v = values.get(name)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= SEED_MAX):
            return name, f"{name} must be an integer >= 1 (tokens; at most 2^64-1), got {shown(v)}"
    return None


WINDOW_POLICIES = ("auto", "full")  # a verify window by name; else a token count >= 1


def window_from_text(text: str) -> str | int:
    """A verify window written as text (a config value, a command-line flag): digits are a count.
    Text int() cannot read ("²", or past 4300 digits: a traceback before) stays text, which
    verify_window_problem then refuses, clipped."""
    if not text.isdigit():
        return text
    try:
        return int(text)
    except ValueError:
        return text


MAX_STOPS = 16  # stop sequences one job may have
MAX_STOP_CHARS = 256  # characters in one stop sequence


def stops_problem(stops: list[str] | tuple[str, ...]) -> str | None:
    """Why `stops` are not a job's stop sequences, else None: one check for the daemon, the
    gateway and the client, so an empty one (which never matches: a `--stop "$UNSET"`) is refused
    everywhere rather than silently ignored somewhere."""
    if any(s == "" for s in stops):
        return "a stop sequence cannot be empty"
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        return f"at most {MAX_STOPS} stop sequences of at most {MAX_STOP_CHARS} characters"
    return None


def verify_window_problem(value: Any) -> str | None:
    """Why `value` is not a verify window ("auto", "full" or an integer >= 1), else None (None:
    unset). The block size bounds a count too; only the worker knows it (daemon/compute.py)."""
    if value is None or value in WINDOW_POLICIES and isinstance(value, str):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return f"verify_window must be 'auto', 'full' or a number of tokens >= 1 (1 = plain decoding), got {shown(value)}"


# Chat template keyword arguments (a submit's template_args, the gateway's chat_template_kwargs)
# become keyword arguments of the tokenizer's apply_chat_template and variables of the template.
# Only plain names, and none that apply_chat_template (transformers' or mlx-lm's wrapper, whose
# first parameter is `self`) takes itself or that the template's own helpers use: such a name
# used to reach the worker, where the call failed ("got multiple values for argument 'self'" /
# 'tokenize' ...) as job_failed (HTTP 500), or, over the wire, swapped the model's chat template
# (chat_template) or made it return tensors or a truncated prompt. Checked at submit instead.
TEMPLATE_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # fullmatch: "$" would let "name\n" through
RESERVED_TEMPLATE_ARGS = frozenset({
    "self", "conversation", "messages", "tokenize", "add_generation_prompt", "chat_template", "return_dict",
    "return_tensors", "tools", "documents", "continue_final_message", "padding", "truncation", "max_length",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
    "raise_exception", "strftime_now",  # the helpers transformers gives every template
    # Jinja's own globals (jinja2.defaults.DEFAULT_NAMESPACE), which a render keyword hides: a
    # template calling namespace() or range() (Qwen3's, among many) then failed with a TypeError,
    # job_failed (HTTP 500) for a request's mistake
    "namespace", "range", "dict", "cycler", "joiner", "lipsum"})


def template_args_problem(args: Any) -> str | None:
    """Why a chat-template keyword map cannot be used (a key that is not a plain name, or one
    apply_chat_template or the template's helpers own), else None (None or {}: none given)."""
    if args is None:
        return None
    if not isinstance(args, dict):
        return f"template_args must be a map of names to values, got {type(args).__name__}"
    for k in args:
        if not template_arg_allowed(k):
            return f"chat template keyword argument {shown(k)} cannot be set (a plain name that apply_chat_template " \
                   "does not take itself)"
    return None


def template_arg_allowed(name: Any) -> bool:
    """A plain name that neither apply_chat_template nor the template's helpers own (the gateway's
    chat_template_kwargs keys and a submit's template_args keys alike)."""
    return isinstance(name, str) and bool(TEMPLATE_ARG_NAME.fullmatch(name)) and name not in RESERVED_TEMPLATE_ARGS


def check_job_id(job_id: Any) -> None:
    """Raise ProtocolError(BAD_REQUEST) unless job_id is 1-64 characters of [A-Za-z0-9_.-]."""
    if not (isinstance(job_id, str) and JOB_ID.fullmatch(job_id)):
        raise ProtocolError(BAD_REQUEST, f"job_id must be 1-64 characters of A-Z a-z 0-9 _ . -, got {shown(job_id)}",
                            param="job_id")


def check_submit(sub: "Submit") -> None:
    """The rules of a submit that need no worker settings (job id, token ids >= 0, sampling, the
    verify window's form), so a
    client can refuse a bad value before sending it; raises ProtocolError like the worker would."""
    if sub.job_id:
        check_job_id(sub.job_id)
    if sub.token_ids is not None:
        neg = next((t for t in sub.token_ids if t < 0), None)
        if neg is not None:
            raise ProtocolError(BAD_REQUEST, f"token ids must be >= 0, got {shown(neg)}", param="token_ids")
    template_problem = template_use_problem(sub)
    if template_problem is not None:
        raise ProtocolError(BAD_REQUEST, template_problem[1], param=template_problem[0])
    check_sampling(sub.temperature, sub.top_p, sub.top_k, sub.seed, sub.min_p, sub.min_tokens_to_keep)
    problem = processors_problem({k: getattr(sub, k) for k in PROCESSOR_FIELDS})
    if problem is not None:
        raise ProtocolError(BAD_SAMPLING, problem[1], param=problem[0])
    problem = verify_window_problem(sub.verify_window)
    if problem is not None:
        raise ProtocolError(BAD_REQUEST, problem, param="verify_window")
    problem = template_args_problem(sub.template_args)
    if problem is not None:
        raise ProtocolError(BAD_REQUEST, problem, param="template_args")


def template_use_problem(sub: "Submit") -> tuple[str, str] | None:
    """(field, message) for a field that only acts through the chat template on a prompt that
    does not go through it, else None. `system` and `template_args` with token ids (used as
    they are) or raw text, and `raw` with messages (always templated), were dropped without a
    word: the answer came as if they had not been sent."""
    untemplated = ("token ids, which are used as they are" if sub.token_ids is not None
                   else "raw text" if sub.raw and sub.text is not None else None)
    if untemplated is not None:
        for name in ("system", "template_args"):
            if getattr(sub, name):
                return name, (f"{name} goes into the chat template, which a prompt of {untemplated} leaves out: "
                              f"send the prompt as text or messages, or leave {name} out")
    if sub.raw and sub.messages is not None:
        return "raw", ("raw encodes a text prompt without the chat template; messages always go through it: "
                       "send the prompt as text, or leave raw out")
    return None


def check_types(msg: Any) -> None:
    """Raise ProtocolError(BAD_REQUEST, param=the field) for a field whose value does not fit its
    annotation, by the same rule the worker applies to a decoded request."""
    hints = typing.get_type_hints(type(msg))
    for f in dataclasses.fields(msg):
        if not _matches(getattr(msg, f.name), hints[f.name]):
            raise ProtocolError(BAD_REQUEST, f"field {f.name!r} of {type(msg).__name__} has the wrong type "
                                f"({type(getattr(msg, f.name)).__name__}; expected {_type_name(hints[f.name])})",
                                param=f.name)


def check_sampling(temperature: Any = None, top_p: Any = None, top_k: Any = None, seed: Any = None,
                   min_p: Any = None, min_tokens_to_keep: Any = None) -> None:
    """Raise ProtocolError(BAD_SAMPLING, param=the field) for a value out of range."""
    problem = sampling_problem(temperature, top_p, top_k, seed, min_p, min_tokens_to_keep)
    if problem is not None:
        raise ProtocolError(BAD_SAMPLING, problem[1], param=problem[0])


# ----------------------------------------------------------------------------- requests


@dataclass
class Submit:
    """Queue a generation. Exactly one of text / messages / token_ids is the prompt."""

    op: ClassVar[str] = "submit"
    rid: int = 0  # client's request id, echoed in every reply to this request
    job_id: str = ""  # client-chosen id makes retried submits idempotent; "" = worker picks
    text: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    system: str | None = None
    raw: bool = False  # text without the chat template
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    priority: int = 0  # higher runs first; FIFO within a priority
    stream: bool = True  # stream deltas to this connection and cancel when it goes away
    timeout_s: float | None = None  # per-job limit (capped by the worker's own limit)
    cache: str | None = None  # prefix cache: "use" (None: use; bypass for sparse), "bypass", "refresh"
    positions: list[int] | None = None  # sparse prefill: indices into the prompt's token ids
    positions_name: str | None = None  # sparse prefill with a stored position list
    template_args: dict | None = None  # chat template keyword arguments (e.g. enable_thinking)
    # v2, sampling (None: the daemon's configured default; its defaults are greedy)
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None  # nucleus mass in (0, 1]; 1 = off
    top_k: int | None = None  # keep the k most likely tokens; 0 = off
    seed: int | None = None  # 0..2^64-1; None = a random seed (reported in done.stats.sampling)
    # v3: this job's verify window, "auto", "full" or 1..block size (1 = plain decoding); None =
    # the worker's setting (reported in done.stats.verify_window)
    verify_window: str | int | None = None
    # v4: min-p sampling, in [0, 1]; 0 = off; None = the daemon's configured default
    min_p: float | None = None
    # v4: logits processors (mlx-lm's make_logits_processors); None = the daemon's default (off)
    logit_bias: dict | None = None  # {"token id": bias}: map keys are strings on the wire
    repetition_penalty: float | None = None  # > 0; 1 = off
    repetition_context_size: int | None = None  # tokens; the default 20
    presence_penalty: float | None = None  # 0 = off
    presence_context_size: int | None = None
    frequency_penalty: float | None = None  # 0 = off
    frequency_context_size: int | None = None
    # v5: how many of the most likely tokens min-p always keeps (mlx-lm's min_tokens_to_keep),
    # an integer >= 1; None = the daemon's configured default (1, mlx-lm's)
    min_tokens_to_keep: int | None = None


@dataclass
class Cancel:
    op: ClassVar[str] = "cancel"
    rid: int = 0
    job_id: str = ""


@dataclass
class JobStatus:
    """State of one job, with its result once finished (kept for the retention period)."""

    op: ClassVar[str] = "status"
    rid: int = 0
    job_id: str = ""


@dataclass
class Stats:
    """Health and counters of the worker."""

    op: ClassVar[str] = "stats"
    rid: int = 0


@dataclass
class Jobs:
    """Queued and running jobs."""

    op: ClassVar[str] = "jobs"
    rid: int = 0


@dataclass
class Models:
    op: ClassVar[str] = "models"
    rid: int = 0


@dataclass
class Shutdown:
    """Stop the worker (control path: answered at once, not queued behind work)."""

    op: ClassVar[str] = "shutdown"
    rid: int = 0


@dataclass
class PutPositions:
    """Store (or replace) a named sparse-prefill position list in the cache process."""

    op: ClassVar[str] = "positions_put"
    rid: int = 0
    name: str = ""
    positions: list[int] = field(default_factory=list)


@dataclass
class GetPositions:
    op: ClassVar[str] = "positions_get"
    rid: int = 0
    name: str = ""


@dataclass
class ListPositions:
    op: ClassVar[str] = "positions_list"
    rid: int = 0


@dataclass
class DeletePositions:
    op: ClassVar[str] = "positions_delete"
    rid: int = 0
    name: str = ""


POSITION_OPS = (PutPositions, GetPositions, ListPositions, DeletePositions)


@dataclass
class CacheClear:
    """Drop the prefix cache's snapshots, L1 and L2 (never the position lists). Run by the MLX
    thread between jobs or decode cycles, so it answers after the running job's prefill."""

    op: ClassVar[str] = "cache_clear"
    rid: int = 0


Request = Union[Submit, Cancel, JobStatus, Stats, Jobs, Models, Shutdown, PutPositions, GetPositions,
                ListPositions, DeletePositions, CacheClear]
REQUESTS: dict[str, type] = {c.op: c for c in (Submit, Cancel, JobStatus, Stats, Jobs, Models, Shutdown, *POSITION_OPS,
                                                CacheClear)}

# ----------------------------------------------------------------------------- replies


@dataclass
class Accepted:
    type: ClassVar[str] = "accepted"
    rid: int = 0
    job_id: str = ""
    position: int = 0  # jobs ahead of this one (0: next to run or running)


@dataclass
class Delta:
    type: ClassVar[str] = "delta"
    rid: int = 0
    job_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    from_draft: list[bool] = field(default_factory=list)


@dataclass
class Done:
    """The end of a job: all text, all ids, the engine's stats. finish_reason: stop, length,
    cancelled or timeout."""

    type: ClassVar[str] = "done"
    rid: int = 0
    job_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    finish_reason: str = ""


@dataclass
class Error:
    """`param`: the request field the error is about ("" when it is about none), so a client
    (the gateway's OpenAI `param`) need not read it out of the message."""

    type: ClassVar[str] = "error"
    rid: int = 0
    code: str = INTERNAL
    message: str = ""
    job_id: str = ""
    param: str = ""


def shutdown_error(job_id: str, rid: int = 0) -> Error:
    """The error that ends a job's stream when the worker stops before finishing it (running:
    cancelled; queued: never started): the job is kept and runs again at the next start."""
    return Error(rid=rid, code=SHUTTING_DOWN, message="worker is shutting down; the job will run again when it "
                 "restarts", job_id=job_id)


def store_error(code: str, what: str, e: BaseException, job_id: str = "", then: str = "") -> Error:
    """The error for a write the job store refused (its disk full or read-only): one line that
    names the store's place and the reason, never a traceback."""
    return Error(code=code, job_id=job_id, message=f"the job store (in the daemon's state dir) could not "
                 f"record {what}: {reason_line(e)}{then}")


@dataclass
class Status:
    """state: queued, running, done, error, cancelled, unknown. `result` is a Done or Error map."""

    type: ClassVar[str] = "status"
    rid: int = 0
    job_id: str = ""
    state: str = "unknown"
    position: int = -1
    attempts: int = 0
    result: dict | None = None


@dataclass
class Info:
    """Answer to stats / jobs / models / shutdown / cancel / cache_clear: a free-form map of facts."""

    type: ClassVar[str] = "info"
    rid: int = 0
    data: dict = field(default_factory=dict)


@dataclass
class Heartbeat:
    """Sent to every connection waiting on a job (or on a cache_clear it has not answered yet),
    so it learns within seconds if the worker dies."""

    type: ClassVar[str] = "heartbeat"
    rid: int = 0


Reply = Union[Accepted, Delta, Done, Error, Status, Info, Heartbeat]
REPLIES: dict[str, type] = {c.type: c for c in (Accepted, Delta, Done, Error, Status, Info, Heartbeat)}

# ----------------------------------------------------------------------------- (de)structuring


def to_map(msg: Any, version: int = VERSION) -> dict[str, Any]:
    """The wire map of a struct: version, op or type, then its fields in schema order. `version`
    other than VERSION only for an `error` to a peer of an older version: its layout then (before
    version 3, without `param`)."""
    out: dict[str, Any] = {"v": version}
    if hasattr(msg, "op"):
        out["op"] = msg.op
    else:
        out["type"] = msg.type
    for f in dataclasses.fields(msg):
        if not (version < PARAM_SINCE and isinstance(msg, Error) and f.name == "param"):
            out[f.name] = getattr(msg, f.name)
    return out


def parse_request(m: Any) -> Request:
    """A typed request from a decoded map; raises ProtocolError for anything malformed."""
    if not isinstance(m, dict):
        raise ProtocolError(BAD_FRAME, "a message must be a msgpack map")
    if m.get("v") != VERSION:
        raise version_error(m.get("v"), "request", "worker")
    op = m.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {shown(op)}; known: {', '.join(REQUESTS)}")
    req = _build(cls, m, ("v", "op"))
    if isinstance(req, (Cancel, JobStatus)) or (isinstance(req, Submit) and req.job_id):
        check_job_id(req.job_id)  # a malformed id is a bad request, never a lookup that finds nothing
    return req


def parse_reply(m: Any) -> Reply:
    """A typed reply from a decoded map (client side); raises ProtocolError when malformed."""
    if not isinstance(m, dict):
        raise ProtocolError(BAD_FRAME, "a message must be a msgpack map")
    if m.get("v") != VERSION:
        raise version_error(m.get("v"), "reply", "client")
    kind = m.get("type")
    cls = REPLIES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(UNKNOWN_OP, f"unknown reply type {shown(kind)}")
    return _build(cls, m, ("v", "type"), strict=False)


def current_result(m: dict) -> dict:
    """A stored `done`/`error` map (a job's result, kept for the retention period) in this
    version: one written by an older worker (same layout) is re-stamped, anything else kept."""
    if isinstance(m, dict) and m.get("v") in OLDER_VERSIONS and m.get("type") in (Done.type, Error.type):
        return {**m, "v": VERSION}
    return m


def damaged_store_line(note: dict, what: str, salvaged: str = "entries") -> str:
    """One status line for a store found damaged, moved aside and recreated (the recovery notes
    `status` carries for the job store and the L2 stores; cache/repair.py writes them)."""
    return (f"{what} was damaged ({note.get('reason')}) at {note.get('at')}: recreated, "
            f"{note.get('salvaged')} {salvaged} salvaged; the damaged copy is kept in "
            f"{note.get('moved_to')} (delete it when done)")


def _build(cls: type, m: dict, envelope: tuple[str, ...], strict: bool = True) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if strict:
        extra = [k for k in m if k not in names and k not in envelope]
        if extra:
            raise ProtocolError(BAD_REQUEST, f"unknown field(s) {shown(sorted(map(str, extra)))} for {cls.__name__}",
                                param=str(extra[0])[:SHOWN_CHARS])
    kwargs = {}
    for name in names:
        if name in m:
            if not _matches(m[name], hints[name]):
                raise ProtocolError(BAD_REQUEST, f"field {name!r} of {cls.__name__} has the wrong type", param=name)
            if strict and _may_nest(hints[name]) and _too_deep(m[name]):
                raise ProtocolError(BAD_REQUEST, f"field {name!r} of {cls.__name__} is nested deeper than "
                                    f"{MAX_NESTING} levels", param=name)
            kwargs[name] = m[name]
    return cls(**kwargs)


def _matches(value: Any, tp: Any) -> bool:
    """Whether a decoded msgpack value fits a field's annotation (the forms used above)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(tp)
        if item is int and isinstance(value, list):  # fast path for token ids (bool's type is not int)
            return all(type(v) is int for v in value)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    return False


def walk(value: Any) -> Iterator[tuple[Any, int, str]]:
    """Every list, map and string inside `value` (itself included), with its depth (0: value) and
    its path ("messages[0].content"; "" for value); a map's keys come as strings at the map's own
    path, one level down. Iterative: a deep value must not recurse here. Other types are skipped."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        v, depth, path = stack.pop()
        yield v, depth, path
        if isinstance(v, (dict, list)):
            for k, x in (v.items() if isinstance(v, dict) else enumerate(v)):
                if isinstance(k, str):
                    yield k, depth + 1, path
                if isinstance(x, (str, dict, list)):
                    stack.append((x, depth + 1, _child(path, k)))


def _child(path: str, key: Any) -> str:
    """The path of a nested field: messages[0].content."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether lists/maps nest deeper than `limit`."""
    return any(d >= limit for v, d, _ in walk(value) if isinstance(v, (dict, list)))


def _may_nest(tp: Any) -> bool:
    """Whether a field's annotation admits free-form maps, whose depth _matches does not bound."""
    return tp is dict or typing.get_origin(tp) is dict or any(_may_nest(a) for a in typing.get_args(tp))


def _type_name(tp: Any) -> str:
    """A field annotation in words, for error messages ('int or None', 'list of int')."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "dict"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))
