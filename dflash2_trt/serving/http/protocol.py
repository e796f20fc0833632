"""OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` requests checked into a :class:`ParsedRequest` (its
generation options one :class:`~dflash2_trt.runtime.request.GenerationRequest`), and the bodies of the answers
(standard library only; :mod:`dflash2_trt.serving.http.app` serves them).

Parameters (both routes, OpenAI's names and defaults)::

    model               required; must name the served model (else 404 model_not_found)
    max_tokens          int >= 1; chat also max_completion_tokens. Default: chat, the rest of the context;
                        completions, 16 (OpenAI's). prompt + max_tokens beyond the export's positions: 400
    temperature         number in [0, 2], default 1; 0 is greedy (the target's own tokens)
    top_p, top_k, min_p, presence_penalty, frequency_penalty, repetition_penalty, logit_bias
                        the sampling transforms (top_k, min_p, repetition_penalty: vLLM's extensions), checked by
                        the GenerationRequest they become (runtime/sampling.py); lossless under speculation
    logprobs            chat: bool, with top_logprobs (0..20); completions: int 0..5 (the top count). The target's
                        log-probabilities after the transforms, per generated token
    echo                completions: the prompt's text before the completion (with logprobs: the prompt tokens'
                        too, the first one's null)
    n                   1..MAX_N choices per prompt (each its own sampling stream: seed + index when a seed is given)
    seed                int in [0, 2^63); none: a fresh random stream
    stop                a string or up to 4; the text ends before the first one (finish_reason "stop")
    stream              bool; stream_options {"include_usage": bool} with it
    best_of, suffix     accepted at their neutral value only (best_of = 1, no suffix): anything else is a 400
                        naming the parameter, never ignored
    user                a string, unused
    store, metadata, reasoning_effort, service_tier, ...
                        harmless keys (:data:`HARMLESS`) that change nothing here: ignored, each with a logged
                        warning (``strict``, ``dflash2 serve --strict-params``: refused as unknown)
    ignore_eos          bool (vLLM's extension): decode max_tokens tokens whatever the target's EOS
    messages            chat: [{"role": system|developer|user|assistant, "content": str | [{"type": "text",
                        "text": str}, ...]}], rendered with the target's chat template
    prompt              completions: a str (raw text, no template) or token ids, or a list of up to MAX_PROMPTS
                        of them (one choice per prompt and n, index prompt x n + j)

Any other key is refused as OpenAI refuses it ("Unrecognized request argument supplied"). A body nested more than
:data:`MAX_DEPTH` levels is ``invalid_json``; a string holding a lone UTF-16 surrogate (``"\\ud800"``, which no
UTF-8 text holds) is refused naming its field, not replaced. Every refusal is a :class:`RequestError` whose
:meth:`~RequestError.body` is OpenAI's error object.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.serving.http import tools

CHAT, COMPLETION = "chat", "completion"
MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_SEED = 2**63 - 1
MAX_ECHO = 80  # characters of a refused value quoted back in an error message
MAX_DEPTH = 32  # JSON nesting a request body may have (the bodies this server takes are at most 5 deep)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 32  # prompts in one completions request
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on completions' logprobs
# keys OpenAI clients send that change nothing this server does: ignored with a warning (refused when strict)
HARMLESS = ("store", "metadata", "reasoning_effort", "service_tier", "prompt_cache_key", "safety_identifier",
            "verbosity", "modalities", "prediction", "web_search_options")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}  # -> the template's

# parameters accepted only at their neutral value (None is always fine): name -> the values that change nothing
_NEUTRAL_COMMON: dict[str, tuple] = {}
# the sampling transforms: passed to the GenerationRequest by name, which checks them
SAMPLING = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
_NEUTRAL = {
    CHAT: {**_NEUTRAL_COMMON},
    COMPLETION: {**_NEUTRAL_COMMON, "best_of": (1,), "suffix": ("",)},
}
_PARAMS_COMMON = {"model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options", "user",
                  "ignore_eos", "n", "logprobs", *SAMPLING}
_PARAMS = {CHAT: _PARAMS_COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL[CHAT]) | set(tools.CHAT_KEYS)
           | set(tools.GUIDED_KEYS),
           COMPLETION: _PARAMS_COMMON | {"prompt"} | set(_NEUTRAL[COMPLETION]) | set(tools.GUIDED_KEYS)}
_PARAMS[CHAT] |= {"top_logprobs"}  # logprobs' companions, one per route
_PARAMS[COMPLETION] |= {"echo"}


class RequestError(DFlash2Error):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object (``type``, ``param``, ``code``)."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        return error_body(str(self), self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,  # noqa: A002
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    """One checked request: what the route answers (``kind``, ``model``, stop strings, streaming), the prompt (chat
    messages [{"role", "content": str}], raw text or token ids) and the generation options as one record —
    ``max_tokens`` as its ``max_new_tokens`` (None: the route's default, :func:`max_tokens_for`), ``temperature``
    (OpenAI's default 1), ``seed`` (none: a fresh stream), ``ignore_eos`` as ``eos_ids`` = {}, the sampling
    transforms and logprobs as theirs (``echo`` with logprobs: ``prompt_logprobs``)."""

    kind: str  # CHAT | COMPLETION
    model: str
    prompt: str | list[int] | list[dict[str, str]]
    request: GenerationRequest
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices per prompt
    more_prompts: list = field(default_factory=list)  # completions: the prompts after the first
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    ignored: list[str] = field(default_factory=list)  # harmless keys given and ignored (the server logs them)
    tools: tools.ToolSetup | None = None  # chat: the request's tools (server/tools), None without


def prompts_of(spec: ParsedRequest) -> list:
    """Every prompt of a request (completions may hold several; one choice per prompt and n)."""
    return [spec.prompt, *spec.more_prompts]


# -- parsing ---------------------------------------------------------------------------------------------------

def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object (NaN / Infinity refused: they are not JSON), checked as a whole by
    :func:`check_tree` (nesting depth, lone surrogates)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nesting past the parser's stack
        raise RequestError("We could not parse the JSON body of your request. The body must be a JSON object.",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("The body of your request must be a JSON object.", code="invalid_json")
    check_tree(body)
    return body


def _where(path: str, key: Any) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)


def _lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # the one str that UTF-8 cannot hold: a lone UTF-16 surrogate (JSON's "\ud800")
        return True
    return False


def check_tree(body: dict) -> None:
    """Every value of a parsed body, iteratively: containers at most :data:`MAX_DEPTH` deep (an OpenAI request
    is a few levels; the deep ones only cost stack and log space) and no string, key or value, holding a lone
    UTF-16 surrogate (JSON escapes one, no tokenizer or UTF-8 encoder takes it; clients that cut text mid-emoji
    send them) -> RequestError naming the field."""
    todo: list[tuple[Any, str, int]] = [(body, "", 1)]
    while todo:
        node, path, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"The JSON body of your request is nested more than {MAX_DEPTH} levels deep.",
                               path or None, code="invalid_json")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str) and _lone_surrogate(k):
                raise RequestError(f"Invalid key in '{path or 'the body'}': it holds a lone UTF-16 surrogate, "
                                   f"which is not Unicode text", path or None, code="invalid_value")
            if isinstance(v, str):
                if _lone_surrogate(v):
                    where = _where(path, k)
                    raise RequestError(f"Invalid value for '{where}': the text holds a lone UTF-16 surrogate, "
                                       f"which is not Unicode text", where, code="invalid_value")
            elif isinstance(v, (dict, list)):
                todo.append((v, _where(path, k), depth + 1))


def _type_error(name: str, expected: str, v: Any) -> RequestError:
    got = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
           dict: "an object"}.get(type(v), type(v).__name__)
    return RequestError(f"Invalid type for '{name}': expected {expected}, but got {got} instead.", name,
                        code="invalid_type")


def _required(body: dict, name: str, kind: type | None = None, expected: str = "") -> Any:
    """``body[name]``, or the missing-parameter error; with ``kind``: of that type, or the type error (``expected``)."""
    v = body.get(name)
    if v is None:
        raise RequestError(f"you must provide a {name} parameter", name, code="missing_required_parameter")
    if kind is not None and not isinstance(v, kind):
        raise _type_error(name, expected, v)
    return v


def _integer(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    if v < lo or (hi is not None and v > hi):
        raise RequestError(f"Invalid value for '{name}': {v}; it must be "
                           + (f">= {lo}." if hi is None else f"in [{lo}, {hi}]."), name, code="invalid_value")
    return v


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _type_error(name, "a number", v)
    if not lo <= v <= hi:
        raise RequestError(f"Invalid value for '{name}': {v}; it must be in [{lo:g}, {hi:g}].", name,
                           code="invalid_value")
    return float(v)


def _boolean(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _shown(v: Any) -> str:
    """``v`` as JSON to quote in an error message when it is short, else "" (50 tools are not echoed back)."""
    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= MAX_ECHO else ""


def _same(v: Any, w: Any) -> bool:  # JSON equality: true is not 1
    return isinstance(v, bool) == isinstance(w, bool) and v == w


def _common(body: dict, kind: str, strict: bool = False) -> dict:
    ignored = [] if strict else sorted(k for k in set(body) & set(HARMLESS) if body[k] is not None)
    unknown = sorted(set(body) - _PARAMS[kind] - set(HARMLESS if not strict else ()))
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0],
                           code="unknown_parameter")
    for name, ok in _NEUTRAL[kind].items():
        v = body.get(name)
        if v is not None and not any(_same(v, w) for w in ok):
            shown = _shown(v)
            raise RequestError(f"'{name}'{f' = {shown}' if shown else ''} is not supported by this server"
                               + (f" (it takes {' or '.join(json.dumps(w) for w in ok)} only)" if ok else ""), name,
                               code="unsupported_value")
    model = _required(body, "model", str, "a string")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"Invalid value for 'stop': a non-empty string or a list of at most {MAX_STOPS} of them",
                           "stop", code="invalid_value")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise RequestError("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                               "stream_options", code="invalid_value")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise RequestError("Invalid value for 'stream_options': only {\"include_usage\": bool} is supported",
                               "stream_options", code="invalid_value")
        include_usage = _boolean(options, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _type_error("user", "a string", user)
    temperature = _number(body, "temperature", 0.0, 2.0)
    n = _integer(body, "n", 1, MAX_N)
    sampling = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    if kind == CHAT:
        lp = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, 20)
        if top is not None and not lp:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs", code="invalid_value")
        logprobs = {"logprobs": lp, "top_logprobs": top or 0}
    else:
        top = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        logprobs = {"logprobs": top is not None, "top_logprobs": top or 0}
    return {"kind": kind, "model": model, "max_tokens": _integer(body, "max_tokens", 1),
            "temperature": 1.0 if temperature is None else temperature,
            "seed": _integer(body, "seed", 0, MAX_SEED), "stop": stops, "stream": stream,
            "include_usage": include_usage, "ignore_eos": _boolean(body, "ignore_eos"),
            "n": n or 1, "sampling": {**sampling, **logprobs}, "ignored": ignored,
            **_structured(body, kind)}


def _structured(body: dict, kind: str) -> dict:
    """The request's grammar and tools (server/tools), a refusal as a 400 naming the parameter."""
    try:
        return {"grammar": tools.parse_grammar(body, kind == CHAT),
                "tools": tools.parse_tools(body) if kind == CHAT else None}
    except tools.ToolError as e:
        raise RequestError(str(e), e.param, code="invalid_value") from None


def _content(i: int, content: Any) -> str:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"Invalid value for '{where}[{j}]': only text parts "
                                   f"({{\"type\": \"text\", \"text\": ...}}) are supported", f"{where}[{j}]",
                                   code="invalid_value")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _type_error(where, "a string or an array of text parts", content)


def _record(**fields: Any) -> GenerationRequest:
    """The GenerationRequest of ``fields``; its refusal of a sampling or logprobs field (the record checks them) a
    RequestError naming the field."""
    try:
        return GenerationRequest(**fields)
    except DFlash2Error as e:
        name = next((k for k in sorted(fields, key=len, reverse=True) if str(e).startswith(k)), None)
        raise RequestError(f"Invalid value for '{name}': {e}" if name else str(e), name,
                           code="invalid_value") from None


def _parsed(c: dict, prompt: str | list[int] | list[dict[str, str]]) -> ParsedRequest:
    """The checked body's fields (:func:`_common`) and its prompt -> the ParsedRequest with its GenerationRequest."""
    sampling = c.pop("sampling")  # checked by the record: its DFlash2Error is a 400
    if c.get("echo") and sampling["logprobs"]:
        sampling["prompt_logprobs"] = True
    options = _record(max_new_tokens=c.pop("max_tokens"), temperature=c.pop("temperature"),
                      seed=c.pop("seed"), eos_ids=frozenset() if c.pop("ignore_eos") else None, **sampling,
                      grammar=c.pop("grammar"))
    if options.grammar is not None and c["tools"] is not None and c["tools"].active:
        raise RequestError("give tools or a response format, not both (tool_choice 'none' to use the format)",
                           "response_format", code="invalid_value")
    return ParsedRequest(prompt=prompt, request=options, **c)


def parse_chat(body: dict, strict: bool = False) -> ParsedRequest:
    """A ``/v1/chat/completions`` body -> its ParsedRequest, or RequestError; ``strict``: harmless keys refused."""
    c = _common(body, CHAT, strict)
    if body.get("max_tokens") is None:
        c["max_tokens"] = _integer(body, "max_completion_tokens", 1)
    elif body.get("max_completion_tokens") is not None:
        raise RequestError("give one of 'max_tokens' and 'max_completion_tokens'", "max_completion_tokens",
                           code="invalid_value")
    msgs = _required(body, "messages", list, "an array")
    if not msgs:
        raise RequestError("'messages' must hold at least one message", "messages", code="invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise RequestError(f"Unrecognized argument in 'messages[{i}]': {extra[0]}", f"messages[{i}].{extra[0]}",
                               code="unknown_parameter")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"Invalid value for 'messages[{i}].role': {_shown(role) or 'a long value'}; "
                               f"supported roles: {', '.join(ROLES)}", f"messages[{i}].role", code="invalid_value")
        calls = m.get("tool_calls")
        if calls is not None:
            _tool_calls(i, role, calls)
        if "content" not in m and not calls:
            raise RequestError(f"'messages[{i}]' has no content", f"messages[{i}].content",
                               code="missing_required_parameter")
        msg = {"role": ROLES[role], "content": "" if calls and m.get("content") is None else _content(i, m["content"])}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id", ""), str):
                raise _type_error(f"messages[{i}].tool_call_id", "a string", m["tool_call_id"])
            msg["tool_call_id"] = m.get("tool_call_id", "")
        out.append(msg)
    return _parsed(c, out)


def _tool_calls(i: int, role: str, calls: Any) -> None:
    """An assistant message's tool_calls in the history: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]."""
    where = f"messages[{i}].tool_calls"
    if role != "assistant":
        raise RequestError(f"'{where}' is only for assistant messages", where, code="invalid_value")
    if not isinstance(calls, list):
        raise _type_error(where, "an array", calls)
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments", ""), str)):
            raise RequestError(f"Invalid value for '{where}[{j}]': {{\"type\": \"function\", \"function\": "
                               f"{{\"name\": str, \"arguments\": str}}}}", f"{where}[{j}]", code="invalid_value")


def _one_prompt(p: Any, where: str) -> str | list[int]:
    if isinstance(p, str):
        if not p:
            raise RequestError(f"'{where}' must not be empty", where, code="invalid_value")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    raise _type_error(where, "a string or a non-empty array of token ids", p)


def parse_completion(body: dict, strict: bool = False) -> ParsedRequest:
    """A ``/v1/completions`` body -> its ParsedRequest, or RequestError; ``strict``: harmless keys refused."""
    c = _common(body, COMPLETION, strict)
    c["echo"] = _boolean(body, "echo")
    p = _required(body, "prompt")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):  # a batch of prompts
        if len(p) > MAX_PROMPTS:
            raise RequestError(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt",
                               code="invalid_value")
        prompts = [_one_prompt(q, f"prompt[{i}]") for i, q in enumerate(p)]
    else:
        prompts = [_one_prompt(p, "prompt")]
    return dataclasses.replace(_parsed(c, prompts[0]), more_prompts=prompts[1:])


def max_tokens_for(spec: ParsedRequest, prompt_len: int, positions: int) -> int:
    """The request's max_tokens (its route's default when not given), checked against the context: prompt +
    max_tokens <= ``positions`` (the export's cache capacity), else OpenAI's context_length_exceeded."""
    room = positions - prompt_len
    m = spec.request.max_new_tokens
    if m is None:
        m = room if spec.kind == CHAT else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if room < 1 or prompt_len + m > positions:
        where = "messages" if spec.kind == CHAT else "prompt"
        raise RequestError(f"This model's maximum context length is {positions} tokens. However, you requested "
                           f"{prompt_len + max(m, 1)} tokens ({prompt_len} in the {where}, {max(m, 1)} in the "
                           f"completion). Please reduce the length of the {where} or completion.", where,
                           code="context_length_exceeded")
    return m


# -- stop strings ------------------------------------------------------------------------------------------------

class StopText:
    """A response's text as it streams, cut before the first stop string: :meth:`add` takes each new piece and
    returns what may be sent now (a tail that could begin a stop string waits); :attr:`hit` is set once a stop
    string appeared (the text then ends before it, and ``end`` is where the stop string ended in the decoded text);
    :meth:`flush` returns what waited, once the decoding ended without a stop."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text, self.sent, self.hit, self.end = "", 0, False, 0

    def add(self, piece: str) -> str:
        if self.hit:
            return ""
        self.text += piece
        found = [(i, s) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if found:
            i, s = min(found)
            self.hit, self.end = True, i + len(s)
            out, self.text = self.text[self.sent:i], self.text[:i]
            self.sent = i
            return out
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.text) - self.sent), 0, -1)
                    if self.text.endswith(s[:n])), default=0)
        out = self.text[self.sent:len(self.text) - keep]
        self.sent += len(out)
        return out

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


# -- answers -----------------------------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the prefix cache restored instead of computing."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _choice(kind: str, text: str | None, finish: str | None, stream: bool, first: bool = False,
            logprobs: dict | None = None) -> dict:
    if kind == COMPLETION:
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}
    delta: dict = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(lps: list, decode: Any) -> dict:
    """OpenAI's chat logprobs object of TokenLogprobs (runtime/sampling.py); ``decode``: ids -> text."""
    return {"content": [{**_entry(decode([lp.token]), lp.logprob),
                         "top_logprobs": [_entry(decode([t]), v) for t, v in lp.top]} for lp in lps]}


def completion_logprobs(lps: list, decode: Any, offset: int = 0, first_null: bool = False) -> dict:
    """OpenAI's legacy completions logprobs object of TokenLogprobs: tokens, token_logprobs, top_logprobs (token
    text -> logprob), text_offset (from ``offset`` in the choice's text); ``first_null``: the first entry is the
    prompt's first token, which has no logprob (echo)."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, lp in enumerate(lps):
        text = decode([lp.token])
        null = first_null and i == 0
        out["tokens"].append(text)
        out["token_logprobs"].append(None if null else lp.logprob)
        out["top_logprobs"].append(None if null else {decode([t]): v for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def answer(kind: str, rid: str, created: int, model: str, text: str, finish: str, use: dict,
           stats: dict, logprobs: dict | None = None) -> dict:
    """The non-streaming body; ``stats``: the decoding figures, under the ``dflash2`` extension field."""
    return {"id": rid, "object": "chat.completion" if kind == CHAT else "text_completion", "created": created,
            "model": model, "choices": [_choice(kind, text, finish, False, logprobs=logprobs)], "usage": use,
            "dflash2": stats}


def merge_answers(bodies: list[dict], n: int) -> dict:
    """The bodies of a request's choices (prompt i's j-th at i x n + j) -> one body: the choices indexed, the usage
    summed (each prompt's tokens counted once), ``dflash2`` one entry per choice."""
    out = dict(bodies[0])
    out["choices"] = [{**b["choices"][0], "index": k} for k, b in enumerate(bodies)]
    out["usage"] = merge_usage([b["usage"] for b in bodies], n)
    out["dflash2"] = [b["dflash2"] for b in bodies]
    return out


def merge_usage(uses: list[dict], n: int) -> dict:
    """The usage of a request's choices (see :func:`merge_answers`)."""
    firsts = uses[::n]
    return usage(sum(u["prompt_tokens"] for u in firsts), sum(u["completion_tokens"] for u in uses),
                 sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts))


def chunk(kind: str, rid: str, created: int, model: str, text: str | None = None, finish: str | None = None,
          first: bool = False, logprobs: dict | None = None, **extra: Any) -> dict:
    """One streamed chunk (OpenAI's chunk object); ``first``: chat's opening role delta; ``logprobs``: those of
    its tokens; ``extra``: top-level fields (``dflash2`` on the finishing chunk)."""
    return {"id": rid, "object": "chat.completion.chunk" if kind == CHAT else "text_completion",
            "created": created, "model": model, "choices": [_choice(kind, text, finish, True, first, logprobs)],
            **extra}


def usage_chunk(kind: str, rid: str, created: int, model: str, use: dict) -> dict:
    """stream_options.include_usage: the last chunk, no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if kind == CHAT else "text_completion",
            "created": created, "model": model, "choices": [], "usage": use}


def sse(obj: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
