"""Guided decoding: JSON schemas, regular expressions, EBNF grammars and choices through a token bitmask.

xgrammar (the `guided` extra, imported only when a constraint is used) compiles each constraint against the
V4 tokenizer's vocabulary (`GuideCompiler`); a `GrammarMatcher` per constrained request advances on every
accepted token. At each sampling point the matchers fill one packed int32 bitmask row per sequence
(`MaskBuffer`: bit v % 32 of word v // 32 set = token v allowed; rows without a constraint are all ones) in
a host buffer (pinned on CUDA), which is copied without blocking into a fixed device buffer and applied to
the logits by the registry op `apply_token_bitmask` (masked logits = -inf) before `sample` / `logprobs`:
a masked token can never be drawn, and the reported logprobs are those of the masked distribution.

Vocabulary: the encoded vocabulary is the tokenizer's byte-level BPE table; added tokens marked special in
tokenizer.json (BOS, pad, placeholders, ...) are never allowed, EOS (the stop token) only where the grammar
may end, non-special added tokens (`<think>`, role markers) count as their text. Ids past the tokenizer's
vocabulary up to the model's (padding rows of the embedding) are never allowed.

Constraints are checked (parsed by xgrammar, without the tokenizer) before any model load: a bad schema,
regex or grammar is a `ConstraintError` (a ValueError: one line, exit 2 in the CLI) naming the option or
file and what xgrammar said.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import torch

KINDS = ("json_schema", "regex", "grammar", "choice")
OPTION = {"json_schema": "--json-schema", "regex": "--regex", "grammar": "--grammar", "choice": "--choice"}


class ConstraintError(ValueError):
    """A constraint that cannot be used (bad schema / regex / grammar, or xgrammar missing): one line."""


def _xgr():
    try:
        import xgrammar
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "xgrammar":
            raise
        raise ConstraintError("guided decoding (--json-schema, --regex, --grammar, --choice) needs the xgrammar "
                              "package, which is not installed: pip install -e '.[guided]'") from None
    return xgrammar


_CPP_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?\S+\.(cc|h|cpp):\d+:\s*")


def _xgr_message(e: BaseException) -> str:
    """xgrammar's error as one line, without its C++ source location."""
    msg = " ".join(_CPP_PREFIX.sub("", str(e)).split()) or type(e).__name__
    return msg.replace("Check failed: (error.empty()) is false: ", "")


@dataclass(frozen=True)
class Constraint:
    """One constraint as given: kind (json_schema | regex | grammar | choice), its text (the schema's JSON,
    the pattern, the EBNF, or for a choice the EBNF made from the choices) and where it came from."""

    kind: str
    text: str
    where: str = field(default="", compare=False)
    choices: tuple = field(default=(), compare=False)

    def describe(self) -> dict:
        return {"kind": self.kind, **({"choices": list(self.choices)} if self.kind == "choice" else {})}


def _check(c: Constraint) -> Constraint:
    """Parse the constraint with xgrammar (no tokenizer needed) -> c, or a ConstraintError."""
    xgr = _xgr()
    what = {"json_schema": "invalid JSON schema", "regex": "invalid regex", "grammar": "invalid grammar",
            "choice": "invalid choices"}[c.kind]
    try:
        _grammar(xgr, c)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError from its C++ core
        raise ConstraintError(f"{c.where}: {what}: {_xgr_message(e)}") from None
    return c


def _grammar(xgr, c: Constraint):
    if c.kind == "json_schema":
        return xgr.Grammar.from_json_schema(c.text, any_whitespace=False)
    if c.kind == "regex":
        return xgr.Grammar.from_regex(c.text)
    return xgr.Grammar.from_ebnf(c.text)  # grammar, choice


def json_schema(text: str, where: str = "--json-schema") -> Constraint:
    """A JSON schema given as JSON text (compact output: no free whitespace between tokens)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{where}: not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(obj, (dict, bool)):
        raise ConstraintError(f"{where}: a JSON schema is an object (or true / false), got {type(obj).__name__}")
    return _check(Constraint("json_schema", json.dumps(obj), where))


def regex(pattern: str, where: str = "--regex") -> Constraint:
    if pattern == "":
        raise ConstraintError(f"{where}: the regex is empty")
    return _check(Constraint("regex", pattern, where))


def grammar(text: str, where: str = "--grammar") -> Constraint:
    """An EBNF grammar in xgrammar's dialect (GBNF-like; the start rule is `root`)."""
    if not text.strip():
        raise ConstraintError(f"{where}: the grammar is empty")
    return _check(Constraint("grammar", text, where))


def _ebnf_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice(items, where: str = "--choice") -> Constraint:
    """Exactly one of the strings `items` (a list, or "a,b,c")."""
    if isinstance(items, str):
        items = items.split(",")
    items = list(items)
    if not items or any(not isinstance(s, str) for s in items):
        raise ConstraintError(f"{where}: expected a list of strings (or a,b,c)")
    if any(s == "" for s in items):
        raise ConstraintError(f"{where}: an empty choice (\"\") would allow no text at all; remove it")
    text = "root ::= " + " | ".join(_ebnf_string(s) for s in items)
    return _check(Constraint("choice", text, where, tuple(items)))


def read_file(path: str, where: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConstraintError(f"{where} {path}: {getattr(e, 'strerror', None) or e}") from None


def from_options(json_schema_file: str | None = None, regex_pattern: str | None = None,
                 grammar_file: str | None = None, choices: str | None = None) -> Constraint | None:
    """The CLI's constraint options (at most one) -> a checked Constraint, or None."""
    given = [(k, v) for k, v in (("json_schema", json_schema_file), ("regex", regex_pattern),
                                 ("grammar", grammar_file), ("choice", choices)) if v is not None]
    if len(given) > 1:
        raise ConstraintError(f"{' and '.join(OPTION[k] for k, _ in given)}: give at most one constraint")
    if not given:
        return None
    kind, v = given[0]
    if kind == "json_schema":
        return json_schema(read_file(v, "--json-schema"), f"--json-schema {v}")
    if kind == "grammar":
        return grammar(read_file(v, "--grammar"), f"--grammar {v}")
    if kind == "regex":
        return regex(v)
    return choice(v)


def from_jsonl(obj: dict, where: str) -> Constraint | None:
    """The constraint keys of one --input-file JSONL row (at most one): json_schema (an inline schema, or a
    file name), regex (a pattern), grammar (an .ebnf file name), choice (a list of strings, or "a,b,c")."""
    given = [k for k in KINDS if k in obj]
    if len(given) > 1:
        raise ConstraintError(f"{where}: {' and '.join(given)}: give at most one constraint")
    if not given:
        return None
    k = given[0]
    v = obj[k]
    w = f"{where}: {k}"
    if k == "json_schema":
        if isinstance(v, str):
            return json_schema(read_file(v, w), f"{w} {v}")
        if not isinstance(v, (dict, bool)):
            raise ConstraintError(f"{w}: expected a schema object or a file name")
        return json_schema(json.dumps(v), w)
    if k == "regex":
        if not isinstance(v, str):
            raise ConstraintError(f"{w}: expected a string")
        return regex(v, w)
    if k == "grammar":
        if not isinstance(v, str):
            raise ConstraintError(f"{w}: expected an .ebnf file name")
        return grammar(read_file(v, w), f"{w} {v}")
    return choice(v, w)


# ------------------------------------------------------------------------------------ compiled
def encoded_vocab(tokenizer, vocab_size: int) -> list[str]:
    """The tokenizer's vocabulary in byte-level form for xgrammar, ids 0 .. min(tokenizer, model) - 1:
    special added tokens as "" (xgrammar never allows them, the stop token aside), non-special added
    tokens as their text's bytes."""
    from deepinfer.tokenizer import _gpt2_bytes_to_unicode

    b2u = _gpt2_bytes_to_unicode()
    raw = tokenizer._tok
    n = min(tokenizer.vocab_size, vocab_size)
    enc = [""] * n
    for s, i in raw.get_vocab(with_added_tokens=True).items():
        if i >= n:
            continue
        if i in tokenizer._added_text:
            enc[i] = "" if i in tokenizer._special_ids else "".join(b2u[b] for b in s.encode("utf-8"))
        else:
            enc[i] = s
    return enc


@dataclass
class Guide:
    """A constraint compiled for one vocabulary: `matcher()` makes the per-request state."""

    constraint: Constraint
    compiled: object  # xgrammar.CompiledGrammar

    def matcher(self):
        return _xgr().GrammarMatcher(self.compiled)

    @property
    def kind(self) -> str:
        return self.constraint.kind


class GuideCompiler:
    """Compiles constraints against the V4 tokenizer for a model vocabulary of `vocab_size` ids (the
    bitmask's width is ceil(vocab_size / 32) words); compiled grammars are cached per constraint."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 2):
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo(encoded_vocab(tokenizer, vocab_size), xgr.VocabType.BYTE_LEVEL,
                                      vocab_size=vocab_size, stop_token_ids=list(tokenizer.stop_ids))
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._cache: dict[Constraint, Guide] = {}

    def compile(self, c: Constraint) -> Guide:
        g = self._cache.get(c)
        if g is None:
            try:
                compiled = self._compiler.compile_grammar(_grammar(_xgr(), c))
            except Exception as e:  # checked before: only a vocabulary-specific failure lands here
                raise ConstraintError(f"{c.where}: cannot compile against the vocabulary: {_xgr_message(e)}") from None
            g = self._cache[c] = Guide(c, compiled)
        return g

    def compile_builtin_json(self) -> Guide:
        """xgrammar's grammar of any JSON value (for `bench --guided`)."""
        return Guide(Constraint("grammar", "<builtin json>", "bench"), self._compiler.compile_builtin_json_grammar())


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class MaskBuffer:
    """The bitmask of one batch: a host buffer [rows, ceil(V / 32)] int32 (pinned on CUDA) filled by the
    matchers, and a fixed device buffer it is copied into without blocking.

    Reuse: `fill` writes the host buffer only after the previous `to_device` copy has completed. The
    scheduler guarantees it: each copy is followed by the sample, whose tokens are read back to the
    host (a sync) before the matchers fill the next mask.
    """

    def __init__(self, rows: int, vocab_size: int, device):
        device = torch.device(device)
        W = words(vocab_size)
        pin = device.type == "cuda"
        self.host = torch.empty(rows, W, dtype=torch.int32, pin_memory=pin)
        self.device_buf = self.host if device.type == "cpu" else torch.empty(rows, W, dtype=torch.int32, device=device)
        # xgrammar writes through DLPack and wants a CPU buffer: a numpy view of the host buffer is one whatever
        # torch's DLPack export says about pinned memory (same bytes, no copy)
        self._target = self.host.numpy()
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        self._batch = None  # xgrammar.BatchGrammarMatcher: fills many rows on a thread pool

    def fill(self, matchers: list, start: int = 0) -> None:
        """Rows start, start + 1, ...: the allowed next tokens of matchers[0], matchers[1], ...; all ones for a
        None (an unconstrained row). Two or more matchers fill in parallel (xgrammar's thread pool)."""
        idx, ms = [], []
        for j, m in enumerate(matchers, start):
            if m is None:
                self.host[j].fill_(-1)
            else:
                idx.append(j)
                ms.append(m)
        if len(ms) == 1:
            ms[0].fill_next_token_bitmask(self._target, idx[0])
        elif ms:
            if self._batch is None:
                self._batch = _xgr().BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(ms, self._target, idx)

    def to_device(self, n: int) -> torch.Tensor:
        """Rows 0 .. n - 1 on the device: [n, W] int32 (non-blocking from pinned memory on CUDA)."""
        if self.device_buf is self.host:
            return self.host[:n]
        self.device_buf[:n].copy_(self.host[:n], non_blocking=True)
        return self.device_buf[:n]


def status(matcher, finish_reason: str) -> dict:
    """What `--json` reports about a constrained completion."""
    done = bool(matcher.is_terminated())
    cut = {"length": "cut by max tokens", "stop": "cut by a stop string", "eos": "ended"}.get(finish_reason,
                                                                                            finish_reason)
    return {"satisfied": done, "status": "complete" if done else cut}
