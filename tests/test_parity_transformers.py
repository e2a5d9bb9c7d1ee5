"""DeepInfer `exact`/float32 against transformers' DeepseekV4ForCausalLM on checkpoints it wrote.

Full-sequence logits within 1e-5 relative error, identical greedy tokens, and token-by-token decode
giving the same logits as transformers' full forward teacher-forced on our tokens.
"""

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import build_hf_model  # noqa: E402

from deepinfer.engine.generate import SamplingParams, generate  # noqa: E402
from deepinfer.engine.loader import load_model  # noqa: E402

CONFIGS = {
    # every attention kind, hash + top-k MoE, hc 4; a 40-token prompt crosses window 8, CSA 4, HCA 8
    "hc4": dict(hc_mult=4, layer_ratios=(0, 4, 8, 4), n_hash=1),
    # another hc_mult, HCA first, two hash layers, a longer HCA ratio
    "hc2": dict(hc_mult=2, layer_ratios=(8, 0, 4, 16, 4), n_hash=2, window=6, index_topk=2, seed=3),
}


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = build_hf_model(str(d), **CONFIGS[request.param])
    lm = load_model(str(d), numerics="exact", dtype="float32", device="cpu", progress=False)
    assert lm.layout == "transformers"
    return hf, lm


def test_full_forward_logits(pair):
    hf, lm = pair
    ids = torch.randint(2, 512, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    lm.model.allocate(2, 64)
    out, _ = lm.model.prefill(ids, all_logits=True)
    err = rel(out, ref)
    print(f"full forward rel err {err:.2e}")
    assert torch.isfinite(out).all()
    assert err < 1e-5
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_decode_matches_teacher_forced_forward(pair):
    hf, lm = pair
    prompt = torch.randint(2, 512, (1, 5), generator=torch.Generator().manual_seed(11)).tolist()[0]
    res = generate(lm.model, [prompt], SamplingParams(max_new_tokens=30, ignore_eos=True), eos_id=1)
    toks = res.completions[0].token_ids
    seq = torch.tensor([prompt + toks])
    with torch.no_grad():
        ref = hf(seq).logits.float()[0, len(prompt) - 1:-1]
    assert toks == ref.argmax(-1).tolist(), "greedy tokens differ from transformers' argmax"
    # our decode-path logits, step by step, against the full forward
    lm.model.allocate(1, 64)
    steps = [lm.model.prefill(seq[:, :len(prompt)])[0][0, -1]]
    for t in range(len(prompt), seq.size(1) - 1):
        steps.append(lm.model.decode(seq[:, t:t + 1], torch.tensor([t]))[0, -1])
    dec = torch.stack(steps)
    err = rel(dec, ref)
    print(f"token-by-token decode rel err {err:.2e}")
    assert err < 1e-5
    lp = torch.log_softmax(ref, -1).gather(1, torch.tensor(toks).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(res.completions[0].logprobs), lp, atol=1e-4)
