"""Guided decoding (issue 27): xgrammar constraints through a token bitmask applied before sampling.

On the tiny model (random weights: unconstrained, it would pick anything, so every accepted structure comes
from the mask): JSON-schema outputs validate (jsonschema), regex outputs match, choices are one of the
choices, an allow-everything grammar gives the unconstrained tokens, mixed batches keep the unconstrained
rows as they are; the bitmask op's Triton kernel against its reference (interpreter on CPU); bad input is
one line, exit 2, before any model load. GPU tests (graphs, full vocabulary) are marked `gpu`.
"""

import json
import re

import pytest
import torch
from backend_device import device_for
from typer.testing import CliRunner

from deepinfer.engine import guided
from deepinfer.engine.generate import SamplingParams, generate
from deepinfer.engine.loader import load_model
from deepinfer.engine.steps import steps_of
from deepinfer.ops.registry import REGISTRY, load_backend
from deepinfer_cli.app import app

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

runner = CliRunner()
EOS = 1

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "n", "color"],
}


def _bits(mask: torch.Tensor, V: int) -> torch.Tensor:
    """[B, W] int32 -> [B, V] bool, bit by bit (independent of the op's reference)."""
    out = torch.zeros(mask.size(0), V, dtype=torch.bool)
    for b in range(mask.size(0)):
        for v in range(V):
            w = v // 32
            out[b, v] = w < mask.size(1) and (int(mask[b, w]) >> (v % 32)) & 1 == 1
    return out


# ------------------------------------------------------------------------------------ the op
def test_bitmask_reference_bit_order():
    g = torch.Generator().manual_seed(1)
    V = 70
    x = torch.randn(3, V, generator=g)
    m = torch.randint(-2**31, 2**31, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    m[1] = -1  # all ones: the row unchanged
    y = REGISTRY["apply_token_bitmask"].ref(x, m)
    allowed = _bits(m, V)
    assert torch.equal(y[allowed], x[allowed])
    assert bool(torch.isneginf(y[~allowed]).all())
    assert torch.equal(y[1], x[1])
    # a mask narrower than the vocabulary forbids the tokens past it
    y2 = REGISTRY["apply_token_bitmask"].ref(x, torch.full((3, 1), -1, dtype=torch.int32))
    assert torch.equal(y2[:, :32], x[:, :32]) and bool(torch.isneginf(y2[:, 32:]).all())


@pytest.mark.parametrize("V", [1, 31, 33, 1000, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bitmask_triton_matches_reference(V, dtype):
    load_backend("triton")
    g = torch.Generator().manual_seed(V)
    B = 5
    x = (torch.randn(B, V, generator=g) * 4).to(dtype)
    m = torch.randint(-2**31, 2**31, (B, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    m[0] = -1
    m[1] = 0
    m[2] = m[2] & 0x11111111  # sparse
    ref = REGISTRY["apply_token_bitmask"].ref(x, m)
    dev = device_for("triton")  # interpreted on a CPU, compiled on a CUDA host; compared on the CPU
    got = REGISTRY["apply_token_bitmask"].impls["triton"](x.to(dev), m.to(dev)).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    assert not bool(torch.isnan(got).any())
    assert torch.equal(got, ref)
    allowed = _bits(m, V) if V <= 1000 else None
    if allowed is not None:
        assert bool(torch.isneginf(got[~allowed]).all()) and torch.equal(got[allowed], x[allowed])
    assert torch.equal(got[0], x[0]) and bool(torch.isneginf(got[1]).all())


def test_triton_sample_and_logprobs_on_masked_logits():
    """The Triton `sample` and `logprobs` kernels on logits with -inf (masked) entries: the reference's tokens,
    never a masked one, -inf logprobs where masked, no NaN; a row with one allowed token draws it."""
    load_backend("triton")
    g = torch.Generator().manual_seed(7)
    B, V = 6, 777
    x = torch.randn(B, V, generator=g) * 3
    m = torch.randint(-2**31, 2**31, (B, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    m[1] = m[1] & 0x00100001  # few allowed
    m[2] = 0
    m[2, 5] = 1 << 3  # exactly one allowed: token 163
    masked = REGISTRY["apply_token_bitmask"].ref(x, m)
    temp = torch.tensor([0.0, 1.0, 1.0, 0.7, 1.3, 0.0])
    top_k = torch.tensor([0, 0, 0, 20, 0, 0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 1.0, 0.8, 1.0])
    seeds = torch.arange(B) * 11
    pos = torch.arange(B) + 100
    dev = device_for("triton")  # interpreted on a CPU, compiled on a CUDA host (both sides there); compared on the CPU
    md, params = masked.to(dev), [t.to(dev) for t in (temp, top_k, top_p, seeds, pos)]
    ref = REGISTRY["sample"].ref(md, *params).cpu()
    got = REGISTRY["sample"].impls["triton"](md, *params).cpu()
    assert torch.equal(got, ref)
    assert bool(torch.isfinite(masked[torch.arange(B), got]).all()) and int(got[2]) == 163
    lp_ref = REGISTRY["logprobs"].ref(md).cpu()
    lp = REGISTRY["logprobs"].impls["triton"](md).cpu()
    assert not bool(torch.isnan(lp).any())
    assert torch.equal(torch.isneginf(lp), torch.isneginf(masked))
    fin = torch.isfinite(lp_ref)
    assert torch.allclose(lp[fin], lp_ref[fin], atol=1e-5) and float(lp[2, 163]) == 0.0


# ------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def lm(tiny_dir):
    return load_model(None, numerics="official", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def compiler(lm):
    return guided.GuideCompiler(lm.tokenizer, lm.cfg.vocab_size)


PROMPTS = ["hello", "北京是", "The answer is", "x"]


def _ids(lm, texts):
    return [lm.tokenizer.encode_prompt(t, "raw") for t in texts]


def _text(lm, c) -> str:
    return lm.tokenizer.decode([t for t in c.token_ids if t != EOS])


def _params(guide, n, seeds=(0, 1, 2), temps=(0.0, 1.0)):
    return [SamplingParams(max_new_tokens=n, temperature=t, seed=s, guide=guide) for s in seeds for t in temps]


def test_mask_buffer_fill(lm, compiler):
    """Rows filled together (xgrammar's batch fill) equal each matcher's own fill; None rows are all ones;
    the rows before `start` are left alone."""
    gs = [compiler.compile(guided.regex("[a-c]+x")), None, compiler.compile(guided.choice("yes,no")),
          compiler.compile(guided.json_schema(json.dumps(SCHEMA)))]
    ms = [g.matcher() if g is not None else None for g in gs]
    assert ms[0].accept_token(lm.tokenizer.encode("ab", add_bos=False)[0])
    V = lm.cfg.vocab_size
    buf = guided.MaskBuffer(6, V, "cpu")
    buf.host.fill_(7)
    buf.fill(ms, 1)
    assert bool((buf.host[0] == 7).all()) and bool((buf.host[5] == 7).all())
    for j, m in enumerate(ms, 1):
        one = torch.zeros(1, buf.host.size(1), dtype=torch.int32)
        if m is None:
            one.fill_(-1)
        else:
            m.fill_next_token_bitmask(one, 0)
        assert torch.equal(buf.host[j], one[0]), j
    assert buf.host.size(1) == (V + 31) // 32 and torch.equal(buf.to_device(3), buf.host[:3])


def _allowed(matcher, V):
    buf = guided.MaskBuffer(1, V, "cpu")
    buf.fill([matcher])
    return REGISTRY["apply_token_bitmask"].ref(torch.zeros(1, V), buf.host)[0].isfinite()


def test_vocabulary_special_tokens_eos_and_padding(lm):
    """EOS only where the grammar may end; BOS, pad and the other special tokens never; ids past the
    tokenizer's vocabulary (a model vocabulary padded beyond it) never; a model vocabulary smaller than the
    tokenizer's is cut to it."""
    tok = lm.tokenizer
    V = tok.vocab_size + 40  # a padded embedding
    comp = guided.GuideCompiler(tok, V)
    m = comp.compile(guided.regex("[a-c]{2}")).matcher()
    a = _allowed(m, V)
    assert not bool(a[tok.eos_id]) and bool(a[tok.encode("a", add_bos=False)[0]])
    assert m.accept_token(tok.encode("a", add_bos=False)[0]) and m.accept_token(tok.encode("b", add_bos=False)[0])
    a = _allowed(m, V)
    assert bool(a[tok.eos_id]) and int(a.sum()) == 1  # complete: only EOS
    anything = _allowed(comp.compile(guided.grammar(ANY)).matcher(), V)
    assert bool(anything[tok.eos_id])
    special = sorted(tok._special_ids - {tok.eos_id})
    assert tok.bos_id in special and not bool(anything[special].any())
    assert not bool(anything[tok.vocab_size:].any())
    assert int(anything.sum()) > 0.9 * tok.vocab_size
    assert bool(anything[tok.think_start_id])  # a non-special added token is its text
    small = guided.GuideCompiler(tok, 1000)
    a = _allowed(small.compile(guided.regex("[a-z]+")).matcher(), 1000)
    assert a.shape == (1000,) and bool(a[tok.encode("a", add_bos=False)[0]])


@pytest.mark.slow
def test_json_schema_outputs_validate(lm, compiler):
    g = compiler.compile(guided.json_schema(json.dumps(SCHEMA)))
    ps = _params(g, 64)
    prompts = (_ids(lm, PROMPTS) * 2)[:len(ps)]
    res = generate(lm.model, prompts, ps, EOS, lm.tokenizer.decode, max_batch=4)
    for c in res.completions:
        assert c.finish_reason == "eos" and c.constraint["status"] == "complete", (c.finish_reason, _text(lm, c))
        assert c.constraint["satisfied"] is True and c.constraint["kind"] == "json_schema"
        jsonschema.validate(json.loads(_text(lm, c)), SCHEMA)
    assert len({_text(lm, c) for c in res.completions}) > 1  # the seeds / temperatures differ


def test_json_schema_cut_by_max_tokens(lm, compiler):
    g = compiler.compile(guided.json_schema(json.dumps(SCHEMA)))
    res = generate(lm.model, _ids(lm, PROMPTS[:2]), SamplingParams(max_new_tokens=3, guide=g), EOS)
    for c in res.completions:
        assert c.finish_reason == "length" and len(c.token_ids) == 3
        assert c.constraint == {"kind": "json_schema", "satisfied": False, "status": "cut by max tokens"}


def test_regex_outputs_match(lm, compiler):
    pat = r"[a-c]{2,5}-[0-9]{1,2}( ok)?"
    g = compiler.compile(guided.regex(pat))
    ps = _params(g, 16)
    res = generate(lm.model, (_ids(lm, PROMPTS) * 2)[:len(ps)], ps, EOS, max_batch=6)
    for c in res.completions:
        assert c.constraint["satisfied"], _text(lm, c)
        assert re.fullmatch(pat, _text(lm, c)), _text(lm, c)


def test_choice_is_one_of_the_choices(lm, compiler):
    choices = ["yes", "no", "maybe not", "北京"]
    g = compiler.compile(guided.choice(",".join(choices)))
    ps = _params(g, 8, seeds=(0, 1, 2, 3))
    res = generate(lm.model, (_ids(lm, PROMPTS) * 2)[:len(ps)], ps, EOS)
    for c in res.completions:
        assert _text(lm, c) in choices and c.constraint["satisfied"]
    assert len({_text(lm, c) for c in res.completions}) > 1


def test_logprobs_are_after_the_mask(lm, compiler):
    """One allowed token per step: the masked distribution gives it probability 1 (logprob 0); unmasked,
    the random model gives it ~1/V."""
    g = compiler.compile(guided.regex("a"))
    c = generate(lm.model, _ids(lm, ["x"]), SamplingParams(max_new_tokens=4, logprobs=3, guide=g), EOS).completions[0]
    assert lm.tokenizer.decode(c.token_ids) == "a" + lm.tokenizer.decode([EOS])
    assert c.logprobs == [0.0, 0.0]
    assert all(len(t) == 1 for t in c.top_logprobs)  # the -inf alternatives are not listed
    free = generate(lm.model, _ids(lm, ["x"]), SamplingParams(max_new_tokens=1), EOS).completions[0]
    assert free.logprobs[0] < -1


ANY = r'root ::= [^\x00]*'  # any text of valid UTF-8 (no NUL), ending anywhere


@pytest.mark.slow
def test_allow_everything_grammar_gives_the_unconstrained_tokens(lm, compiler):
    """The runs compared are those whose unconstrained tokens the grammar accepts: the random model also picks
    special tokens (placeholders), which no grammar allows, and lone UTF-8 continuation bytes."""
    g = compiler.compile(guided.grammar(ANY))
    base = [SamplingParams(max_new_tokens=10, temperature=t, seed=s) for s in range(5) for t in (0.0, 1.0)]
    prompts = (_ids(lm, PROMPTS) * 3)[:len(base)]
    free = generate(lm.model, prompts, base, EOS).completions

    def accepted(c):
        m = g.matcher()
        return all(m.accept_token(t) for t in c.token_ids)

    keep = [i for i, c in enumerate(free) if accepted(c)]
    assert len(keep) >= 4 and {base[i].temperature for i in keep} == {0.0, 1.0}, keep  # the test tests something
    # the same indices (the sampling noise is seeded by the index): the other rows run unconstrained
    ps = [SamplingParams(**{**p.__dict__, "guide": g}) if i in keep else p for i, p in enumerate(base)]
    got = generate(lm.model, prompts, ps, EOS).completions
    for i in keep:
        assert free[i].token_ids == got[i].token_ids, i
        assert got[i].constraint["status"] in ("cut by max tokens", "complete")


def test_mixed_batch_unconstrained_rows_unchanged(lm, compiler):
    """Constrained and unconstrained rows in one batch: the unconstrained ones (all-ones mask) decode as
    they do alone; the constrained ones obey their constraints."""
    gj = compiler.compile(guided.json_schema(json.dumps(SCHEMA)))
    gc = compiler.compile(guided.choice("left,right"))
    prompts = _ids(lm, PROMPTS)
    free_p = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=3), SamplingParams(max_new_tokens=8)]
    alone = generate(lm.model, [prompts[1], prompts[3]], free_p, EOS).completions
    ps = [SamplingParams(max_new_tokens=64, guide=gj), free_p[0], SamplingParams(max_new_tokens=8, guide=gc),
          free_p[1]]
    res = generate(lm.model, prompts, ps, EOS).completions
    # a sampled row's noise is seeded by its index in the submitted list: compare it with a run where it has
    # the same index; the greedy row with its run alone
    assert res[3].token_ids == alone[1].token_ids and res[3].constraint is None
    # 1e-2: a mask clearing 1 token in 32 moves a logprob by ~log(31/32) = -3e-2; batch-composition noise of
    # official numerics is 0 on the CPU hosts tried, 7e-4 on the H200 (test_scheduler.py)
    assert torch.allclose(torch.tensor(res[3].logprobs), torch.tensor(alone[1].logprobs), atol=1e-2)
    same_index = generate(lm.model, [prompts[0], prompts[1]], [SamplingParams(max_new_tokens=8), free_p[0]],
                          EOS).completions[1]
    assert res[1].token_ids == same_index.token_ids and res[1].constraint is None
    assert torch.allclose(torch.tensor(res[1].logprobs), torch.tensor(same_index.logprobs), atol=1e-2)
    jsonschema.validate(json.loads(_text(lm, res[0])), SCHEMA)
    assert _text(lm, res[2]) in ("left", "right")


# ------------------------------------------------------------------------------------ CLI
@pytest.mark.slow
def test_cli_jsonl_mixed_rows(tmp_path, tiny_dir):
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SCHEMA))
    rows = [
        {"prompt": "hello", "json_schema": SCHEMA, "max_new_tokens": 64},
        {"prompt": "北京是", "max_new_tokens": 4},
        {"prompt": "x", "regex": "[0-9]{3}", "temperature": 1.0, "seed": 4},
        {"prompt": "y", "choice": ["cat", "dog"], "temperature": 0.7},
        {"prompt": "z", "json_schema": str(schema_file), "max_new_tokens": 64, "temperature": 1.0},
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    r = runner.invoke(app, ["generate", "--input-file", str(f), "--json", "--max-batch", "3"])
    assert r.exit_code == 0, r.output
    out = [json.loads(ln) for ln in r.stdout.strip().splitlines()]
    assert [o["index"] for o in out] == list(range(5))
    eos = "<｜end▁of▁sentence｜>"
    text = [o["text"] for o in out]
    assert not any(eos in t for t in text)  # special tokens are left out of the text, kept in token_ids
    assert all(out[i]["token_ids"][-1] == 1 for i in (0, 2, 3, 4))
    jsonschema.validate(json.loads(text[0]), SCHEMA)
    jsonschema.validate(json.loads(text[4]), SCHEMA)
    assert re.fullmatch("[0-9]{3}", text[2]) and text[3] in ("cat", "dog")
    assert "constraint" not in out[1] and "logprobs_after_mask" not in out[1]
    for i in (0, 2, 3, 4):
        assert out[i]["constraint"]["status"] == "complete" and out[i]["logprobs_after_mask"] is True
    assert out[3]["constraint"]["choices"] == ["cat", "dog"]


def test_cli_cut_by_max_tokens_reported(tiny_dir):
    r = runner.invoke(app, ["generate", "hi", "--regex", "[a-z]{20}", "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    o = json.loads(r.stdout.strip().splitlines()[-1])
    assert o["constraint"] == {"kind": "regex", "satisfied": False, "status": "cut by max tokens"}
    assert all(m is None or isinstance(m, float) for m in o["margins"])


def test_cli_bad_constraints_exit_2_before_model_load(tmp_path, monkeypatch):
    import deepinfer_cli.common as common

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the constraint was checked")

    monkeypatch.setattr(common, "setup", no_load)
    bad_schema = tmp_path / "bad.json"
    bad_schema.write_text('{"type": "object", "properties": {"a": {"type": "nonesuch"}}}')
    not_json = tmp_path / "nj.json"
    not_json.write_text('{"type": "object",\n "properties": }')
    bad_ebnf = tmp_path / "g.ebnf"
    bad_ebnf.write_text('root ::= "a" | rule_b\n')
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a"}\n{"prompt": "b", "regex": "(unclosed"}\n')
    jl2 = tmp_path / "q.jsonl"
    jl2.write_text('{"prompt": "b", "regex": "a", "choice": ["x"]}\n')
    jl3 = tmp_path / "r.jsonl"
    jl3.write_text('{"prompt": "a"}\n{"prompt": "b", "choice": ["x", "y"]}\n')  # one constrained row is enough
    cases = [
        (["--json-schema", str(bad_schema)], ["--json-schema", "bad.json", "nonesuch"]),
        (["--json-schema", str(not_json)], ["--json-schema", "not JSON", "line 2"]),
        (["--json-schema", str(tmp_path / "missing.json")], ["--json-schema", "missing.json"]),
        (["--regex", "a(b"], ["--regex", "invalid regex", "position"]),
        (["--grammar", str(bad_ebnf)], ["--grammar", "g.ebnf", "rule_b"]),
        (["--choice", "a,,b"], ["--choice", "empty"]),
        (["--regex", "a", "--choice", "b"], ["--regex and --choice"]),
        (["--input-file", str(jl)], ["line 2", "regex", "invalid regex"]),
        (["--input-file", str(jl2)], ["line 1", "at most one"]),
        (["--regex", "a", "--speculate", "2"], ["--speculate 2", "guided constraint"]),
        (["--input-file", str(jl3), "--speculate", "1"], ["--speculate 1", "guided constraint"]),
    ]
    for args, words in cases:
        full = ["generate", *(["x"] if "--input-file" not in args else []), *args]
        r = runner.invoke(app, full)
        assert r.exit_code == 2, (args, r.output)
        assert "Traceback" not in r.output and "AssertionError" not in r.output, r.output
        lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), r.output
        for w in words:
            assert w in lines[0], (w, lines[0])


def test_missing_xgrammar_is_one_line_naming_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ModuleNotFoundError
    r = runner.invoke(app, ["generate", "x", "--regex", "a+"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "xgrammar" in r.output and ".[guided]" in r.output


# ------------------------------------------------------------------------------------ bench
def test_bench_guided_runs(lm, compiler):
    """`bench --guided`'s measurement at tiny shapes (the numbers mean something on the H200 only)."""
    from deepinfer.bench.timing import time_guided

    out = time_guided(lm.model, lm.cfg, 2, 8, 2, lm.model.device, 0, compiler)
    for mode in ("off", "all_ones", "json"):
        assert out[f"{mode}_ms"] > 0
    assert out["json_fill_ms"] > 0 and out["json_accept_ms"] > 0 and "all_ones_overhead_ms" in out and out["batch"] == 2


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_bitmask_kernel_full_vocab_gpu_and_in_a_graph():
    load_backend("triton")
    g = torch.Generator().manual_seed(0)
    for B in (1, 64):
        V = 129280
        x = (torch.randn(B, V, generator=g) * 4).cuda()
        m = torch.randint(-2**31, 2**31, (B, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32).cuda()
        ref = REGISTRY["apply_token_bitmask"].ref(x, m)
        fn = REGISTRY["apply_token_bitmask"].impls["triton"]
        assert torch.equal(fn(x, m), ref)
        graph = torch.cuda.CUDAGraph()
        fn(x, m)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            y = fn(x, m)
        m2 = torch.randint(-2**31, 2**31, m.shape, generator=g, dtype=torch.int64).to(torch.int32).cuda()
        m.copy_(m2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, REGISTRY["apply_token_bitmask"].ref(x, m2))


@pytest.mark.gpu
@pytest.mark.gpu_smoke
def test_guided_with_cuda_graphs_gpu(tiny_dir):
    """The Triton backend (bitmask, sample and logprobs kernels) with captured decode graphs: mixed constrained
    and unconstrained rows, 17 prompts through 8 slots; every constrained row complete and valid."""
    from deepinfer.ops import ops

    ops.configure("triton", strict=False)
    lm = load_model(None, numerics="official", dtype="bfloat16", device="cuda", progress=False)
    comp = guided.GuideCompiler(lm.tokenizer, lm.cfg.vocab_size)
    gj = comp.compile(guided.json_schema(json.dumps(SCHEMA)))
    gr = comp.compile(guided.regex("[a-c]{2,5}-[0-9]"))
    ps = [SamplingParams(max_new_tokens=64, temperature=t, seed=s, guide=g) for s in range(4) for t in (0.0, 1.0)
          for g in (gj, gr)] + [SamplingParams(max_new_tokens=8, temperature=1.0, seed=9)]
    prompts = (_ids(lm, PROMPTS) * 5)[:len(ps)]
    res = generate(lm.model, prompts, ps, EOS, max_batch=8, graphs=True).completions
    assert steps_of(lm.model)["decode"].mode == "graphs" and steps_of(lm.model)["decode"].captured
    for c, p in zip(res, ps):
        if p.guide is gj:
            jsonschema.validate(json.loads(_text(lm, c)), SCHEMA)
        elif p.guide is gr:
            assert re.fullmatch("[a-c]{2,5}-[0-9]", _text(lm, c))
        if p.guide is not None:
            assert c.constraint["status"] == "complete", (_text(lm, c), c.constraint)


def test_cli_text_leaves_special_tokens_out_unless_asked(tiny_dir):
    """`generate "首都" --choice 北京,上海` ends at EOS: the text is the choice alone (as transformers and vLLM
    decode by default), EOS stays in token_ids; --keep-special-tokens puts it back in the text."""
    eos = "<｜end▁of▁sentence｜>"
    r = runner.invoke(app, ["generate", "首都", "--choice", "北京,上海", "--json"])
    assert r.exit_code == 0, r.output
    o = json.loads(r.stdout.strip().splitlines()[-1])
    assert o["text"] in ("北京", "上海") and o["token_ids"][-1] == 1, o
    r = runner.invoke(app, ["generate", "首都", "--choice", "北京,上海"])
    completion = [ln for ln in r.stdout.splitlines() if ln.strip()][0]
    assert r.exit_code == 0 and completion.strip() == "首都" + o["text"], r.stdout  # the table keeps EOS
    r = runner.invoke(app, ["generate", "首都", "--choice", "北京,上海", "--json", "--keep-special-tokens"])
    k = json.loads(r.stdout.strip().splitlines()[-1])
    assert k["text"] == o["text"] + eos and k["token_ids"] == o["token_ids"]
