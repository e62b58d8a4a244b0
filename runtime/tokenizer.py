"""Tokenizer from the store's tokenizer/ files: `tokenizers` for BPE, jinja2 for chat templates."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path


class TokenizerError(RuntimeError):
    pass


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: {e}") from None


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, directory, model_config: dict | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{directory}: no tokenizer.json (the store was converted from a "
                                 f"checkpoint without one)")
        self.tok = HFTokenizer.from_file(str(path))
        tc = _read_json(directory / "tokenizer_config.json")
        gen = _read_json(directory / "generation_config.json")
        template = tc.get("chat_template")
        if not template and (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        self.chat_template = template
        self.bos_token = _token_text(tc.get("bos_token"))
        self.eos_token = _token_text(tc.get("eos_token"))
        eos: set[int] = set()
        for source in (gen.get("eos_token_id"), (model_config or {}).get("eos_token_id")):
            if isinstance(source, int):
                eos.add(source)
            elif isinstance(source, list):
                eos.update(int(x) for x in source)
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos.add(self.tok.token_to_id(self.eos_token))
        self.eos_ids = eos

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tok.encode(self.render_chat(text), add_special_tokens=False).ids
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, prompt) -> str:
        """prompt: one user message, or a list of {role, content} messages (the HTTP frontend)."""
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template; run without --chat")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env.from_string(self.chat_template).render(
            messages=[{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
            add_generation_prompt=True,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, holding back split UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
