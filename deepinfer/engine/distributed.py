"""Multi-process inference: data-parallel attention + expert-parallel MoE over `torch.distributed`.

Every rank runs its own sequences through attention (data parallel) and holds only the routed experts
`expert_range(rank, world, E)`; each MoE's `dispatch` is set to an `EPDispatch`, which sends every
(token, expert) pair to the rank that owns the expert and combines the results back.

The exchange is three `all_to_all_single` calls (the rows, their (weight, expert) metadata, the results
back) over FIXED-SIZE padded buffers: every rank sends exactly C = T_cap * k rows to every rank, the worst case (all of a rank's pairs
owned by one rank). Padding rows carry expert id -1 and come back as zeros. No split size ever crosses to
the host (no `.tolist()` / `.item()`), so a decode step with a fixed `T_cap` is CUDA-graph capturable.
`T_cap` must be the same on every rank: in decode it is the agreed maximum batch (`EPState.decode`); in
prefill it is `all_reduce(MAX)` of the ranks' token counts (capped at `prefill_chunk`, the rest in further
exchanges), the one extra (small) collective per MoE layer on the prefill path, which is never captured.

Check it: `python -m deepinfer_cli.dist "prompt" --nproc N` (= `deepinfer dist-check`), which re-runs itself
as `torchrun --nproc-per-node N -m deepinfer_cli.dist "prompt"`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepinfer.config import load_config
from deepinfer.engine.loader import LoadedModel, load_model, resolve_device, resolve_model_dir

# NVLink multicast (NVLS / symmetric-memory multicast) stays off: set before NCCL is initialised.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@dataclass(frozen=True)
class Parallel:
    """This process's place in the job: `rank` of `world`, its `device`, and the process group (None: world 1)."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_rank: int = 0
    group: object = None


def init_distributed(device: str | None = None, backend: str | None = None) -> Parallel:
    """Process group from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Without WORLD_SIZE: a single process (world 1, no group). Backend: nccl on CUDA, gloo on CPU.
    """
    os.environ.update(NCCL_ENV)  # never enable NVLink multicast, whatever the caller's environment says
    if "WORLD_SIZE" not in os.environ:
        return Parallel(device=resolve_device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if not dist.is_initialized():
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    return Parallel(rank, world, dev, local, dist.group.WORLD)


def free_port() -> int:
    """A TCP port nobody listens on now (for --master-port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expert_range(rank: int, world: int, n_experts: int) -> tuple[int, int]:
    """The routed experts rank `rank` owns: [lo, hi), contiguous, n_experts / world of them."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    if n_experts % world:
        raise ValueError(f"expert parallelism needs the {n_experts} routed experts to divide evenly over "
                         f"{world} ranks ({n_experts} % {world} = {n_experts % world}); use a world size "
                         f"that divides {n_experts}")
    per = n_experts // world
    return rank * per, (rank + 1) * per


def load_model_distributed(model_dir: str | None, numerics: str, dtype: str, par: Parallel,
                           progress: bool = False) -> LoadedModel:
    """`load_model` for one rank: reads only its own routed experts (validation still covers the whole
    checkpoint), then installs expert parallelism on every MoE when world > 1."""
    n_experts = load_config(resolve_model_dir(model_dir, progress)).n_routed_experts
    rng = expert_range(par.rank, par.world, n_experts)
    lm = load_model(model_dir, numerics, dtype, str(par.device), progress=progress, expert_range=rng)
    if par.world > 1:
        install_expert_parallel(lm.model, par)
    return lm


# --------------------------------------------------------------------------- expert-parallel dispatch


class EPState:
    """What every EPDispatch of a model shares: the group and the agreed per-rank token capacity.

    `tokens` None (prefill): each MoE agrees on the capacity with all_reduce(MAX) of the ranks' token
    counts, and exchanges at most `prefill_chunk` tokens per rank at a time (bounds the padded buffers:
    world * chunk * k rows). Set `tokens` (`with state.decode(n)`) to the engine's maximum decode batch:
    then no extra collective runs and every shape is static (capturable).
    """

    def __init__(self, par: Parallel, prefill_chunk: int = 2048):
        self.par, self.group, self.world = par, par.group, par.world
        self.prefill_chunk = prefill_chunk
        self.tokens: int | None = None

    @contextlib.contextmanager
    def decode(self, max_tokens: int):
        """Fix the per-rank token capacity to `max_tokens` (same value on every rank) inside the block."""
        old, self.tokens = self.tokens, max_tokens
        try:
            yield self
        finally:
            self.tokens = old

    def max_tokens(self, T: int, device: torch.device) -> int:
        """The largest token count of any rank in this (prefill) exchange: one small collective."""
        t = torch.tensor([T], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)  # prefill only (eager): the host needs the size to allocate the buffers


class EPDispatch:
    """`moe.dispatch` replacement: (token, expert) pairs -> owner ranks -> compute_experts -> back (the MoE
    sums the k rows with its shared expert, `moe_combine`).

    Send buffer row `dest * C + slot` holds this rank's `slot`-th pair for rank `dest` (slots in pair
    order, computed with a cumulative sum: no host sync). C = T_cap * k rows per destination.
    """

    def __init__(self, moe, state: EPState):
        self.moe, self.state = moe, state
        self.n_local = len(moe.experts)
        if self.n_local * state.world != moe.n_experts:
            raise ValueError(f"{moe.name}: {self.n_local} local experts x {state.world} ranks != {moe.n_experts}")

    def __call__(self, xt: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor,
                 xq: tuple | None = None) -> torch.Tensor:
        """xt [T, D], weights [T, k] f32, idx [T, k] global expert ids -> [T, k, D] in xt's dtype. xq (xt's
        act_quant) is not used: the exchange carries the rows in xt's dtype and the receiving rank quantises."""
        T, st = idx.size(0), self.state
        if st.tokens is not None:  # decode: the agreed static capacity
            if T > st.tokens:
                raise ValueError(f"{T} tokens on rank {st.par.rank} exceed the decode capacity {st.tokens}")
            return self.exchange(xt, weights, idx, st.tokens)
        t_max = st.max_tokens(T, xt.device)
        chunk = max(1, min(t_max, st.prefill_chunk))
        # every rank runs the same number of exchanges (from t_max); a rank past its own tokens sends padding
        outs = [self.exchange(xt[i:i + chunk], weights[i:i + chunk], idx[i:i + chunk], chunk)
                for i in range(0, max(t_max, 1), chunk)]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def exchange(self, xt: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, t_cap: int) -> torch.Tensor:
        """One fixed-size exchange of this rank's T <= t_cap tokens -> [T, k, D] in xt's dtype."""
        T, k = idx.shape
        D, W, dev = xt.size(1), self.state.world, xt.device
        C = t_cap * k
        e = idx.reshape(-1)
        dest = torch.div(e, self.n_local, rounding_mode="floor")  # owner rank of each pair
        hit = dest.unsqueeze(1) == torch.arange(W, device=dev)  # [P, W] (not F.one_hot: it syncs on CUDA)
        slot = (hit.long().cumsum(0) - 1).gather(1, dest.unsqueeze(1)).squeeze(1)
        pos = dest * C + slot  # [P] row in the send buffer; < W*C because slot < T*k <= C
        send_x = xt.new_zeros(W * C, D).index_copy_(0, pos, xt.repeat_interleave(k, dim=0))
        meta = torch.stack([weights.reshape(-1).float(), (e - dest * self.n_local).float()], 1)
        send_m = torch.zeros(W * C, 2, device=dev)
        send_m[:, 1] = -1.0  # padding: expert -1 (a fill, not a host-built tensor: capturable)
        send_m.index_copy_(0, pos, meta)
        recv_x, recv_m = torch.empty_like(send_x), torch.empty_like(send_m)
        dist.all_to_all_single(recv_x, send_x, group=self.state.group)
        dist.all_to_all_single(recv_m, send_m, group=self.state.group)  # (weight, local id): ids < 2^24 exact
        out = self.moe.compute_experts(recv_x, recv_m[:, 0], recv_m[:, 1].long())  # [W*C, D] xt's dtype
        back = torch.empty_like(out)
        dist.all_to_all_single(back, out, group=self.state.group)
        return back.index_select(0, pos).view(T, k, D)


def moes(model) -> list:
    """Every MoE of a Transformer (main layers, then MTP blocks)."""
    return [b.ffn for b in model.layers] + [m.block.ffn for m in model.mtp]


def install_expert_parallel(model, par: Parallel, transport: str = "auto", prefill_chunk: int = 2048) -> EPState:
    """Replace every MoE's dispatch with the expert-parallel exchange; returns the shared state
    (also `model.ep`). All ranks must then call prefill/decode together, the same number of times."""
    choice = choose_transport(par, transport)
    if choice.name != "all_to_all":
        raise NotImplementedError(f"EP transport {choice.name}: not implemented ({choice.reason}); "
                                  "use the all_to_all transport")
    state = EPState(par, prefill_chunk)
    for moe in moes(model):
        moe.dispatch = EPDispatch(moe, state)
    model.ep = state
    return state


# --------------------------------------------------------------------------- transport choice (DeepEP)


@dataclass(frozen=True)
class Transport:
    name: str  # all_to_all | deepep-intranode | deepep-internode
    reason: str


def deepep_status() -> tuple[bool, str]:
    """(importable, one line): is DeepEP here, and which of its paths this machine would use."""
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False, "deep_ep not installed"
    if os.path.exists("/dev/infiniband"):
        return True, "deep_ep installed; /dev/infiniband present: internode (RDMA) + intranode (NVLink) kernels"
    return True, "deep_ep installed; no /dev/infiniband: intranode (NVLink) kernels only"


def choose_transport(par: Parallel, want: str = "auto") -> Transport:
    """auto -> all_to_all (the only implemented transport); deepep -> the DeepEP path this job would use:
    intranode (NVLink) when every rank is on this host, internode (RDMA) across hosts with /dev/infiniband."""
    if want in ("auto", "all_to_all"):
        return Transport("all_to_all", "torch.distributed.all_to_all_single over fixed-size padded buffers")
    if want != "deepep":
        raise ValueError(f"--ep-transport {want!r}: choose auto, all_to_all or deepep")
    ok, line = deepep_status()
    if not ok:
        return Transport("deepep-unavailable", line)
    if int(os.environ.get("LOCAL_WORLD_SIZE", par.world)) >= par.world:  # one host: NVLink buffers
        return Transport("deepep-intranode", line + "; DeepEP dispatch not implemented")
    if os.path.exists("/dev/infiniband"):
        return Transport("deepep-internode", line + "; DeepEP dispatch not implemented")
    return Transport("deepep-unavailable", line + "; ranks span hosts but there is no /dev/infiniband")


# --------------------------------------------------------------------------- rank agreement


def check_ranks_agree(t: torch.Tensor, par: Parallel) -> list[float]:
    """Max |t_rank - t_rank0| for every rank (each rank gets the full list). Shapes must match across ranks."""
    if par.world == 1:
        return [0.0]
    x = t.detach().float().contiguous()
    parts = [torch.empty_like(x) for _ in range(par.world)]
    dist.all_gather(parts, x, group=par.group)
    return [float((p - parts[0]).abs().max()) if p.numel() else 0.0 for p in parts]


@torch.inference_mode()
def greedy_run(model, ids: torch.Tensor, steps: int, decode_tokens: int | None = None
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill `ids` [B, S] then `steps` greedy decode steps. -> (logits [B, V] f32 per step: the
    prefill's last position, then each decode step's; the tokens [B, steps + 1] picked from them).

    Under expert parallelism every rank must call this together with the same `steps`;
    `decode_tokens` is the agreed decode capacity (default: this rank's B, right when all ranks have equal B).
    """
    B, S = ids.shape
    dev = model.device
    model.allocate(B, S + steps)
    logits = model.prefill(ids.to(dev))[0][:, -1]
    out, toks = [logits], [logits.argmax(-1)]
    ep = getattr(model, "ep", None)
    with ep.decode(decode_tokens or B) if ep is not None else contextlib.nullcontext():
        for i in range(steps):
            pos = torch.full((B,), S + i, dtype=torch.long, device=dev)
            logits = model.decode(toks[-1].view(B, 1), pos)[:, -1]
            out.append(logits)
            toks.append(logits.argmax(-1))
    return out, torch.stack(toks, 1)
