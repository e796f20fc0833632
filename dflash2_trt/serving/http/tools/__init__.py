"""Structured outputs and tool calls for ``dflash2 serve``: the request's ``response_format`` / vLLM's ``guided_*`` /
``structured_outputs`` as a :class:`~dflash2_trt.runtime.grammar.GrammarSpec`, ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` as a :class:`ToolSetup`, the prompt rendered with the tools, and the answer parsed back into
``message.tool_calls`` (whole or as OpenAI's streamed deltas).

Tool formats, one module each, chosen from the chat template (:func:`family_of`):

    family       template sign              calls look like                                  forced by a grammar
    hermes       ``<tool_call>``            <tool_call>{"name", "arguments"}</tool_call>     yes (Lark + JSON schema)
    llama3       ``<|python_tag|>``         {"name", "parameters"}                            yes (JSON schema)
    gpt_oss      ``<|channel|>``            <|channel|>commentary to=functions.NAME ...       yes (Lark + JSON schema)
    qwen3_coder  ``<function=``             <tool_call><function=NAME><parameter=K>v ...      yes (Lark per parameter)
    generic      no tool support            {"tool_calls": [{"name", "arguments"}]}            yes (JSON schema)

The generic format (llama.cpp's generic handler) makes every target able to call tools: the tools are described in
a system message and the answer is one JSON object the grammar forces (``{"response": ...}`` for text under
``tool_choice`` auto). ``required`` and a named function are forced valid by the grammar in every family.

Streaming: the text of a request with tools is held until the answer ends, then sent as OpenAI sends calls — per
call a delta with its index, id, type and name (arguments ""), then its arguments in fragments — so a client never
sees a half-parsed call. A thinking template's ``<think>...</think>`` becomes ``reasoning_content``.

Modules: this one (the request's parameters, the family table, rendering, answers and deltas); ``common`` (the
parsed answer, a call's schema, <think> splitting); one per family: ``hermes``, ``llama3``, ``gpt_oss``,
``qwen3_coder``, ``generic``. Imports: the standard library, :mod:`dflash2_trt.errors` and
:mod:`dflash2_trt.runtime.grammar` only (the protocol imports this package and turns a :class:`ToolError` into its
400).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.runtime.grammar import GrammarSpec
from dflash2_trt.serving.http.tools import gpt_oss, hermes, llama3, qwen3_coder
from dflash2_trt.serving.http.tools import generic as generic_format
from dflash2_trt.serving.http.tools.common import Parsed, arguments_text, split_think

# family -> its parser (one module each): parse(text, tools) -> Parsed (tools: the request's function definitions)
PARSERS = {"hermes": hermes.parse, "llama3": llama3.parse, "gpt_oss": gpt_oss.parse,
           "qwen3_coder": qwen3_coder.parse, "generic": generic_format.parse}
# the request keys this module reads (the protocol accepts them)
CHAT_KEYS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")
GUIDED_KEYS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")
ARGUMENT_FRAGMENT = 16  # characters of arguments per streamed delta


@dataclass(frozen=True)
class ToolSetup:
    """A request's tools: ``tools`` the function definitions, ``choice`` 'auto' | 'none' | 'required' | a function
    name, ``parallel`` whether several calls may come in one answer."""

    tools: tuple
    choice: str
    parallel: bool = True

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def offered(self) -> list[dict]:
        """The tools the answer may call (a named choice: that one)."""
        if self.choice in ("auto", "required", "none"):
            return list(self.tools)
        return [t for t in self.tools if t["function"]["name"] == self.choice]


class ToolError(DFlash2Error):
    """A refused structured-output or tools parameter: ``param`` names it (the protocol answers a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _error(message: str, param: str) -> Exception:
    return ToolError(message, param)


def _spec(kind: str, text: Any, param: str) -> GrammarSpec:
    try:
        return GrammarSpec(kind, text)
    except DFlash2Error as e:
        raise _error(f"Invalid '{param}': {e}", param) from None


def parse_grammar(body: dict, chat: bool) -> GrammarSpec | None:
    """The request's output grammar from ``response_format`` (chat) or vLLM's names; at most one of them."""
    given = [k for k in (("response_format",) if chat else ()) + GUIDED_KEYS if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None and isinstance(rf, dict) and rf.get("type") == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise _error(f"give one of {', '.join(given)}", given[1])
    if not given:
        return None
    key = given[0]
    v = body[key]
    if key == "response_format":
        if not isinstance(v, dict) or v.get("type") not in ("json_object", "json_schema"):
            raise _error("'response_format.type' must be text, json_object or json_schema", "response_format")
        if v["type"] == "json_object":
            return _spec("json_object", "", key)
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise _error("'response_format.json_schema' must be an object with a 'schema' object", key)
        return _spec("json_schema", json.dumps(js.get("schema") or {"type": "object"}), key)
    if key == "structured_outputs":
        if not isinstance(v, dict) or len([k for k in v if v[k] is not None]) != 1:
            raise _error("'structured_outputs' takes one of json, regex, grammar, choice", key)
        (k2, v), = [(k, x) for k, x in v.items() if x is not None]
        key = {"json": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
               "choice": "guided_choice"}.get(k2, "")
        if not key:
            raise _error(f"'structured_outputs.{k2}' is not supported (json, regex, grammar, choice)", k2)
    if key == "guided_json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise _error("'guided_json' must be a JSON schema", key) from None
        if not isinstance(v, dict):
            raise _error("'guided_json' must be a JSON schema object", key)
        return _spec("json_schema", json.dumps(v), key)
    if key == "guided_choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) for c in v)):
            raise _error("'guided_choice' must be a list of strings", key)
        return _spec("regex", "|".join(re.escape(c) for c in v), key)
    if not isinstance(v, str):
        raise _error(f"'{key}' must be a string", key)
    return _spec("regex" if key == "guided_regex" else "lark", v, key)


def parse_tools(body: dict) -> ToolSetup | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> a ToolSetup (None without tools)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _error("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _error("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _error("'tools' must be an array", "tools")
    names = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(f, dict)
                and isinstance(f.get("name"), str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f["name"])):
            raise _error(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                         f"\"parameters\": {{...}}}}}} with a name of [A-Za-z0-9_.-]{{1,64}}", f"tools[{i}]")
        p = f.get("parameters")
        if p is not None:
            if not isinstance(p, dict):
                raise _error(f"'tools[{i}].function.parameters' must be a JSON schema object", f"tools[{i}]")
            _spec("json_schema", json.dumps(p), f"tools[{i}].function.parameters")
        names.append(f["name"])
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        f = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(f, dict) and f.get("name") in names):
            raise _error("'tool_choice' names no function of 'tools'", "tool_choice")
        choice = f["name"]
    elif choice not in ("none", "auto", "required"):
        raise _error("'tool_choice' must be none, auto, required or {\"type\": \"function\", ...}", "tool_choice")
    return ToolSetup(tuple(tools), choice, True if parallel is None else parallel)


def family_of(template: str | None) -> str:
    """The tool format of a chat template (the table in the module docstring)."""
    t = template or ""
    if "tools" not in t:
        return "generic"
    if "<|channel|>" in t:
        return "gpt_oss"
    if "<function=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3"
    return "generic"


def special_tokens(tokenizer: Any) -> set[str]:
    """The texts of the tokenizer's special added tokens (gpt-oss's harmony markers are, on its own tokenizer)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        return set()
    return {t.content for t in tok.get_added_tokens_decoder().values() if t.special}


def tool_grammar(setup: ToolSetup | None, family: str, tokenizer: Any = None) -> GrammarSpec | None:
    """The grammar that forces a valid call (required / named) or, generic under auto, the JSON answer;
    ``tokenizer``: the target's (:class:`~dflash2_trt.runtime.tokenizer.TextTokenizer`), whose special tokens a
    format's markers are written as."""
    if setup is None or not setup.active:
        return None
    forced = setup.choice != "auto"
    offered = setup.offered
    if family == "generic":
        return GrammarSpec("json_schema", json.dumps(generic_format.schema(offered, forced, setup.parallel)))
    if not forced:
        return None
    if family == "hermes":
        return GrammarSpec("lark", hermes.lark(offered, setup.parallel))
    if family == "llama3":
        return GrammarSpec("json_schema", json.dumps(llama3.schema(offered)))
    if family == "gpt_oss":
        special = set(gpt_oss.MARKERS) <= special_tokens(tokenizer)
        return GrammarSpec("lark", gpt_oss.lark(offered, setup.parallel, special))
    if family == "qwen3_coder":
        return GrammarSpec("lark", qwen3_coder.lark(offered, setup.parallel))
    return None


def _history(messages: list[dict], family: str) -> list[dict]:
    """Assistant tool calls and tool results for the template: its own fields where it takes tools, else text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if family != "generic":
            mm = dict(m)
            if calls:
                mm["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"].get(
                    "arguments", "{}"))}} for c in calls]
            out.append(mm)
        elif calls:
            text = json.dumps({"tool_calls": [{"name": c["function"]["name"],
                                               "arguments": _loads(c["function"].get("arguments", "{}"))}
                                              for c in calls]})
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"Tool result ({m.get('tool_call_id', '')}): {m.get('content')}"})
        else:
            out.append({"role": m["role"], "content": m["content"] or ""})
    return out


def _loads(a: Any) -> Any:
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def render(tokenizer: Any, messages: list[dict], setup: ToolSetup | None) -> list[int]:
    """The chat prompt's ids: the tools through the template where it takes them, else the generic system
    message; the history's tool calls and results in the family's form."""
    family = family_of(tokenizer.chat_template)
    msgs = _history(messages, family)
    if setup is None or not setup.active:
        return tokenizer.apply_chat_template(msgs)
    if family != "generic":
        return tokenizer.apply_chat_template(msgs, tools=list(setup.tools))
    text = generic_format.system_text(setup.offered, setup.choice != "auto")
    if msgs and msgs[0]["role"] == "system":
        msgs = [{"role": "system", "content": msgs[0]["content"] + "\n\n" + text}] + msgs[1:]
    else:
        msgs = [{"role": "system", "content": text}] + msgs
    return tokenizer.apply_chat_template(msgs)


def answer_text(tokenizer: Any, tokens: list[int], text: str) -> str:
    """The text a family's parser reads of an answer (``tokens``, decoded as ``text``): gpt-oss's harmony markers are
    special tokens, which decoding drops, so its answer is decoded again with them kept; the others' is ``text``."""
    if family_of(tokenizer.chat_template) != "gpt_oss":
        return text
    return tokenizer.decode(list(tokens), skip_special_tokens=False)


def split_answer(text: str, setup: ToolSetup | None, template: str | None) -> Parsed:
    """The answer's text -> content, calls and reasoning (calls only when the request has active tools)."""
    reasoning, rest = split_think(text) if template and "<think>" in template else (None, text)
    if setup is None or not setup.active:
        return Parsed(content=rest, reasoning=reasoning)
    p = PARSERS[family_of(template)](rest, setup.tools)
    if p.reasoning is None:
        p.reasoning = reasoning
    return p


def message(p: Parsed, finish: str) -> tuple[dict, str]:
    """A whole answer's message and finish_reason ('tool_calls' when it calls)."""
    msg: dict = {"role": "assistant", "content": p.content}
    if p.reasoning is not None:
        msg["reasoning_content"] = p.reasoning
    if p.calls:
        msg["tool_calls"] = [{"id": _call_id(), "type": "function",
                              "function": {"name": name, "arguments": arguments_text(args)}} for name, args in p.calls]
        finish = "tool_calls" if finish == "stop" else finish
    return msg, finish


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def fragments(arguments: str) -> list[str]:
    """A call's arguments as the streamed pieces (together: the whole text)."""
    return [arguments[i: i + ARGUMENT_FRAGMENT] for i in range(0, len(arguments), ARGUMENT_FRAGMENT)] or [""]


def deltas(p: Parsed) -> list[dict]:
    """The streamed deltas of a finished answer, in OpenAI's order: reasoning, content, then per call its name
    delta (index, id, type, name, arguments "") and its arguments' fragments."""
    out: list[dict] = []
    if p.reasoning:
        out.append({"reasoning_content": p.reasoning})
    if p.content:
        out.append({"content": p.content})
    for i, (name, args) in enumerate(p.calls):
        out.append({"tool_calls": [{"index": i, "id": _call_id(), "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        out += [{"tool_calls": [{"index": i, "function": {"arguments": f}}]} for f in fragments(arguments_text(args))]
    return out


def with_grammar(request: Any, grammar: GrammarSpec | None) -> Any:
    """The request record with the tools' grammar (a response_format grammar given too: 400 by the caller)."""
    return request if grammar is None else dataclasses.replace(request, grammar=grammar)
