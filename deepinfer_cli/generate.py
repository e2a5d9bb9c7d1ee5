"""`deepinfer generate`: complete a prompt with the reference engine (or a kernel backend)."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from deepinfer.engine.generate import SamplingParams, generate
from deepinfer_cli import common
from deepinfer_cli.errors import handle_errors


@handle_errors
def generate_cmd(
    prompt: str = typer.Argument(None, help="Prompt text, or - to read it from stdin."),
    model: str = common.MODEL,
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off)."),
    seed: int = common.SEED,
    chat: bool = typer.Option(False, "--chat", help="V4 chat layout: BOS <｜User｜> prompt <｜Assistant｜> </think>."),
    think: bool = typer.Option(False, "--think", help="Like --chat but opens a thinking block (<think>)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    device: str = common.DEVICE,
    dtype: str = common.DTYPE,
    numerics: str = common.NUMERICS,
    backend: str = common.BACKEND,
    strict: bool = common.STRICT,
    logprobs: int = typer.Option(0, "--logprobs", help="Report the top-N alternatives per generated token."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text and a table."),
):
    """Generate a completion.

    Example: deepinfer generate "北京是" --max-new-tokens 16 --json
    """
    if chat and think:
        raise typer.BadParameter("--chat and --think are exclusive")
    text = common.read_prompt(prompt)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=tuple(stop), logprobs=logprobs)
    params.check()
    lm = common.setup(model, backend, strict, numerics, dtype, device, progress=not as_json)
    tok = lm.tokenizer
    ids = tok.encode_prompt(text, "chat" if chat else "think" if think else "raw")
    res = generate(lm.model, [ids], params, tok.eos_id, tok.decode)
    c = res.completions[0]
    if as_json:
        out = {
            "model": lm.cfg.name, "backend": common.ops.backend, "numerics": numerics, "dtype": dtype,
            "prompt": text, "input_ids": c.input_ids, "token_ids": c.token_ids, "text": c.text,
            "logprobs": c.logprobs, "margins": c.margins, "finish_reason": c.finish_reason,
            "tokens_per_s": res.tokens_per_s, "prefill_s": res.prefill_s,
        }
        if logprobs:
            out["top_logprobs"] = [[[i, lp] for i, lp in row] for row in c.top_logprobs]
        print(json.dumps(out, ensure_ascii=False))
        return
    con = Console()
    con.print(text + c.text, markup=False, highlight=False)
    t = Table(title=f"{lm.cfg.name} · {common.ops.backend} · {numerics}/{dtype}", show_lines=False)
    for col in ("#", "id", "text", "logprob", "margin"):
        t.add_column(col, justify="right" if col != "text" else "left")
    if logprobs:
        t.add_column(f"top-{logprobs}")
    for i, (tid, lp, m) in enumerate(zip(c.token_ids, c.logprobs, c.margins)):
        row = [str(i), str(tid), repr(tok.token_text(tid)), f"{lp:.3f}", f"{m:.3f}"]
        if logprobs:
            row.append(" ".join(f"{repr(tok.token_text(a))}:{b:.2f}" for a, b in c.top_logprobs[i]))
        t.add_row(*row)
    con.print(t)
    con.print(f"{len(c.token_ids)} tokens, finish: {c.finish_reason}; prefill {res.prefill_s * 1e3:.0f} ms, "
              f"decode {res.tokens_per_s:.1f} tokens/s", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
