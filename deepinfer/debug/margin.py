"""Does a numerical difference change an answer? Top-1 agreement and logit margins, position by position.

The reference configuration decodes N greedy steps from the prompt; the test configuration is
teacher-forced on the reference's tokens so both predict at the same positions. Both sides use
prefill + decode steps (decode exercises the caches, which is where ports break): position i's logits
are the prompt's last logits (i = 0) or decode step i's logits, predicting generated token i.

Per position: each side's top-1 and own margin m = top1 - top2 logit, and
  Δmargin = m_test(ref token) - m_ref,  m_test(ref token) = test[ref top-1] - max over other tokens of test,
which equals m_test - m_ref where the top-1 agrees and goes negative where it flips.

The verdict never takes its yardstick from the test (a worse test must not widen its own excuse):

* the noise band, in logits, is the largest of: the rounding of the logits themselves, k·√2·u·max|logit|
  with u the unit roundoff of the coarser compute dtype; the reference's own dtype noise, k·std(Δmargin)
  of a *noise run* -- the reference configuration re-run (teacher-forced) in the test's dtype, or in the
  other 16-bit dtype when both sides share one; or the band the user gives (`--band`, which replaces both);
* a flip is a near-tie when the reference's margin lies inside the band and the logits are not far off,
  else a divergence;
* a position whose logits are far off (relative error ‖test - ref‖/‖ref‖ above `tol`, default 0.5: half
  the logit vector is error) is divergent whatever its margins, and so is the run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

SPEC_KEYS = ("backend", "numerics", "dtype", "device", "kv", "experts")
KV_FORMATS = ("bf16", "fp8")  # the KV cache's form under official numerics (`Numerics.kv_qat`)
DEFAULT_REF = "numerics=exact,dtype=float32"
DEFAULT_TEST = "numerics=official,dtype=bfloat16"


def parse_spec(spec: str, what: str = "--ref") -> dict:
    """`backend=torch,numerics=official,dtype=bfloat16,device=cpu,kv=fp8,experts=fp8,op.grouped_gemm=tilelang` -> dict
    (missing keys: defaults; numerics: official, official@REV or exact; kv None: the release's form; experts (absent unless given):
    as stored, fp8: requantised per 128 (`deepinfer.quant.requant`); "ops": the per-op backend map of
    the `op.NAME=BACKEND` keys, as `--op` takes it, {} for none)."""
    from deepinfer.model.numerics import parse_numerics
    from deepinfer.ops.registry import parse_op_map

    out = {"backend": None, "numerics": "official", "dtype": "bfloat16", "device": None, "kv": None, "ops": {}}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        k, eq, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if k.startswith("op.") and eq and v:
            out["ops"].update(parse_op_map(f"{k[3:]}={v}", f"{what} {spec!r}:"))
            continue
        if not eq or k not in SPEC_KEYS or not v:
            raise ValueError(f"{what} {spec!r}: expected key=value pairs with keys {', '.join(SPEC_KEYS)}, "
                             "op.NAME")
        out[k] = v
    from deepinfer.model.weights import DTYPES

    if out["dtype"] not in DTYPES:  # named as the SPEC's key: the user gave no --dtype
        raise ValueError(f"{what} {spec!r}: dtype={out['dtype']}: choose one of {', '.join(DTYPES)}")
    if out["kv"] is not None and out["kv"] not in KV_FORMATS:
        raise ValueError(f"{what} {spec!r}: kv={out['kv']}: choose {' or '.join(KV_FORMATS)}")
    from deepinfer.quant.requant import EXPERT_FORMS

    if out.get("experts") is not None and out["experts"] not in EXPERT_FORMS:
        raise ValueError(f"{what} {spec!r}: experts={out['experts']}: choose {' or '.join(EXPERT_FORMS)} (fp8: the FP4 "
                         "experts requantised per 128, DeepGEMM's form)")
    try:
        mode = parse_numerics(out["numerics"])[0]
    except ValueError as e:
        raise ValueError(f"{what} {spec!r}: numerics={e}") from None
    if out["kv"] == "fp8" and mode != "official":
        raise ValueError(f"{what} {spec!r}: kv=fp8 is official numerics' KV QAT; {out['numerics']} keeps a float cache")
    return out


def configure_spec(spec: dict) -> None:
    """Point the process-wide dispatcher at a SPEC's backend and per-op map."""
    from deepinfer.ops import ops

    ops.configure(spec.get("backend") or None, None, spec.get("ops") or None)


def spec_str(spec: dict) -> str:
    from deepinfer.ops.registry import choice_str

    return ",".join([f"{k}={spec[k]}" for k in SPEC_KEYS if spec.get(k)]
                    + [f"op.{op}={choice_str(b)}" for op, b in sorted((spec.get("ops") or {}).items())])


@dataclass
class Position:
    pos: int  # index into the generated tokens (absolute position = prompt length + pos - 1 for pos > 0)
    ref_token: int
    test_token: int
    ref_margin: float
    test_margin: float
    delta: float  # Δmargin (see module doc)
    agree: bool
    logits_rel_err: float
    forced: bool = True  # False: the inputs of the two sides differed before this position (free-running)
    label: str = ""  # near-tie | divergence (a flip), or "logits off" (agrees, but far off)
    logits_max: float = 0.0  # max |ref logit|, for the rounding band


UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
DEFAULT_TOL = 0.5


def noise_dtype(ref_dtype: str, test_dtype: str) -> str | None:
    """The dtype of the noise run: the test's where it differs from the reference's, else the other
    16-bit type (bf16 <-> fp16); None for float32 against float32 (its rounding band is the noise)."""
    if test_dtype != ref_dtype:
        return test_dtype
    return {"bfloat16": "float16", "float16": "bfloat16"}.get(ref_dtype)


@dataclass
class MarginResult:
    ref: str
    test: str
    k: float
    positions: list[Position] = field(default_factory=list)
    tol: float = DEFAULT_TOL  # logits relative error beyond which a position is far off
    unit_roundoff: float = 2.0 ** -8  # of the coarser compute dtype of the two sides
    noise_std: float | None = None  # std(Δmargin) of the noise run (reference vs itself in another dtype)
    noise: str = ""  # what the noise run was
    user_band: float | None = None  # --band: replaces the measured band

    @property
    def n(self) -> int:
        return len(self.positions)

    @property
    def agreement(self) -> float:
        return sum(p.agree for p in self.positions) / self.n if self.n else 1.0

    @property
    def first_disagreement(self) -> int | None:
        return next((p.pos for p in self.positions if not p.agree), None)

    @property
    def delta_mean(self) -> float:
        return sum(p.delta for p in self.positions) / self.n if self.n else 0.0

    @property
    def delta_std(self) -> float:
        # sample std (n-1): with few positions the population std understates the noise
        if self.n < 2:
            return 0.0
        m = self.delta_mean
        return math.sqrt(sum((p.delta - m) ** 2 for p in self.positions) / (self.n - 1))

    @property
    def rounding_band(self) -> float:
        mx = max((p.logits_max for p in self.positions), default=0.0)
        return self.k * math.sqrt(2) * self.unit_roundoff * mx

    @property
    def band(self) -> float:
        if self.user_band is not None:
            return self.user_band
        return max(self.rounding_band, self.k * (self.noise_std or 0.0))

    @property
    def band_source(self) -> str:
        if self.user_band is not None:
            return "--band"
        if self.noise_std is not None and self.k * self.noise_std >= self.rounding_band:
            return f"noise run ({self.noise})"
        return "logit rounding"

    @property
    def logits_off(self) -> list[Position]:
        return [p for p in self.positions if not (p.logits_rel_err <= self.tol)]  # NaN is off

    @property
    def verdict(self) -> str:
        """agree | near-ties (every flip inside the band) | divergent (a flip outside it, or logits off)."""
        self.classify()
        if any(p.label in ("divergence", "logits off") for p in self.positions):
            return "divergent"
        return "near-ties" if any(p.label == "near-tie" for p in self.positions) else "agree"

    def classify(self) -> None:
        band = self.band
        for p in self.positions:
            off = not (p.logits_rel_err <= self.tol)
            if p.agree:
                p.label = "logits off" if off else ""
            else:
                p.label = "near-tie" if p.ref_margin <= band and not off else "divergence"

    def summary(self) -> dict:
        self.classify()
        dis = [p for p in self.positions if not p.agree]
        return {
            "ref": self.ref, "test": self.test, "positions": self.n, "agreement": self.agreement,
            "verdict": self.verdict, "first_disagreement": self.first_disagreement, "delta_mean": self.delta_mean,
            "delta_std": self.delta_std, "k": self.k, "noise_band": self.band, "band_source": self.band_source,
            "rounding_band": self.rounding_band, "noise_std": self.noise_std, "noise_run": self.noise,
            "tol": self.tol, "logits_off": len(self.logits_off),
            "max_logits_rel_err": max((p.logits_rel_err for p in self.positions), default=0.0),
            "near_ties": sum(p.label == "near-tie" for p in dis),
            "divergences": sum(p.label == "divergence" for p in dis),
            "disagreements": [{"pos": p.pos, "ref_token": p.ref_token, "test_token": p.test_token,
                               "ref_margin": p.ref_margin, "label": p.label} for p in dis],
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "per_position": [asdict(p) for p in self.positions]}


def top2(logits: torch.Tensor) -> tuple[int, float]:
    """[V] -> (top-1 id (first maximal), top1 - top2)."""
    lf = logits.float()
    v = torch.topk(lf, 2).values
    return int(lf.argmax()), float(v[0] - v[1])


def signed_margin(logits: torch.Tensor, token: int) -> float:
    """logits[token] - max of the others: positive iff `token` is the strict top-1."""
    lf = logits.float()
    other = torch.cat([lf[:token], lf[token + 1:]]).max()
    return float(lf[token] - other)


def measure(ref_logits: list[torch.Tensor], test_logits: list[torch.Tensor], k: float = 2.0, ref: str = "",
            test: str = "", forced: list[bool] | None = None, tol: float = DEFAULT_TOL,
            unit_roundoff: float = 2.0 ** -8, band: float | None = None) -> MarginResult:
    """Per-position logits [V] of both sides -> MarginResult (classified). `unit_roundoff` of the coarser
    compute dtype sets the rounding band; `band` (logits) replaces every measured band."""
    check_thresholds(k, tol, band)
    res = MarginResult(ref, test, k, tol=tol, unit_roundoff=unit_roundoff, user_band=band)
    for i, (lr, lt) in enumerate(zip(ref_logits, test_logits)):
        tr, mr = top2(lr)
        tt, mt = top2(lt)
        d = (lt.double() - lr.double()).norm() / lr.double().norm().clamp_min(1e-300)
        res.positions.append(Position(i, tr, tt, mr, mt, signed_margin(lt, tr) - mr, tr == tt, float(d),
                                      True if forced is None else forced[i],
                                      logits_max=float(lr.float().abs().max())))
    res.classify()
    return res


def check_thresholds(k: float, tol: float, band: float | None) -> None:
    for name, v in (("--k", k), ("--tol", tol)) + ((("--band", band),) if band is not None else ()):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} {v}: must be a finite number >= 0")


def attach_noise(res: MarginResult, ref_logits: list[torch.Tensor], noise_logits: list[torch.Tensor],
                 what: str) -> None:
    """The reference's own dtype noise: std(Δmargin) of the reference against itself in another dtype."""
    n = measure(ref_logits, noise_logits, res.k)
    res.noise_std, res.noise = n.delta_std, what
    res.classify()


@torch.inference_mode()
def decode_logits(model, prompt_ids: list[int], steps: int, force: list[int] | None = None
                  ) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill + `steps - 1` decode steps -> (`steps` logits rows [V] f32 on CPU, the fed/greedy tokens).

    Token i is `force[i]` when given (teacher forcing) else the greedy argmax of logits i.
    """
    if steps < 1:
        raise ValueError(f"--steps {steps}: must be at least 1")
    dev, T = model.device, len(prompt_ids)
    model.allocate(1, T + steps)
    out, toks = [], []
    logits, _ = model.prefill(torch.tensor([prompt_ids], device=dev))
    for i in range(steps):
        row = logits[0, -1].float().cpu()
        out.append(row)
        toks.append(int(force[i]) if force is not None else int(row.argmax()))
        if i + 1 < steps:
            logits = model.decode(torch.tensor([[toks[-1]]], device=dev), torch.tensor([T + i], device=dev))
    return out, toks


def run_margin(prompt_ids: list[int], steps: int, ref_spec: dict, test_spec: dict, load, k: float = 2.0,
               tol: float = DEFAULT_TOL, band: float | None = None, noise: bool = True
               ) -> tuple[MarginResult, list[int]]:
    """`load(spec) -> model` loads (and configures the backend for) one side. The backend is process-global,
    so it is switched before each side runs; the reference runs first and fixes the tokens. With `noise`
    (and no `band`), the reference configuration runs once more in `noise_dtype` for its own noise."""
    check_thresholds(k, tol, band)
    ref_model = load(ref_spec)
    configure_spec(ref_spec)
    ref_logits, toks = decode_logits(ref_model, prompt_ids, steps)
    del ref_model
    test_model = load(test_spec)
    configure_spec(test_spec)
    test_logits, _ = decode_logits(test_model, prompt_ids, steps, force=toks)
    del test_model
    rd, td = ref_spec.get("dtype") or "bfloat16", test_spec.get("dtype") or "bfloat16"
    u = max(UNIT_ROUNDOFF.get(rd, 2.0 ** -8), UNIT_ROUNDOFF.get(td, 2.0 ** -8))
    res = measure(ref_logits, test_logits, k, spec_str(ref_spec), spec_str(test_spec), tol=tol,
                  unit_roundoff=u, band=band)
    nd = noise_dtype(rd, td)
    if noise and band is None and nd is not None:
        nspec = {**ref_spec, "dtype": nd}
        noise_model = load(nspec)
        configure_spec(nspec)
        noise_logits, _ = decode_logits(noise_model, prompt_ids, steps, force=toks)
        attach_noise(res, ref_logits, noise_logits, spec_str(nspec))
    return res, toks


def from_dumps(path_test: str, path_ref: str, k: float = 2.0, tol: float = DEFAULT_TOL,
               band: float | None = None) -> tuple[MarginResult, list[int]]:
    """Two dumps made with --steps (the second is the reference, as in compare): the prompt's last logits
    and each step's logits. Positions after the first step whose input token differs are marked not
    teacher-forced (make the test dump with `dump --follow REF.h5` to force them). There is no noise run
    here: the band is the logits' rounding in the dumps' dtypes, or `band`."""
    from deepinfer.debug.compare import check_pairable
    from deepinfer.debug.h5schema import DumpError, DumpReader

    with DumpReader(path_test) as rt, DumpReader(path_ref) as rr:
        check_pairable(rt, rr)
        sides = []
        for r in (rt, rr):
            if "logits" not in r:
                raise DumpError(f"{r.path}: has no logits tensor")
            lg, ins = [r.tensor("logits")[-1]], []
            s = 1
            while f"step{s}.logits" in r:
                lg.append(r.tensor(f"step{s}.logits")[-1])
                ins.append(int(r.tensor(f"step{s}.input_ids").reshape(-1)[0]) if f"step{s}.input_ids" in r else -1)
                s += 1
            sides.append((lg, ins))
        (lt, it), (lr, ir) = sides
        n = min(len(lt), len(lr))
        forced, ok = [], True
        for i in range(n):  # position i's input is step i's token (i >= 1)
            if i >= 1 and it[i - 1] != ir[i - 1]:
                ok = False
            forced.append(ok)
        u = max(UNIT_ROUNDOFF.get(str(r.attrs.get("dtype", "")), 2.0 ** -8) for r in (rt, rr))
        res = measure(lr[:n], lt[:n], k, ref=f"{path_ref} ({rr.attrs.get('numerics', '')}/{rr.attrs.get('dtype', '')})",
                      test=f"{path_test} ({rt.attrs.get('numerics', '')}/{rt.attrs.get('dtype', '')})", forced=forced,
                      tol=tol, unit_roundoff=u, band=band)
        return res, [int(lr[i].argmax()) for i in range(n)]


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], marks: list[bool] | None = None) -> str:
    """One character per value scaled min..max; `marks` (disagreements) print as ✗."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    out = []
    for i, v in enumerate(values):
        if marks is not None and marks[i]:
            out.append("✗")
        else:
            out.append(SPARK[int((v - lo) / span * (len(SPARK) - 1)) if span > 0 else len(SPARK) // 2])
    return "".join(out)


def plot(res: MarginResult, path: str) -> None:
    """PNG: both margin curves (disagreements marked), and Δmargin with its mean and ±k·std band."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, works without a display
    import matplotlib.pyplot as plt

    res.classify()
    x = [p.pos for p in res.positions]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    a1.plot(x, [p.ref_margin for p in res.positions], "o-", label=f"ref {res.ref}")
    a1.plot(x, [p.test_margin for p in res.positions], "s--", label=f"test {res.test}")
    bad = [p for p in res.positions if not p.agree]
    if bad:
        a1.scatter([p.pos for p in bad], [p.ref_margin for p in bad], marker="x", s=80, color="red",
                   zorder=5, label="top-1 disagrees")
    a1.set_ylabel("top1 − top2 logit")
    a1.legend(fontsize=8)
    m, band = res.delta_mean, res.band
    a2.axhspan(m - band, m + band, color="gray", alpha=0.25, label=f"mean ± noise band ({res.band_source})")
    a2.axhline(m, color="gray", lw=1)
    a2.plot(x, [p.delta for p in res.positions], "o-", color="C2", label="Δmargin")
    a2.set_xlabel("generated position")
    a2.set_ylabel("Δmargin")
    a2.legend(fontsize=8)
    fig.suptitle(f"{res.verdict}: agreement {res.agreement:.0%}, Δmargin mean {m:+.3f} std {res.delta_std:.3f}")
    fig.tight_layout()
    import io

    from deepinfer.outpath import atomic_write

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write(path, buf.getvalue())
