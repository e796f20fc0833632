"""Tokenizer of an export folder through ``tokenizers`` alone; chat templates rendered with jinja2.

Matches transformers' ``apply_chat_template`` (sandboxed jinja2 with ``trim_blocks``/``lstrip_blocks``,
the tokenizer's special tokens in scope, the rendered text tokenized without adding special tokens) and
``decode(..., skip_special_tokens=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash2_trt.errors import DFlash2Error


def _token_str(v) -> str | None:  # noqa: ANN001
    if isinstance(v, dict):  # AddedToken serialisation
        return v.get("content")
    return v if isinstance(v, str) else None


class TextTokenizer:
    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer

        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise DFlash2Error(f"{path} is missing (the tokenizer is needed at run time)")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type
            raise DFlash2Error(f"cannot read {path} (corrupt tokenizer): {e}") from None
        cfg = {}
        if (d / "tokenizer_config.json").is_file():
            try:
                cfg = json.loads((d / "tokenizer_config.json").read_text())
            except ValueError as e:
                raise DFlash2Error(f"{d / 'tokenizer_config.json'} is not valid JSON: {e}") from None
        tpl = d / "chat_template.jinja"
        self.chat_template: str | None = tpl.read_text() if tpl.is_file() else cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")
        self._template: Any = None  # the chat template compiled on first use
        self.special_tokens = {k: _token_str(cfg.get(k)) for k in
                               ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")}

    def encode(self, text: str) -> list[int]:
        """Raw text -> ids, no special tokens added."""
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The messages through the chat template (``tools``: OpenAI's function definitions, for a template
        that renders them)."""
        import jinja2

        try:
            return self._compiled_template().render(
                messages=messages, add_generation_prompt=add_generation_prompt, **({"tools": tools} if tools else {}),
                **{k: v for k, v in self.special_tokens.items() if v is not None})
        except jinja2.TemplateError as e:
            raise DFlash2Error(f"cannot render the chat template: {e}") from None

    def _compiled_template(self) -> Any:
        """The chat template compiled once (compiling costs ~50 ms a request on the demo's template, a tenth of a
        cached turn's time to first token)."""
        if self._template is None:
            if not self.chat_template:
                raise DFlash2Error("the target's tokenizer has no chat template")
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise DFlash2Error(f"chat template: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise DFlash2Error(f"cannot render the chat template: {e}") from None
        return self._template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))
