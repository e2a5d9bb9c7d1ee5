"""CUDA graphs for the decode step (GPU), and `deepinfer generate --input-file` (CPU, and GPU with graphs).

Graph mode needs a decode step without host syncs: the Triton backend with its grouped MoE kernel
(`--backend triton --strict`); the torch reference MoE synchronises, so it is never captured.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from deepinfer.engine.generate import SamplingParams, generate
from deepinfer.engine.loader import load_model
from deepinfer.engine.runner import DecodeRunner
from deepinfer.ops import ops
from deepinfer_cli.app import app

PROMPTS = [
    [0, 6127, 389],
    [0, 17607, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
    [0, 5],
    [0, 99, 4321, 777, 5, 6, 7, 8, 9],
    [0, 1234, 31, 32, 33, 34],
    [0, 42, 43],
    [0, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    [0, 300, 301, 302, 303, 304, 305],
]
LENS = [9, 3, 6, 12, 5, 8, 2, 10]  # sequences finish at different steps: the batch walks through the buckets


def _triton_model(numerics="exact", dtype="float32"):
    ops.configure("triton", strict=True)
    return load_model(None, numerics=numerics, dtype=dtype, device="cuda", progress=False)


def _state(model):
    return model.cache_tensors()


@pytest.mark.gpu
def test_capture_buckets_1_to_8():
    lm = _triton_model("official", "bfloat16")
    lm.model.allocate(9, 64)
    r = DecodeRunner(lm.model, 8, graphs=True)
    assert r.mode == "graphs" and list(r.buckets) == [1, 2, 4, 8] and r.spare_row == 8
    r.capture()
    assert r.captured and all(b.graph is not None and b.out.shape == (b.size, lm.cfg.vocab_size)
                              for b in r.buckets.values())
    # a replay of a padded bucket (3 live rows in bucket 4) equals the same padded step run eagerly, and
    # leaves the live rows' caches as the eager step does
    dev = "cuda"
    for row in range(3):
        lm.model.prefill(torch.tensor([PROMPTS[row]], device=dev), rows=torch.tensor([row], device=dev))
    snap = [t.clone() for t in _state(lm.model)]
    args = (torch.tensor([[77], [78], [79]], device=dev), torch.tensor([len(p) for p in PROMPTS[:3]], device=dev),
            torch.arange(3, device=dev))
    g = r.decode(*args)
    after_graph = [t[:3].clone() for t in _state(lm.model)]
    for t, s in zip(_state(lm.model), snap):
        t.copy_(s)
    e = DecodeRunner(lm.model, 8, pad_to_buckets=True).decode(*args)
    assert g.shape == (3, lm.cfg.vocab_size)
    torch.testing.assert_close(g, e, rtol=0, atol=0)
    for t, s in zip(_state(lm.model), after_graph):
        torch.testing.assert_close(t[:3], s, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.gpu_smoke
@pytest.mark.parametrize("numerics,dtype", [("exact", "float32"), ("official", "bfloat16")])
def test_greedy_with_graphs_equals_eager(numerics, dtype):
    lm = _triton_model(numerics, dtype)
    plist = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in LENS]
    graphs = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=8, graphs=True).completions
    padded = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=8, pad_to_buckets=True).completions
    for a, b in zip(graphs, padded):  # same shapes, same kernels: replay == eager
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    if dtype == "float32":  # unpadded eager (other GEMM shapes): the same tokens
        eager = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=8).completions
        for a, b in zip(graphs, eager):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    # fewer slots than prompts: admission while graphs replay equals the same schedule run eagerly in the
    # same padded buckets (both dtypes: same shapes, same kernels), and in float32 the 8-slot run's tokens
    few = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=3, graphs=True).completions
    few_eager = generate(lm.model, PROMPTS, plist, eos_id=1, max_batch=3, pad_to_buckets=True).completions
    assert [len(c.token_ids) for c in few] == list(LENS)
    for a, b in zip(few, few_eager):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    if dtype == "float32":
        for a, b in zip(few, graphs):
            assert a.token_ids == b.token_ids


@pytest.mark.gpu
def test_torch_reference_capture_fails_with_one_clear_error():
    from deepinfer.engine.graphs import GraphCaptureError

    lm = load_model(None, numerics="exact", dtype="float32", device="cuda", progress=False)  # torch backend
    lm.model.allocate(3, 32)
    with pytest.raises(GraphCaptureError, match="--eager") as ei:
        DecodeRunner(lm.model, 2, graphs=True).capture()
    assert "backend 'torch'" in str(ei.value) and "\n" not in str(ei.value)
    # eager still works afterwards
    c = generate(lm.model, [PROMPTS[0]], SamplingParams(max_new_tokens=2, ignore_eos=True), eos_id=1).completions[0]
    assert len(c.token_ids) == 2


# ---------------------------------------------------------------------------------------------------
runner = CliRunner()
DEVICES = [pytest.param(["--device", "cpu"], id="cpu"),
           pytest.param(["--device", "cuda", "--backend", "triton", "--strict"], id="cuda-graphs",
                        marks=pytest.mark.gpu)]
NUM = ["--numerics", "exact", "--dtype", "float32"]  # batch vs single: no FP8 rounding flips


def _jsonl(r):
    assert r.exit_code == 0, r.output
    return [json.loads(ln) for ln in r.stdout.strip().splitlines() if ln.startswith("{")]


@pytest.mark.parametrize("dev", DEVICES)
def test_cli_prefill_chunk_same_tokens(tiny_dir, tmp_path, dev):
    """--prefill-chunk 3: the 12-number prompt is prefilled over several steps while the short ones
    decode (with graphs on CUDA); every completion equals the whole-prompt run."""
    f = tmp_path / "prompts.txt"
    f.write_text("北京是\n1 2 3 4 5 6 7 8 9 10 11 12\nThe capital of France is\n", encoding="utf-8")
    args = ["generate", "--input-file", str(f), "-n", "4", "--json", "--max-batch", "2", *NUM, *dev]
    whole = _jsonl(runner.invoke(app, args))
    chunked = _jsonl(runner.invoke(app, args + ["--prefill-chunk", "3"]))
    assert [o["token_ids"] for o in chunked] == [o["token_ids"] for o in whole]
    for a, b in zip(chunked, whole):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < 1e-4


@pytest.mark.parametrize("dev", DEVICES)
def test_cli_input_file_txt(tiny_dir, tmp_path, dev):
    f = tmp_path / "prompts.txt"
    f.write_text("北京是\n\nThe capital of France is\n1 2 3 4 5 6 7 8 9 10 11 12\n", encoding="utf-8")
    out = _jsonl(runner.invoke(app, ["generate", "--input-file", str(f), "-n", "3", "--json", "--max-batch", "2",
                                     *NUM, *dev]))
    assert [o["index"] for o in out] == [0, 1, 2]
    assert [o["prompt"] for o in out] == ["北京是", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12"]
    assert out[0]["input_ids"] == [0, 6127, 389]
    for o in out:
        assert len(o["token_ids"]) == 3 and len(o["logprobs"]) == 3 and o["finish_reason"] == "length"
        single = _jsonl(runner.invoke(app, ["generate", o["prompt"], "-n", "3", "--json", *NUM, *dev]))[0]
        assert single["token_ids"] == o["token_ids"]
        assert max(abs(a - b) for a, b in zip(single["logprobs"], o["logprobs"])) < 1e-3
    # text output: every completion and one summary line
    r = runner.invoke(app, ["generate", "--input-file", str(f), "-n", "2", *NUM, *dev])
    assert r.exit_code == 0, r.output
    assert "北京是" in r.stdout and "3 prompts, 6 tokens" in r.stdout and "tokens/s" in r.stdout


@pytest.mark.parametrize("dev", DEVICES)
def test_cli_input_file_jsonl_overrides(tiny_dir, tmp_path, dev):
    f = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "北京是", "max_new_tokens": 2},
        {"prompt": "你好", "chat": True, "max_new_tokens": 1},
        {"prompt": "北京是", "temperature": 1.0, "top_k": 5, "top_p": 0.9, "seed": 3},
        {"prompt": "北京是", "think": True, "stop": "\n"},
    ]
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    out = _jsonl(runner.invoke(app, ["generate", "--input-file", str(f), "-n", "4", "--json", "--logprobs", "2",
                                     *NUM, *dev]))
    assert len(out) == 4
    assert len(out[0]["token_ids"]) == 2 and len(out[1]["token_ids"]) == 1
    assert len(out[2]["token_ids"]) == 4 and len(out[0]["top_logprobs"]) == 2
    assert out[1]["input_ids"][:2] == [0, 128803] and out[1]["input_ids"][-2:] == [128804, 128822]
    assert out[3]["input_ids"][:2] == [0, 128803] and out[3]["input_ids"][-1] != 128822  # <think> opened
    greedy = _jsonl(runner.invoke(app, ["generate", "北京是", "-n", "4", "--json", *NUM, *dev]))[0]
    assert out[0]["token_ids"] == greedy["token_ids"][:2]
    # same seed and index -> same tokens (the sampled row at index 2 of a 3-line file)
    f2 = tmp_path / "again.jsonl"
    f2.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:3]), encoding="utf-8")
    again = _jsonl(runner.invoke(app, ["generate", "--input-file", str(f2), "-n", "4", "--json", "--max-batch", "1",
                                       *NUM, *dev]))
    assert again[2]["token_ids"] == out[2]["token_ids"]


def test_cli_input_file_errors(tiny_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    cases = {
        '{"prompt": "x", "tempreature": 1}\n': "unknown key(s) tempreature",
        '{"prompt": "x"}\n{"text": "y"}\n': "line 2",
        '{"prompt": "x", "top_p": 0}\n': "--top-p 0",
        '{"prompt": "x", "chat": true, "think": true}\n': "exclusive",
    }
    for text, want in cases.items():
        bad.write_text(text, encoding="utf-8")
        r = runner.invoke(app, ["generate", "--input-file", str(bad), "--device", "cpu"])
        assert r.exit_code == 2, (text, r.output)
        assert r.output.strip().startswith("error:") and want in r.output and "Traceback" not in r.output
    for args in (["generate", "x", "--input-file", str(bad)], ["generate", "--input-file", str(tmp_path / "none")],
                 ["generate", "x", "--max-batch", "0"]):
        r = runner.invoke(app, [*args, "--device", "cpu"])
        assert r.exit_code == 2 and r.output.strip().startswith("error:"), (args, r.output)
