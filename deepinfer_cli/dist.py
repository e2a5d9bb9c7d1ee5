"""`deepinfer dist-check`: run one prompt on every rank with expert parallelism and check that all ranks agree."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import torch
import typer

from deepinfer.engine import distributed as D
from deepinfer.ops import ops
from deepinfer_cli import common
from deepinfer_cli.errors import UserError, handle_errors


def _relaunch(nproc: int, args: list[str]) -> int:
    """Re-run this command under torchrun with `nproc` processes on this host; its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(D.free_port()), "-m", "deepinfer_cli.dist", *args]
    print("+ " + shlex.join(cmd), file=sys.stderr)
    return subprocess.call(cmd)


@handle_errors
def dist_check_cmd(
    prompt: str = typer.Argument("The capital of France is", help="Prompt text, or - to read it from stdin."),
    steps: int = typer.Option(8, "--steps", "-k", help="Greedy decode steps after the prompt."),
    nproc: int = typer.Option(0, "--nproc", help="Re-run under torchrun (torch.distributed.run) with N processes."),
    rtol: float = typer.Option(1e-5, "--rtol", help="Largest max|Δlogits| / max|logits| counted as agreement."),
    transport: str = typer.Option("auto", "--ep-transport", help="auto | all_to_all | deepep (not implemented)."),
    model: str = common.MODEL,
    backend: str = common.BACKEND,
    numerics: str = common.NUMERICS,
    dtype: str = common.DTYPE,
    device: str = common.DEVICE,
):
    """Every rank runs PROMPT (+ --steps greedy decode steps) with data-parallel attention and
    expert-parallel MoE; prints each rank's largest logit difference to rank 0 and whether its tokens match.
    Exit code 1 when a rank disagrees.

    Example: deepinfer dist-check "北京是" --steps 8 --nproc 2
    (same as: torchrun --nproc-per-node 2 -m deepinfer_cli.dist "北京是" --steps 8)
    """
    if steps < 0:
        raise UserError(f"--steps {steps}: must be >= 0")
    if not rtol >= 0:  # also NaN
        raise UserError(f"--rtol {rtol:g}: must be >= 0")
    if nproc < 0:
        raise UserError(f"--nproc {nproc}: must be >= 0 (0 runs this process as the only rank, or as a torchrun rank)")

    if nproc and "WORLD_SIZE" not in os.environ:
        # what every rank would refuse, refused once here, before torchrun starts N copies of the error
        from deepinfer.config import load_config
        from deepinfer.engine.loader import resolve_model_dir

        text = common.read_prompt(prompt)
        common.check_prompt(text)
        cfg = load_config(resolve_model_dir(model, progress=False))
        try:
            D.expert_range(0, nproc, cfg.n_routed_experts)
        except ValueError as e:
            raise UserError(f"--nproc {nproc}: {e}") from None
        if prompt == "-":  # stdin is read once, here: the ranks get the text
            prompt = text
        args = [prompt, "--steps", str(steps), "--rtol", str(rtol), "--ep-transport", transport,
                "--numerics", numerics, "--dtype", dtype]
        for flag, val in (("--model", model), ("--backend", backend), ("--device", device)):
            if val:
                args += [flag, val]
        raise typer.Exit(_relaunch(nproc, args))
    text = common.read_prompt(prompt)
    common.check_prompt(text)
    par = D.init_distributed(device)
    chosen = D.choose_transport(par, transport)
    if chosen.name != "all_to_all":
        raise UserError(f"--ep-transport {transport}: {chosen.name}: {chosen.reason}")
    ops.configure(backend or None, None)
    lm = D.load_model_distributed(model, numerics, dtype, par, progress=par.rank == 0)
    ids = torch.tensor([lm.tokenizer.encode_prompt(text, "raw")])
    logits, toks = D.greedy_run(lm.model, ids, steps)
    dl = torch.stack([torch.tensor(D.check_ranks_agree(g, par)) for g in logits])  # [steps + 1, world]
    dt = torch.tensor(D.check_ranks_agree(toks, par))
    scale = max(float(g.abs().max()) for g in logits)
    ok = bool((dt == 0).all()) and float(dl.max()) <= rtol * scale
    if par.rank == 0:
        lo_hi = [D.expert_range(r, par.world, lm.cfg.n_routed_experts) for r in range(par.world)]
        backend_name = "single process" if par.world == 1 else f"{torch.distributed.get_backend()}"
        print(f"dist-check: {lm.cfg.name}, world {par.world} ({backend_name}, {par.device}), "
              f"{lm.cfg.n_routed_experts} experts, {steps} decode steps, transport "
              f"{chosen.name}; DeepEP: {D.deepep_status()[1]}")
        print(f"tokens (rank 0): {toks[0].tolist()}  {lm.tokenizer.decode(toks[0].tolist())!r}")
        print(f"{'rank':>4}  {'experts':>9}  {'max|Δlogits| vs rank 0':>22}  {'worst step':>10}  tokens")
        for r in range(par.world):
            col = dl[:, r]
            print(f"{r:>4}  {f'{lo_hi[r][0]}-{lo_hi[r][1] - 1}':>9}  {float(col.max()):>22.3e}  "
                  f"{int(col.argmax()):>10}  {'same' if dt[r] == 0 else 'DIFFERENT'}")
        print(("PASS" if ok else "FAIL") + f": {par.world} ranks, max |Δlogits| {float(dl.max()):.3e} "
              f"(limit {rtol:g} x max|logit| {scale:.3g})")
    if par.world > 1:
        torch.distributed.destroy_process_group()
    if not ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("dist-check")(dist_check_cmd)


def main() -> None:
    """`python -m deepinfer_cli.dist` = `deepinfer dist-check` (what --nproc re-executes under torchrun)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(dist_check_cmd)
    app()


if __name__ == "__main__":
    main()
