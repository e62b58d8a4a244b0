"""Tokenizer from the store's tokenizer/ files: `tokenizers` for BPE, jinja2 for chat templates.

The supervisor's request manager uses it (workers/requests.py, runtime/textside.py); compute
reads only the EOS ids (`eos_ids`), which need no tokenizer library, so the MLX process never
loads one, and the HTTP frontend sends text and leaves tokenizing to the runtime."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from deltafin.protocol import messages as M
from deltafin.runtime.markers import KEPT


class TokenizerError(RuntimeError):
    pass


def _byte_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte spelt as one printable character. The printable
    Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7f-0xa0, 0xad) take
    the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + n): b for n, b in enumerate(others)}}


BYTE_OF_CHAR = _byte_chars()


def _byte_spelling(decoder: dict | None) -> str:
    """How a tokenizer.json's vocabulary spells bytes, from its decoder: "byte_level",
    "byte_fallback" or "" (neither)."""
    kinds, todo = set(), [decoder]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            kinds.add(d.get("type"))
            todo += d.get("decoders") or []
    return "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else ""


TOO_LONG = "prompt of "  # how every refusal of a prompt over the context begins


# Texts longer than this many characters are counted piece by piece before they are tokenized
# whole: tokens are counted in pieces of about this size (cut before whitespace where there is
# any), and counting stops once the pieces hold more than max_context tokens, so a text with far
# too many tokens never builds more than one piece's encoding.
PIECE_CHARS = 1 << 16
# A cut can split one token into a few (a word cut in two, a piece's own leading space marker):
# each piece's count is reduced by this much, so the sum never overstates the whole text's.
CUT_SLACK = 4


def pieces(text: str, size: int = PIECE_CHARS):
    """text in consecutive pieces of at most `size` characters, each cut just before the last
    whitespace of its window where there is one (cuts where pre-tokenizers cut anyway)."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            end = cut if cut > start else end
        yield text[start:end]
        start = end


class PromptTooLong(ValueError):
    """A prompt that cannot fit max_context tokens (answered with `bad_request`). Its message
    starts with TOO_LONG, as protocol/messages.py's `prompt_too_long` does: the HTTP frontend
    answers such an error with `context_length_exceeded`."""

    code = M.ErrorCode.BAD_REQUEST


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: {e}") from None


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _configured_eos_ids(directory: Path, model_config: dict | None) -> set[int]:
    """The end-of-sequence ids the generation config and the model config name."""
    eos: set[int] = set()
    gen = _read_json(directory / "generation_config.json")
    for source in (gen.get("eos_token_id"), (model_config or {}).get("eos_token_id")):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list):
            eos.update(int(x) for x in source)
    return eos


def eos_ids(directory, model_config: dict | None = None) -> set[int]:
    """The ids that end a generation, read from the store's tokenizer files as plain JSON (the
    same set as `Tokenizer.eos_ids`), so compute stops at EOS without loading the tokenizer:
    the configured ids plus the id of tokenizer_config's eos_token, looked up among
    tokenizer.json's added tokens, then in its vocabulary."""
    directory = Path(directory)
    eos = _configured_eos_ids(directory, model_config)
    name = _token_text(_read_json(directory / "tokenizer_config.json").get("eos_token"))
    if name:
        tj = _read_json(directory / "tokenizer.json")
        found = next((t.get("id") for t in tj.get("added_tokens") or [] if t.get("content") == name), None)
        vocab = (tj.get("model") or {}).get("vocab")
        if found is None and isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
            found = vocab.get(name)
        elif found is None and isinstance(vocab, list):  # Unigram: [piece, score] in id order
            found = next((i for i, entry in enumerate(vocab) if entry and entry[0] == name), None)
        if found is not None:
            eos.add(int(found))
    return eos


class Tokenizer:
    def __init__(self, directory, model_config: dict | None = None):
        from tokenizers import Tokenizer as HFTokenizer
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{directory}: no tokenizer.json (the store was converted from a "
                                 f"checkpoint without one)")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exception for a bad file
            raise TokenizerError(f"{path}: unreadable tokenizer ({e})") from None
        tc = _read_json(directory / "tokenizer_config.json")
        template = tc.get("chat_template")
        if not template and (directory / "chat_template.jinja").exists():
            template = (directory / "chat_template.jinja").read_text()
        self.chat_template = template
        self.bos_token = _token_text(tc.get("bos_token"))
        self.eos_token = _token_text(tc.get("eos_token"))
        eos = _configured_eos_ids(directory, model_config)
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos.add(self.tok.token_to_id(self.eos_token))
        self.eos_ids = eos
        # special tokens that structure a chat answer (runtime/markers.py), kept by decode(markers=True)
        added = self.tok.get_added_tokens_decoder()
        self.markers = {i: t.content for i, t in added.items() if t.special and t.content in KEPT}
        # every added token, by its text: llguidance matches these by id only (workers/toolcalls/grammar.py)
        self.added = {t.content: i for i, t in added.items()}
        self.added_ids = frozenset(added)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of text one token can stand for: the longest vocabulary entry as
        stored (byte-level entries spell each byte as one 1-2 byte character, sentencepiece's
        "<0x0A>" stands for one byte, so the stored spelling is never shorter than the text).
        A prompt of more than max_context x this many bytes cannot fit max_context tokens."""
        if not hasattr(self, "_max_token_bytes"):
            vocab = self.tok.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
        return self._max_token_bytes

    def prompt_bytes_bound(self, max_tokens: int) -> int:
        return max_tokens * max(1, self.max_token_bytes)

    def encode(self, text, chat: bool = False, max_tokens: int | None = None,
               tools: list | None = None) -> list[int]:
        """text: a string, or (chat) a list of {role, content} messages. max_tokens: refuse
        (PromptTooLong) a text longer in bytes than that many tokens can hold before tokenizing
        anything; then a long text's tokens are counted in pieces (`pieces`), refusing as soon
        as they are surely more than max_tokens; only a text that may fit is tokenized whole
        (the ids always come from the whole text, exactly as without a bound), and refused when
        it has more than max_tokens tokens. Messages are bounded by their contents together."""
        if max_tokens is not None:
            from deltafin.protocol.messages import prompt_too_long
            bounded = text if isinstance(text, str) else "".join(m["content"] for m in text)
            why = prompt_too_long(bounded, self.prompt_bytes_bound(max_tokens))
            if why:
                raise PromptTooLong(why)
            if len(bounded) > PIECE_CHARS:
                counted, at = 0, 0
                for piece in pieces(bounded):
                    counted += max(0, len(self.tok.encode(piece, add_special_tokens=False).ids) - CUT_SLACK)
                    at += len(piece)
                    if counted > max_tokens:
                        raise PromptTooLong(f"{TOO_LONG}more than {max_tokens} tokens: its first {at} "
                                            f"characters hold more than max_context={max_tokens} "
                                            f"(counted in pieces)")
        if chat:
            ids = self.tok.encode(self.render_chat(text, tools), add_special_tokens=False).ids
        else:
            ids = self.tok.encode(text).ids
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(f"{TOO_LONG}{len(ids)} tokens exceeds max_context={max_tokens}")
        return ids

    def decode(self, ids, markers: bool = False) -> str:
        """The text of ids, special tokens skipped; markers: but for the ones that structure a
        chat answer (self.markers), each written where it stands."""
        if not (markers and self.markers):
            return self.tok.decode(list(ids), skip_special_tokens=True)
        parts, run = [], []
        for i in ids:
            if i in self.markers:
                parts += [self.tok.decode(run, skip_special_tokens=True), self.markers[i]]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self.tok.decode(run, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (what a log-probability entry names)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, where its text alone cannot say them: a token holding part
        of a character decodes to U+FFFD, but its vocabulary entry spells its bytes (byte-level
        BPE: one character per byte; sentencepiece's byte fallback: "<0xNN>"). An added token,
        or a vocabulary of neither kind: its text's UTF-8."""
        if not hasattr(self, "_spelling"):
            self._spelling = _byte_spelling(json.loads(self.tok.to_str()).get("decoder"))
        entry = self.tok.id_to_token(token_id)
        if entry is not None and token_id not in self.added_ids:
            if self._spelling == "byte_level" and all(c in BYTE_OF_CHAR for c in entry):
                return bytes(BYTE_OF_CHAR[c] for c in entry)
            if self._spelling == "byte_fallback":
                if len(entry) == 6 and entry.startswith("<0x") and entry.endswith(">"):
                    try:
                        return bytes([int(entry[3:5], 16)])
                    except ValueError:
                        pass
                return entry.replace("\u2581", " ").encode("utf-8")
        return self.token_text(token_id).encode("utf-8")

    def render_chat(self, prompt, tools: list | None = None) -> str:
        """prompt: one user message, or a list of {role, content} messages (the HTTP frontend).
        tools: function tools, passed to the template as `tools` (as transformers does)."""
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
            add_generation_prompt=True, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class StreamDecoder:
    """Turns token ids into text pieces as they arrive, holding back split UTF-8 characters;
    markers: a chat answer's markers kept (Tokenizer.decode)."""

    def __init__(self, tokenizer: Tokenizer, markers: bool = False):
        self.tokenizer = tokenizer
        self.markers = markers
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, self.markers)
        if text.endswith("\ufffd"):
            return ""
        piece = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
