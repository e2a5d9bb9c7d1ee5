"""Expert parallelism on CPU (gloo): torchrun with 2 and 4 ranks against the single-process model.

This file is also the worker: `torchrun ... tests/test_distributed.py OUT_DIR` runs `_worker`, which writes
each rank's logits/tokens to OUT_DIR/rank{r}.pt; the tests compare them with single-process runs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.engine import distributed as D

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS_SAME, STEPS_DP = 8, 3
RTOL = 1e-5  # float32 rounding: expert rows are batched differently than in the single-process run


def same_batch() -> torch.Tensor:
    """(a): the batch every rank runs: 2 rows of 4 tokens."""
    return torch.tensor([[0, 33310, 2058, 517], [0, 6127, 17607, 90]])


def dp_batch(rank: int) -> torch.Tensor:
    """(b): rank r's own batch, 1 + r % 2 rows of 2 + r tokens (token counts 2, 6, 4, 10 per rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(2, 120000, (1 + rank % 2, 2 + rank), generator=g)
    ids[:, 0] = 0
    return ids


DP_DECODE_TOKENS = 2  # the agreed decode capacity: the largest per-rank batch above


@contextlib.contextmanager
def no_host_sync():
    """Any tensor -> host value conversion raises inside the block."""
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def boom(self, *a, **k):
        raise RuntimeError("host sync (.item/.tolist/int/bool) inside the EP dispatch")

    for n in names:
        setattr(torch.Tensor, n, boom)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def dense_compute_experts(moe):
    """A sync-free compute_experts (every local expert on every row, masked): stands in for the grouped
    kernel so the trap below sees only the dispatch's own code."""

    def run(x, w, e):
        out = torch.zeros(x.shape, dtype=torch.float32)
        for j in range(len(moe.experts)):
            out += torch.where((e == j)[:, None], moe.experts[j](x, w[:, None]).float(), 0.0)
        return out

    return run


def _worker(out_dir: str) -> None:
    from deepinfer.ops import ops

    ops.configure("torch", strict=False)
    par = D.init_distributed("cpu")
    lm = D.load_model_distributed(None, "exact", "float32", par)
    net = lm.model
    res = {"experts": (lm.model.layers[0].ffn.expert_offset, len(lm.model.layers[0].ffn.experts))}
    # (a) the same batch on every rank
    logits, toks = D.greedy_run(net, same_batch(), STEPS_SAME)
    res["same_logits"], res["same_tokens"] = torch.stack(logits), toks
    res["same_agree"] = D.check_ranks_agree(torch.stack(logits), par)
    # (b) each rank its own batch (different token counts in prefill and decode); prefill exchanges
    # 3 tokens per rank at a time, so ranks run 1..4 chunks of their own and pad the rest
    net.ep.prefill_chunk = 3
    ids = dp_batch(par.rank)
    logits, toks = D.greedy_run(net, ids, STEPS_DP, decode_tokens=DP_DECODE_TOKENS)
    res["dp_logits"], res["dp_tokens"] = torch.stack(logits), toks
    # (c) one decode step of (b) with a sync-free compute_experts and host syncs trapped in the dispatch
    with no_host_sync():
        try:
            torch.zeros(1).item()
            res["trap_works"] = False
        except RuntimeError:
            res["trap_works"] = True
    for moe in D.moes(net):
        moe.compute_experts = dense_compute_experts(moe)
        inner = moe.dispatch

        def trapped(*a, inner=inner):  # decode only: prefill agrees on its capacity with one .item-like read
            with no_host_sync() if inner.state.tokens is not None else contextlib.nullcontext():
                return inner(*a)

        moe.dispatch = trapped
    B, S = ids.shape
    with torch.inference_mode():
        net.allocate(B, S + 1)
        first = net.prefill(ids)[0][:, -1].argmax(-1)
        with net.ep.decode(DP_DECODE_TOKENS):
            res["nosync_logits"] = net.decode(first.view(B, 1), torch.full((B,), S))[:, -1]
    torch.save(res, os.path.join(out_dir, f"rank{par.rank}.pt"))
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- tests


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def reference():
    """Single-process runs (all experts local) of the same batch and of every rank's DP batch."""
    from deepinfer.engine.loader import load_model

    net = load_model(None, numerics="exact", dtype="float32", progress=False).model
    same = D.greedy_run(net, same_batch(), STEPS_SAME)
    dp = {r: D.greedy_run(net, dp_batch(r), STEPS_DP) for r in range(4)}
    return {"same": (torch.stack(same[0]), same[1]), "dp": {r: (torch.stack(l), t) for r, (l, t) in dp.items()}}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    """Launch the worker under torchrun with `world` ranks; -> (world, [per-rank results])."""
    world = request.param
    out = tmp_path_factory.mktemp(f"ep{world}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", DEEPINFER_BACKEND="torch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--master-addr", "127.0.0.1", "--master-port", str(D.free_port()), __file__, str(out)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return world, [torch.load(out / f"rank{r}.pt") for r in range(world)]


def test_ranks_hold_only_their_experts(ranks):
    world, res = ranks
    per = 8 // world
    assert [r["experts"] for r in res] == [(r * per, per) for r in range(world)]


def test_same_batch_matches_single_process(ranks, reference):
    """(a) every rank runs the same batch: logits equal the single-process run, same greedy tokens."""
    world, res = ranks
    ref_logits, ref_toks = reference["same"]
    for r in res:
        assert r["same_logits"].shape == ref_logits.shape
        for step in range(STEPS_SAME + 1):
            assert rel_err(r["same_logits"][step], ref_logits[step]) < RTOL, step
        assert torch.equal(r["same_tokens"], ref_toks)
        agree = r["same_agree"]
        assert len(agree) == world and max(agree) <= RTOL * float(ref_logits.abs().max())


def test_data_parallel_ranks_get_their_own_logits(ranks, reference):
    """(b) ranks run different batches (different token counts): each gets its own single-process logits."""
    world, res = ranks
    for rank, r in enumerate(res):
        ref_logits, ref_toks = reference["dp"][rank]
        assert r["dp_logits"].shape == ref_logits.shape
        for step in range(STEPS_DP + 1):
            assert rel_err(r["dp_logits"][step], ref_logits[step]) < RTOL, (rank, step)
        assert torch.equal(r["dp_tokens"], ref_toks)


def test_decode_dispatch_is_sync_free(ranks, reference):
    """(c) the decode step ran with .item/.tolist/int/bool raising inside every EP dispatch, and was right."""
    world, res = ranks
    for rank, r in enumerate(res):
        assert r["trap_works"]
        assert rel_err(r["nosync_logits"], reference["dp"][rank][0][1]) < RTOL


def test_trap_catches_host_syncs():
    """The trap can fail: the usual host syncs raise inside it (and work again after it)."""
    e = torch.tensor([0, 1, -1, 0])
    for sync in (lambda: torch.unique(e).tolist(), lambda: e.max().item(), lambda: int(e[0]),
                 lambda: bool((e < 0).any()), lambda: [1, 2][e[1]]):
        with no_host_sync(), pytest.raises(RuntimeError, match="host sync"):
            sync()
        sync()


def test_dense_stand_in_matches_compute_experts():
    """The sync-free stand-in used for (c) computes what the MoE's own compute_experts does."""
    from deepinfer.engine.loader import load_model

    moe = load_model(None, numerics="exact", dtype="float32", progress=False).model.layers[1].ffn
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, moe.gate_w.size(1), generator=g), torch.rand(6, generator=g)
    e = torch.tensor([0, 1, -1, 0, 7, 3])
    got = dense_compute_experts(moe)(x, w, e)
    torch.testing.assert_close(got, moe.compute_experts(x, w, e), rtol=1e-5, atol=1e-6)
    assert got[2].abs().max() == 0 and got.abs().max() > 0


def test_expert_range():
    assert [D.expert_range(r, 4, 8) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="divide evenly"):
        D.expert_range(0, 3, 8)


def test_rank_aware_load_reads_only_own_experts(monkeypatch):
    """Rank 1 of 2 reads experts 4..7 only; the checkpoint is still validated as a whole."""
    from deepinfer.checkpoint import reader

    read = []
    real_get = reader._get
    monkeypatch.setattr(reader, "_get", lambda f, e: (read.append(e.key), real_get(f, e))[1])
    lm = D.load_model_distributed(None, "exact", "float32", D.Parallel(rank=1, world=2))
    experts = {reader.routed_expert(n) for n in read} - {None}
    assert experts == {4, 5, 6, 7}
    assert any(n.startswith("layers.0.attn.") for n in read)
    for moe in D.moes(lm.model):
        assert moe.expert_offset == 4 and len(moe.experts) == 4
        assert isinstance(moe.dispatch, D.EPDispatch)


def test_transport_choice():
    par = D.Parallel(rank=0, world=2)
    assert D.choose_transport(par).name == "all_to_all"
    ok, line = D.deepep_status()
    deepep = D.choose_transport(par, "deepep")
    if not ok:
        assert deepep.name == "deepep-unavailable" and "not installed" in line
    else:
        assert deepep.name == "deepep-intranode"  # a 2-rank world on one host
    with pytest.raises(NotImplementedError):
        D.install_expert_parallel(object(), par, "deepep")
    with pytest.raises(ValueError):
        D.choose_transport(par, "nccl-magic")


def test_cli_dist_check_nproc_2():
    """`dist-check --nproc 2` re-executes itself under torchrun; both ranks agree."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               DEEPINFER_BACKEND="torch")
    p = subprocess.run([sys.executable, "-m", "deepinfer_cli.dist", "北京是", "--steps", "2", "--nproc", "2",
                        "--numerics", "exact", "--dtype", "float32"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "world 2" in p.stdout and "PASS: 2 ranks" in p.stdout
    assert p.stdout.count(" same") == 2


def test_cli_dist_check_bad_options():
    from typer.testing import CliRunner

    from deepinfer_cli.app import app

    for args, line in ((["--nproc", "-1"], "error: --nproc -1: must be >= 0"),
                       (["--steps", "-2"], "error: --steps -2: must be >= 0")):
        res = CliRunner().invoke(app, ["dist-check", "x", *args])
        assert res.exit_code == 2 and line in res.output, res.output


if __name__ == "__main__":
    _worker(sys.argv[1])
