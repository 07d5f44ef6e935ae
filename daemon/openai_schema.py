"""OpenAI-compatible request parsing and response shapes for the HTTP gateway (no HTTP here).

`parse_chat` / `parse_completion` turn a decoded JSON body into a `GenRequest` (what the daemon's
submit needs) or raise `ApiError`, which the gateway answers in OpenAI's error shape. The builders
below make the response objects and stream chunks from the daemon's deltas and results.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import protocol as P

# Sampling the engine applies (top_k and min_p are vLLM's extra fields, min_tokens_to_keep mlx-lm's
# make_sampler argument, an extra field here). Absent or null: the server default.
SAMPLING = P.SAMPLING_FIELDS
# Logits processors the engine applies (mlx-lm's make_logits_processors): OpenAI's logit_bias,
# presence_penalty and frequency_penalty, vLLM's repetition_penalty, and mlx-lm server's context
# sizes (extra fields). Their ranges: OpenAI's for the bias and the penalties, vLLM's for
# repetition_penalty; a value outside is a 400.
PROCESSORS = P.PROCESSOR_FIELDS
_NUMBER_RANGE: dict[str, tuple[Callable[[float], bool], str]] = {
    "presence_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (lambda v: P.finite_number(v) and v > 0, "a finite number > 0"),
}
BIAS_RANGE = 100  # OpenAI's: each bias in [-100, 100]
# Sampling fields the engine does not apply, with the test for "asks for something": at any other
# (neutral) value they are fine; otherwise the answer is made without them and says so (the
# x-dflash-sampling-ignored header), or, with --sampling reject, the request is refused. None
# today: the mechanism stays for a field accepted before it is applied.
_UNAPPLIED: dict[str, Callable[[Any], bool]] = {}
# JSON types as OpenAI names them, each with its test and its words in an error message (an
# "integer" may be written 2.0: _integer).
_JSON_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "string": (lambda v: isinstance(v, str), "a string"),
    "boolean": (lambda v: isinstance(v, bool), "a boolean"),
    "integer": (lambda v: _integer(v), "an integer"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "array": (lambda v: isinstance(v, list), "an array"),
}
# Fields accepted without effect (labels), or only at a neutral value (the others are refused in
# _check_unsupported), with the JSON type(s) OpenAI gives each: another type is a 400
# invalid_type naming the field whatever the value ("echo": 0 and "tools": 0 were taken as their
# neutral values), as OpenAI answers; null is absent, as everywhere. `logprobs` is a boolean in a
# chat and an integer (the count of top tokens) in a completion: either is taken on both, as
# clients that send `false` to both endpoints were served before (its neutral values false and 0).
_IGNORED_TYPES: dict[str, tuple[str, ...]] = {
    "user": ("string",), "metadata": ("object",), "store": ("boolean",), "service_tier": ("string",),
    "parallel_tool_calls": ("boolean",), "tool_choice": ("string", "object"), "top_logprobs": ("integer",),
    "logprobs": ("boolean", "integer"), "n": ("integer",), "tools": ("array",), "response_format": ("object",),
    "echo": ("boolean",), "best_of": ("integer",), "suffix": ("string",), "functions": ("array",),
    "function_call": ("string", "object"),
}
_IGNORED = set(_IGNORED_TYPES)
WIRE_INT_MAX = (1 << 64) - 1  # the largest integer the daemon's wire (msgpack) carries
# dflash's own extra field (as top_k is vLLM's): the job's verify window, "auto", "full" or a token
# count, 1 = plain decoding (protocol version 3); absent or null: the daemon's setting
_EXTRA = {"verify_window"}
_COMMON = ({"model", "stream", "stream_options", "stop", "max_tokens"} | set(SAMPLING) | set(PROCESSORS)
           | set(_UNAPPLIED) | _IGNORED | _EXTRA)
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
MAX_STOP = P.MAX_STOPS  # the daemon's own cap
MAX_DEPTH = P.MAX_NESTING  # JSON nesting the daemon accepts in a field (the body's own level is one more)
MAX_LISTED = 8  # unknown fields an error message names


class ApiError(Exception):
    """An error answered as {"error": {message, type, param, code}} with an HTTP status; `close`:
    the answer also closes the connection (`Connection: close`), which cannot carry another request."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.close = close
        self.headers: dict[str, str] = {}  # extra response headers (the job id of an error about a job)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


@dataclass
class GenRequest:
    """One generation as the gateway will submit it to the daemon."""

    kind: str  # "chat" or "completion"
    prompt: Any  # text, chat messages, or token ids
    raw: bool  # text without the chat template (completions)
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    template_args: dict | None = None
    # sampling sent to the daemon (None: absent, the server's default applies)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    min_p: float | None = None
    min_tokens_to_keep: int | None = None
    processors: dict[str, Any] = field(default_factory=dict)  # logit_bias and penalties the request set
    unapplied: list[str] = field(default_factory=list)  # sampling fields asking for what is not applied
    verify_window: str | int | None = None  # the job's own window (None: the daemon's)
    max_tokens_param: str | None = None  # the field that set max_tokens (None: the server's default)

    def sampling(self) -> dict[str, Any]:
        """The sampling fields and logits processors the request set (absent ones are left out)."""
        return {**{k: getattr(self, k) for k in SAMPLING if getattr(self, k) is not None}, **self.processors}


# ----------------------------------------------------------------------------- parsing


def parse_chat(body: Any, default_max_tokens: int) -> GenRequest:
    """A GenRequest from a /v1/chat/completions body."""
    _check_fields(body, _CHAT_FIELDS)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        code = "missing_required_parameter" if msgs is None else "invalid_value" if msgs == [] else "invalid_type"
        raise bad("'messages' must be a non-empty list", "messages", code)
    req = _common(body, "chat", [_message(m, i) for i, m in enumerate(msgs)], raw=False)
    mt = body.get("max_completion_tokens")
    if mt is not None:
        req.max_tokens = _positive_int(mt, "max_completion_tokens")
        req.max_tokens_param = "max_completion_tokens"
    elif body.get("max_tokens") is None:
        req.max_tokens = default_max_tokens
    req.template_args = _template_args(body.get("chat_template_kwargs"))
    return req


def parse_completion(body: Any, default_max_tokens: int) -> GenRequest:
    """A GenRequest from a /v1/completions body (the prompt is not templated)."""
    _check_fields(body, _COMPLETION_FIELDS)
    req = _common(body, "completion", _completion_prompt(body.get("prompt")), raw=True)
    if body.get("max_tokens") is None:
        req.max_tokens = default_max_tokens
    return req


def loads(raw: bytes) -> Any:
    """The request body's JSON. JSON sets no limit on an integer's digits, but Python refuses to
    read one past 4300 (sys.get_int_max_str_digits): such a body was a 400 invalid_json telling
    the client to "use sys.set_int_max_str_digits()". It is read again with those integers taken
    as one of their size, so the field's own check refuses it (invalid_value, naming the field);
    any other error comes back as it was."""
    try:
        return json.loads(raw)
    except ValueError:
        return json.loads(raw, parse_int=_json_int)


def _json_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # past the digit limit: a power of two with as many digits (exactness is moot)
        size = 1 << math.ceil((len(text.lstrip("-")) - 1) * math.log2(10))
        return -size if text.startswith("-") else size


def check_json(body: Any) -> None:
    """Refuse what JSON can spell but the daemon cannot take: strings that are not Unicode (a lone
    surrogate escape such as "\\ud800" has no UTF-8 form) and nesting deeper than MAX_DEPTH.
    Iterative, so no body can make it recurse."""
    for v, depth, path in P.walk(body):
        if isinstance(v, str):
            _unicode(v, path)
        elif depth > MAX_DEPTH:
            raise bad(f"the JSON body nests deeper than {MAX_DEPTH} levels", None, "invalid_json")


def _unicode(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = f"'{path}'" if path else "the body"
        raise bad(f"{where} holds the lone surrogate {ascii(s[e.start])} (an unpaired \\uD800-\\uDFFF escape): "
                  "strings must be valid Unicode", path or None, "invalid_json") from None


def _check_fields(body: Any, known: set[str]) -> None:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    extra = sorted(k for k in body if k not in known)
    if extra:  # a body of a thousand long names is not echoed whole
        names = ", ".join(k if len(k) <= P.SHOWN_CHARS else P.shown(k) for k in extra[:MAX_LISTED])
        more = f" (and {len(extra) - MAX_LISTED} more)" if len(extra) > MAX_LISTED else ""
        raise bad(f"Unrecognized request argument supplied: {names}{more}", extra[0], "unknown_parameter")


def _common(body: dict, kind: str, prompt: Any, raw: bool) -> GenRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model", "invalid_type")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream", "invalid_type")
    opts = body.get("stream_options")
    # include_usage null is absent, as every null is (a client that writes its unset fields as null was refused)
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage"), (bool, type(None)))):
        raise bad("'stream_options' must be an object with a boolean 'include_usage'", "stream_options", "invalid_type")
    if opts is not None and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    req = GenRequest(kind, prompt, raw, 0, _stop(body.get("stop")), bool(stream),
                     bool((opts or {}).get("include_usage")), model)
    if body.get("max_tokens") is not None:
        req.max_tokens = _positive_int(body["max_tokens"], "max_tokens")
        req.max_tokens_param = "max_tokens"
    _check_types(body, _IGNORED_TYPES)
    _check_unsupported(body)
    _sampling(body, req)
    req.processors = _processors(body)
    req.unapplied = _unapplied(body)
    req.verify_window = window = body.get("verify_window")
    problem = P.verify_window_problem(window)
    if problem is None and isinstance(window, int) and window > WIRE_INT_MAX:  # the wire cannot carry it
        problem = ("verify_window must be 'auto', 'full' or a number of tokens in 1..2^64-1 (the draft's block size "
                   f"bounds it), got {P.shown(window)}")
    if problem is not None:
        raise bad(problem, "verify_window")
    return req


def _check_types(body: dict, types: dict[str, tuple[str, ...]]) -> None:
    """Fields accepted without effect (or only at a neutral value) still have OpenAI's types:
    another type is a mistake to report (400 invalid_type naming the field), before any value of
    theirs is looked at; null is absent."""
    for name, kinds in types.items():
        v = body.get(name)
        if v is not None and not any(_JSON_TYPES[k][0](v) for k in kinds):
            raise bad(f"'{name}' must be {' or '.join(_JSON_TYPES[k][1] for k in kinds)}", name, "invalid_type")


def _check_count(body: dict, name: str, hint: str) -> None:
    """n / best_of (an integer: _check_types): >= 1, and only 1 is served (one choice per request)."""
    v = body.get(name)
    if v is None:
        return
    if v < 1:
        raise bad(f"'{name}' must be >= 1, got {P.shown(v)}", name)
    if v > 1:
        raise bad(f"only {name}=1 is supported: {hint}", name, "unsupported_parameter")


def _check_unsupported(body: dict) -> None:
    """Fields we accept only at values that need nothing the engine lacks; `param` names the field
    that asked, so a client can tell which one to drop."""
    _check_count(body, "n", "send one request per choice (with different seeds)")
    _check_count(body, "best_of", "send several requests (with different seeds) and pick one")
    for name, ok in (("logprobs", lambda v: v in (None, False, 0)), ("top_logprobs", lambda v: v in (None, 0)),
                     ("echo", lambda v: v in (None, False)), ("suffix", lambda v: v is None)):
        if not ok(body.get(name)):
            what = "logprobs are" if name.endswith("logprobs") else f"'{name}' is"
            raise bad(f"{what} not supported by this server", name, "unsupported_parameter")
    for name, ok in (("tools", lambda v: not v), ("functions", lambda v: not v),
                     ("function_call", lambda v: v in (None, "none"))):
        if not ok(body.get(name)):
            raise bad("tools and function calling are not supported by this server", name, "unsupported_parameter")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise bad("tool_choice is not supported by this server", "tool_choice", "unsupported_parameter")
    fmt = body.get("response_format")  # an object (_check_types)
    if fmt is not None and fmt.get("type") != "text":
        raise bad("only response_format {\"type\": \"text\"} is supported", "response_format", "unsupported_parameter")


def _sampling(body: dict, req: GenRequest) -> None:
    """temperature, top_p, top_k (-1 = off, as in vLLM), seed, min_p and min_tokens_to_keep onto the
    request, range-checked by the daemon's own rules (so a bad value is a 400 naming its field, not a
    failed job)."""
    for name in SAMPLING:
        v = body.get(name)
        if v is None:
            continue
        if name in ("top_k", "seed", "min_tokens_to_keep"):
            if not _integer(v):
                raise bad(f"'{name}' must be an integer", name, "invalid_type")
            v = int(v)  # some clients send 40.0
            if name == "top_k" and v == -1:
                v = 0
            if name == "top_k" and v > WIRE_INT_MAX:  # sampling_problem bounds seed; the wire bounds top_k
                raise bad(f"top_k must be an integer in 0..2^64-1 (0 = off), got {P.shown(v)}", name)
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad(f"'{name}' must be a number", name, "invalid_type")
        # a number past a float's range (JSON's 10**400) stays an int: sampling_problem refuses it
        setattr(req, name, float(v) if name in ("temperature", "top_p", "min_p") and P.finite_number(v) else v)
    problem = P.sampling_problem(req.temperature, req.top_p, req.top_k, req.seed, req.min_p, req.min_tokens_to_keep)
    if problem is not None:
        field_name, message = problem
        if field_name == "top_k":
            message += "; -1 also means off"
        raise bad(message, field_name)


def _processors(body: dict) -> dict[str, Any]:
    """logit_bias, the penalties and their context sizes onto the submit, range-checked (OpenAI's
    ranges, then the daemon's own rules); absent or null: the daemon's default (off)."""
    out: dict[str, Any] = {}
    for name, (in_range, where) in _NUMBER_RANGE.items():
        v = body.get(name)
        if v is None:
            continue
        if not _number(v):
            raise bad(f"'{name}' must be a number", name, "invalid_type")
        if not in_range(v):  # NaN fails every comparison, so it lands here too
            raise bad(f"{name} must be {where}, got {P.shown(v)}", name)
        out[name] = float(v)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        v = body.get(name)
        if v is None:
            continue
        if not _integer(v):
            raise bad(f"'{name}' must be an integer", name, "invalid_type")
        out[name] = int(v)
    lb = body.get("logit_bias")
    if lb is not None:
        if not (isinstance(lb, dict) and all(_number(v) for v in lb.values())):
            raise bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias", "invalid_type")
        for k, v in lb.items():
            if not -BIAS_RANGE <= v <= BIAS_RANGE:
                raise bad(f"logit_bias values must be in [-{BIAS_RANGE}, {BIAS_RANGE}], got {P.shown(v)} for token "
                          f"{P.shown(k)}", "logit_bias")
        if lb:
            out["logit_bias"] = {k: float(v) for k, v in lb.items()}
    problem = P.processors_problem(out)  # token ids as keys, context sizes >= 1: the daemon's rules
    if problem is not None:
        raise bad(problem[1], problem[0])
    return out


def _unapplied(body: dict) -> list[str]:
    """Names of the sampling fields whose values ask for something the engine does not apply."""
    return [name for name, differs in _UNAPPLIED.items() if body.get(name) is not None and differs(body[name])]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    """An integer, as the fields that take one accept it: 40.0 too (some clients send every number
    as a float), never a boolean."""
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _positive_int(v: Any, name: str) -> int:
    """max_tokens / max_completion_tokens: an integer >= 1, written 16.0 too, as every integer
    field takes it (_integer; `16.0` was a 400 here alone, where seed and n took `7.0`)."""
    if not _integer(v):
        raise bad(f"'{name}' must be an integer", name, "invalid_type")
    v = int(v)
    if v < 1:
        raise bad(f"'{name}' must be an integer >= 1, got {P.shown(v)}", name)
    if v > WIRE_INT_MAX:  # past anything the daemon can be sent (its max_tokens_limit is far lower)
        raise bad(f"'{name}' is over the daemon's max_tokens_limit, got {P.shown(v)}", name)
    return v


def _stop(v: Any) -> list[str]:
    stops = [v] if isinstance(v, str) else v if v is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if (problem := P.stops_problem(stops)) is not None:
        raise bad(problem, "stop")
    return stops


def _message(m: Any, i: int) -> dict[str, str]:
    """One chat message as {role, content} text; content parts must all be text."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad(f"{param} must be an object with a string 'role'", param, "invalid_type")
    role, content = m["role"], m.get("content")
    if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
        raise bad(f"{param}: tool messages and tool calls are not supported by this server", param, "unsupported_parameter")
    if role not in ("system", "developer", "user", "assistant"):
        raise bad(f"{param}: unknown role {P.shown(role)}", f"{param}.role")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad(f"{param}.content: only text parts are supported", f"{param}.content", "unsupported_parameter")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"{param}.content must be a string or a list of text parts", f"{param}.content", "invalid_type")
    return {"role": "system" if role == "developer" else role, "content": content}


def _completion_prompt(p: Any) -> str | list[int]:
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p.strip():
            raise bad("'prompt' must not be empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad_id = next((t for t in p if not 0 <= t <= WIRE_INT_MAX), None)
        if bad_id is not None:  # the daemon checks the vocabulary's bound; these cannot even be sent
            raise bad(f"'prompt' token ids must be >= 0 and inside the vocabulary, got {P.shown(bad_id)}", "prompt")
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("batched prompts are not supported: send one prompt per request", "prompt", "unsupported_parameter")
    raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt",
              "missing_required_parameter" if p is None else "invalid_type")


def _template_args(v: Any) -> dict | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    for k in v:  # the daemon's own rule (a gateway list of its own once let {"self": 1} through as a 500)
        if not P.template_arg_allowed(k):
            raise bad(f"chat_template_kwargs: {P.shown(k)} cannot be set", "chat_template_kwargs")
    return dict(v) or None


# ----------------------------------------------------------------------------- daemon errors

# The daemon's error reply has no `param`, but its messages name the field they are about: the
# codec and type checks quote it ("field 'top_k' cannot be sent"), range checks start with it
# ("max_tokens must be in 1..8192"), the prompt checks speak of the prompt, its token ids or
# messages (or, over max_frame_bytes, of the frame the prompt made too big).
_QUOTED_FIELD = re.compile(r"\bfield '(\w+)'")
_LEADING_FIELD = re.compile(r"(max_tokens|temperature|top_p|top_k|seed|min_p|min_tokens_to_keep|verify[_ ]window|"
                            r"logit_bias|(?:repetition|presence|frequency)_(?:penalty|context_size))\b")
_PROMPT_WORDS = re.compile(r"\b(prompt|token ids?|messages?|frame of)\b", re.IGNORECASE)


def wire_field(message: str) -> str | None:
    """The submit field a daemon error message is about, when it names one: for a daemon that
    predates the error reply's `param` (and the client's own size check, which has none)."""
    if m := _QUOTED_FIELD.search(message):
        return m.group(1)
    if m := _LEADING_FIELD.match(message):
        return m.group(1).replace(" ", "_")
    if "stop sequence" in message:
        return "stop"
    return "prompt" if _PROMPT_WORDS.search(message) else None


def request_param(wire: str | None, req: GenRequest | None) -> str | None:
    """The request's own name for the submit field `wire` a daemon error is about (OpenAI's
    `param`): the prompt is `messages` in a chat, max_tokens is whichever field set it."""
    prompt = "messages" if req is not None and req.kind == "chat" else "prompt"
    names = {"token_ids": prompt, "text": prompt, "messages": prompt, "system": prompt, "prompt": prompt,
             "max_tokens": (req.max_tokens_param if req else None) or "max_tokens",
             "template_args": "chat_template_kwargs", "stop": "stop", "verify_window": "verify_window",
             **{k: k for k in SAMPLING}, **{k: k for k in PROCESSORS}}
    return names.get(wire) if wire else None


# ----------------------------------------------------------------------------- responses


def finish_reason(reason: str) -> str:
    """The daemon's finish reason in OpenAI's words (cancelled and timeout pass through)."""
    return reason if reason in ("stop", "length", "cancelled", "timeout") else "stop"


def usage(stats: dict) -> dict[str, Any]:
    prompt, gen = int(stats.get("prompt_tokens", 0)), int(stats.get("generated_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
            "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_prompt_tokens", 0))}}


def engine_facts(job_id: str, stats: dict) -> dict[str, Any]:
    """The `dflash` extension field: the job, the sampling the worker applied (temperature, top_p,
    top_k, seed: the one drawn when none was given, min_p, min_tokens_to_keep), its verify window
    and the speculative-decoding numbers."""
    keys = ("verify_window", "acceptance", "tokens_per_cycle", "cycles", "accepted_drafts", "ttft_s", "prefill_tps",
            "decode_tps")
    return {"job_id": job_id, "sampling": stats.get("sampling"), **{k: stats.get(k) for k in keys}}


def response(kind: str, rid: str, created: int, model: str, text: str, reason: str, stats: dict, job_id: str) -> dict:
    """A whole (non-streamed) chat.completion or text_completion object."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason(reason)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [choice], "usage": usage(stats), "dflash": engine_facts(job_id, stats)}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None,
          reason: str | None = None, role: bool = False) -> dict:
    """One streamed chunk: a text piece, the opening role (chat), or the finish reason."""
    fr = finish_reason(reason) if reason else None
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fr}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": fr}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None, "choices": [choice]}


def usage_chunk(kind: str, rid: str, created: int, model: str, stats: dict, job_id: str) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage(stats), "dflash": engine_facts(job_id, stats)}
