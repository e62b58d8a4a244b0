"""Structured output: a JSON Schema or a grammar the answer must match, enforced while decoding
(llguidance).

A request's `json_schema` (text; `ANY_OBJECT` for any JSON object) is compiled to an llguidance
grammar (`grammar_of`: the HTTP frontend checks it this way before sending, compute again when
it starts the sequence); a request's `grammar` is Lark text (`lark_grammar`: the supervisor
writes one for tool_choice "required", workers/toolcalls). In compute each constrained sequence holds a `Grammar`: before a token
is sampled, `allowed()` gives the tokens the grammar accepts next (EOS only once the JSON or
the grammar is complete), the sampler sets the others to -inf (workers/scheduler.py), and `advance` moves the
grammar on with the token taken. The JSON is written compactly (", " and ": " between items, no
other whitespace), so a small model cannot loop on blank space.

The token table the masks are computed over (`TokenTable`) is built from the store's
tokenizer.json once per process, on the first constrained request (about 0.35 s on the demo's
49k vocabulary); no tokenizer library is loaded in compute for it (llguidance reads the file
itself). Unconstrained requests never touch this module's state."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import llguidance
import numpy as np

from deltafin.runtime.heap import release_freed

ANY_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The parser's work per token and per grammar (llguidance's defaults, less verbose errors: a
# message never echoes grammar state back to a client).
LIMITS = dict(verbose_errors=False)


class SchemaError(ValueError):
    """A json_schema that is not a JSON Schema llguidance can enforce: the message says why."""


def grammar_of(schema_text: str) -> str:
    """The llguidance grammar (its JSON text) enforcing the JSON Schema `schema_text`;
    SchemaError where the text is not a JSON object or not a schema llguidance supports."""
    try:
        schema = json.loads(schema_text)
    except (TypeError, ValueError) as e:
        raise SchemaError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise SchemaError("the JSON schema must be a JSON object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_STYLE)
    except ValueError as e:
        raise SchemaError(f"invalid JSON schema: {e}") from None
    return _validated(grammar, "JSON schema")


def lark_grammar(text: str) -> str:
    """The llguidance grammar (its JSON text) of a Lark grammar `text` (a request's `grammar`:
    workers/toolcalls writes them for tool_choice "required"); SchemaError where llguidance
    refuses it."""
    return _validated(llguidance.grammar_from("lark", text), "grammar")


def _validated(grammar: str, what: str) -> str:
    """grammar, once llguidance accepts it under the parser's limits; SchemaError naming `what`."""
    failed, why = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, limits=llguidance.LLParserLimits(**LIMITS))
    if failed:
        raise SchemaError(f"invalid {what}: {why[0]}")
    return grammar


class TokenTable:
    """The model's tokens as llguidance sees them (bytes per id, the EOS ids), built on first use
    from the store's tokenizer.json; vocab: the model's logits width (ids past the tokenizer's
    own are never allowed)."""

    def __init__(self, tokenizer_dir: Path, eos: set[int], vocab: int):
        self.path, self.eos, self.vocab = Path(tokenizer_dir) / "tokenizer.json", sorted(eos), vocab
        self._table = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._table is None:
                self._table = llguidance.LLTokenizer(self.path.read_text(), n_vocab=self.vocab,
                                                     eos_token=self.eos)
                # the table's build frees its parse of tokenizer.json (~25 MiB on the demo store),
                # which glibc would keep in the process; runtime/budget.py charges the table without it
                release_freed()
            return self._table

    def grammar(self, schema_text: str | None = None, grammar: str | None = None) -> "Grammar":
        """A sequence's grammar for its request's json_schema or (Lark) grammar; SchemaError
        where it is refused."""
        compiled = grammar_of(schema_text) if schema_text is not None else lark_grammar(grammar)
        matcher = llguidance.LLMatcher(self.get(), compiled, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise SchemaError(f"invalid {'JSON schema' if schema_text is not None else 'grammar'}: "
                              f"{matcher.get_error()}")
        return Grammar(matcher, self.vocab)


class Grammar:
    """One sequence's place in its grammar: which tokens may come next, and the token taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar accepts next, as a bool array [vocab] (EOS only where the JSON
        may end here)."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.vocab].view(np.bool_)

    def advance(self, token: int) -> bool:
        """The token was taken; True when the grammar is complete (nothing but EOS may follow)
        or refused it (a token the mask did not allow: the sequence stops there too)."""
        ok = self.matcher.consume_token(token)
        return not ok or self.matcher.is_stopped()
