"""`deepinfer generate`: complete a prompt (or a file of prompts, continuously batched) with the reference
engine (or a kernel backend)."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys

import typer
from rich.table import Table

from deepinfer.engine import guided
from deepinfer.engine.generate import SamplingParams, generate
from deepinfer.engine.graphs import GraphCaptureError
from deepinfer.engine.speculative import check_speculate
from deepinfer.quant.requant import EXPERT_FORMS
from deepinfer_cli import common
from deepinfer_cli.console import console
from deepinfer_cli.errors import UserError, fail, handle_errors


@handle_errors
def generate_cmd(
    prompt: str = typer.Argument(None, help="Prompt text, or - to read it from stdin (or use --input-file)."),
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
    op_map: str = common.OPS,
    flaggems: str = common.FLAGGEMS,
    logprobs: int = typer.Option(0, "--logprobs", help="Report the top-N alternatives per generated token."),
    keep_special_tokens: bool = typer.Option(False, "--keep-special-tokens", help="Keep special tokens (EOS, "
                                             "BOS, ...) in the text; they are always in token_ids and the table."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text and a table "
                                 "(with --input-file: one JSON object per prompt per line)."),
    input_file: str = typer.Option(None, "--input-file", help="Prompts from a file: one per line, or JSONL "
                                   "objects {\"prompt\": ..., and optional max_new_tokens, temperature, top_k, "
                                   "top_p, seed, stop, chat, think, and one of json_schema (an object or a file), "
                                   "regex, grammar (a file), choice (a list) overriding the options}."),
    max_batch: int = typer.Option(None, "--max-batch", help="Sequences decoding at once (cache rows); more "
                                  "prompts wait for a free row. Default: min(64, number of prompts)."),
    eager: bool = typer.Option(False, "--eager", help="No CUDA graphs for the decode step (graphs are only "
                               "attempted on CUDA with a kernel backend; the torch reference always runs eager)."),
    prefill_graphs: bool = typer.Option(None, "--prefill-graphs/--no-prefill-graphs", help="Replay prompt chunks "
                                        "of 256, 512, ... 8192 tokens as CUDA graphs where decode runs as graphs "
                                        "(same tokens; default: $DEEPINFER_PREFILL_GRAPHS, off)."),
    json_schema: str = typer.Option(None, "--json-schema", help="Guided decoding: the output is JSON valid under "
                                    "the JSON schema in FILE (xgrammar; logprobs are reported after the mask)."),
    regex: str = typer.Option(None, "--regex", help="Guided decoding: the output matches the regular expression."),
    grammar: str = typer.Option(None, "--grammar", help="Guided decoding: the output follows the EBNF grammar in "
                                "FILE (xgrammar's dialect, start rule `root`)."),
    choice: str = typer.Option(None, "--choice", help="Guided decoding: the output is one of the comma-separated "
                               "strings a,b,c."),
    prefill_chunk: int = typer.Option(None, "--prefill-chunk", help="Prefill at most N prompt tokens per step "
                                      "(long prompts continue over several steps while the others keep "
                                      "decoding); 0: whole prompts. Default: whole prompts when they fit in "
                                      "memory, else a chunk sized from the free memory."),
    experts: str = typer.Option(None, "--experts", help="The routed experts' form: fp4 as the release stores them "
                                "(default), or fp8 requantised per 128 x 128 block at load (DeepGEMM's form, the "
                                "field notes' engine's: twice the experts' bytes; a lossy tensor is said)."),
    speculate: int = typer.Option(None, "--speculate", help="MTP speculative decoding: K draft tokens per step "
                                  "from the checkpoint's MTP block, verified in one forward (greedy: the same "
                                  "tokens; sampled: the same distribution, by rejection sampling). Off by default."),
):
    """Generate a completion (or many: --input-file, continuously batched).

    Example: deepinfer generate "北京是" --max-new-tokens 16 --json
    """
    if chat and think:
        raise typer.BadParameter("--chat and --think are exclusive")
    if max_batch is not None and max_batch < 1:
        raise UserError(f"--max-batch {max_batch}: must be at least 1")
    if prefill_chunk is not None and prefill_chunk < 0:
        raise UserError(f"--prefill-chunk {prefill_chunk}: must be >= 0 (0: whole prompts)")
    experts = experts.strip().lower() if experts is not None else None
    if experts is not None and experts not in EXPERT_FORMS:
        raise UserError(f"--experts {experts}: choose {' or '.join(EXPERT_FORMS)}")
    constraint = guided.from_options(json_schema, regex, grammar, choice)  # checked before any model load
    if speculate is not None and speculate < 1:
        raise UserError(f"--speculate {speculate}: must be at least 1 (draft tokens per step)")
    base = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=seed, stop=tuple(stop), logprobs=logprobs, guide=constraint)
    base.check()
    if temperature == 0 and (top_k or top_p != 1):  # greedy decoding takes the argmax: the filters change nothing
        unused = " and ".join(o for o, on in (("--top-k", top_k), ("--top-p", top_p != 1)) if on)
        print(f"deepinfer: {unused} have no effect at --temperature 0 (greedy decoding); give --temperature > 0 to "
              "sample", file=sys.stderr)
    mode = "chat" if chat else "think" if think else "raw"
    if input_file is not None:
        if prompt is not None:
            raise UserError("give a PROMPT or --input-file, not both")
        items = read_input_file(input_file, base, mode)
    else:
        items = [(common.read_prompt(prompt), mode, base)]
        common.check_prompt(items[0][0], mode)
    if speculate and any(p.guide is not None for _, _, p in items):
        # the speculative step samples drafts and verifies them without the token bitmask
        raise UserError(f"--speculate {speculate} with a guided constraint (--json-schema / --regex / --grammar / "
                        "--choice, or an input-file row's): speculative decoding does not apply the mask yet; use one")
    lm = common.setup(model, backend, strict, numerics, dtype, device, progress=not as_json, flaggems=flaggems,
                      op_map=op_map, experts=experts)
    if speculate:
        try:
            check_speculate(lm.model, speculate)
        except ValueError as e:
            raise UserError(str(e)) from None
    tok = lm.tokenizer
    if any(p.guide is not None for _, _, p in items):  # the constraints, compiled against the vocabulary
        compiler = guided.GuideCompiler(tok, lm.cfg.vocab_size)
        items = [(t, m, p if p.guide is None else dataclasses.replace(p, guide=compiler.compile(p.guide)))
                 for t, m, p in items]
    ids = [tok.encode_prompt(text, m) for text, m, _ in items]
    graphs = not eager and lm.model.device.type == "cuda" and common.ops.backend != "torch"
    # the completion's text leaves special tokens out (as transformers' and vLLM's do), stop strings included
    decode = functools.partial(tok.decode, skip_special_tokens=not keep_special_tokens)
    stream = None
    if input_file is None and not as_json and sys.stdout.isatty():
        stream = TextStream(items[0][0], decode, base.stop)
    try:
        res = generate(lm.model, ids, [p for _, _, p in items], tok.eos_id, decode,
                       max_batch=max_batch, graphs=graphs, prefill_chunk=prefill_chunk,
                       on_token=None if stream is None else stream.on_token, speculate=speculate or 0,
                       prefill_graphs=prefill_graphs)
    except GraphCaptureError as e:
        raise fail(str(e)) from None
    if input_file is not None:
        _print_many(lm, dtype, items, res, logprobs, as_json)
        return
    text = items[0][0]
    c = res.completions[0]
    if as_json:
        print(json.dumps(_json_obj(lm, dtype, text, c, res, logprobs), ensure_ascii=False))
        return
    con = console()
    if stream is not None:
        stream.finish(c.text)
    else:
        con.print(text + c.text, markup=False, highlight=False)
    t = Table(title=f"{lm.cfg.name} · {common.ops.backend} · {lm.model.numerics.name}/{dtype}", show_lines=False)
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
    con.print(f"{len(c.token_ids)} tokens, finish: {c.finish_reason}{_constraint_note(c)}; prefill "
              f"{res.prefill_s * 1e3:.0f} ms, decode {res.tokens_per_s:.1f} tokens/s", highlight=False)
    if speculate:
        con.print(_spec_table([c]))


def _constraint_note(c) -> str:
    return f", {c.constraint['kind']} constraint: {c.constraint['status']}" if c.constraint else ""


def _finite(x: float):
    return x if x == x and abs(x) != float("inf") else None


def _spec_table(comps) -> Table:
    """Per prompt: drafted, accepted, acceptance rate, mean accepted length (tokens per verify step)."""
    t = Table(title="speculative decoding (MTP)")
    for col in ("#", "steps", "drafted", "accepted", "acceptance", "mean accepted length"):
        t.add_column(col, justify="right")
    for i, c in enumerate(comps):
        s = c.speculation()
        t.add_row(str(i), str(s["steps"]), str(s["drafted"]), str(s["accepted"]), f"{s['acceptance_rate']:.3f}",
                  f"{s['mean_accepted_length']:.3f}")
    return t


class TextStream:
    """Prints a completion to the terminal as its tokens come. Text is written once it is settled: not
    ending in a partial UTF-8 sequence (the tokenizer's U+FFFD), and, with stop strings, held back by the
    longest stop's length so a stop string is never printed before `finish` cuts it."""

    def __init__(self, prompt: str, decode, stops: tuple):
        self.decode, self.hold = decode, max((len(s) for s in stops), default=0)
        self.shown = 0
        sys.stdout.write(prompt)
        sys.stdout.flush()

    def on_token(self, index: int, c) -> None:
        text = self.decode(c.token_ids)
        end = len(text) - self.hold
        while end > self.shown and text[end - 1] == "\ufffd":
            end -= 1
        if end > self.shown:
            sys.stdout.write(text[self.shown:end])
            sys.stdout.flush()
            self.shown = end

    def finish(self, final: str) -> None:
        sys.stdout.write(final[self.shown:] + "\n")
        sys.stdout.flush()


def _json_obj(lm, dtype, text, c, res, logprobs) -> dict:
    out = {
        "model": lm.cfg.name, "backend": common.ops.backend, "numerics": lm.model.numerics.name, "dtype": dtype,
        "prompt": text, "input_ids": c.input_ids, "token_ids": c.token_ids, "text": c.text,
        "logprobs": c.logprobs, "margins": [_finite(m) for m in c.margins], "finish_reason": c.finish_reason,
        "tokens_per_s": res.tokens_per_s, "prefill_s": res.prefill_s,
    }
    if c.constraint is not None:  # guided: logprobs, top_logprobs and margins are those of the masked logits
        out["constraint"] = c.constraint
        out["logprobs_after_mask"] = True
    if logprobs:
        out["top_logprobs"] = [[[i, lp] for i, lp in row] for row in c.top_logprobs]
    if c.spec_steps:
        out["speculative"] = c.speculation()
    return out


def _print_many(lm, dtype, items, res, logprobs, as_json) -> None:
    if as_json:  # JSONL: one object per prompt, in input order
        for i, ((text, _, _), c) in enumerate(zip(items, res.completions)):
            print(json.dumps({"index": i, **_json_obj(lm, dtype, text, c, res, logprobs)},
                             ensure_ascii=False))
        return
    con = console()
    for i, ((text, _, _), c) in enumerate(zip(items, res.completions)):
        con.rule(f"[{i}] {len(c.token_ids)} tokens, finish: {c.finish_reason}{_constraint_note(c)}")
        con.print(text + c.text, markup=False, highlight=False)
    total = sum(len(c.token_ids) for c in res.completions)
    con.print(f"{len(items)} prompts, {total} tokens; prefill {res.prefill_s * 1e3:.0f} ms, "
              f"decode {res.tokens_per_s:.1f} tokens/s", highlight=False)
    if any(c.spec_steps for c in res.completions):
        con.print(_spec_table(res.completions))


_OVERRIDES = {"max_new_tokens": int, "temperature": (int, float), "top_k": int, "top_p": (int, float), "seed": int}


def read_input_file(path: str, base: SamplingParams, mode: str) -> list[tuple[str, str, SamplingParams]]:
    """-> [(prompt text, prompt mode raw|chat|think, SamplingParams)] in file order.

    JSONL when the file ends in .jsonl/.ndjson or its first non-blank line is a JSON object; otherwise one
    prompt per line. Blank lines are skipped.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UserError(f"--input-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--input-file {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start})") from None
    numbered = [(n, ln) for n, ln in enumerate(lines, 1) if ln.strip()]
    if not numbered:
        raise UserError(f"--input-file {path}: no prompts in the file")
    jsonl = path.endswith((".jsonl", ".ndjson")) or _is_json_object(numbered[0][1])
    if not jsonl:
        return [(ln, mode, base) for _, ln in numbered]
    out = []
    for n, ln in numbered:
        where = f"--input-file {path} line {n}"
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UserError(f'{where}: expected an object with a "prompt" string')
        unknown = set(obj) - {"prompt", "chat", "think", "stop", *_OVERRIDES, *guided.KINDS}
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        kw = {}
        for k, typ in _OVERRIDES.items():
            if k in obj:
                v = obj[k]
                if isinstance(v, bool) or not isinstance(v, typ):
                    raise UserError(f"{where}: {k} must be a number, got {v!r}")
                kw[k] = v
        if "stop" in obj:
            st = obj["stop"]
            st = [st] if isinstance(st, str) else st
            if not isinstance(st, list) or not all(isinstance(s, str) for s in st):
                raise UserError(f"{where}: stop must be a string or a list of strings")
            kw["stop"] = tuple(st)
        row_constraint = guided.from_jsonl(obj, where)
        if row_constraint is not None:
            kw["guide"] = row_constraint
        m = mode
        for k in ("chat", "think"):
            if k in obj and not isinstance(obj[k], bool):
                raise UserError(f"{where}: {k} must be true or false")
        if obj.get("chat") and obj.get("think"):
            raise UserError(f"{where}: chat and think are exclusive")
        if "chat" in obj or "think" in obj:
            m = "chat" if obj.get("chat") else "think" if obj.get("think") else "raw"
        p = dataclasses.replace(base, **kw)
        try:
            p.check()
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
        common.check_prompt(obj["prompt"], m, where)
        out.append((obj["prompt"], m, p))
    return out


def _is_json_object(line: str) -> bool:
    if not line.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
