"""Every environment variable deepinfer reads, with its type, default and meaning: the one place they are
parsed (the README's settings table lists the same). Read at call time unless a setting says otherwise,
so a test or an A/B can change one in a fresh process or between calls.

A malformed value is an error naming the variable, never a silent default.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "flag" (0 = off, anything else on) | "choice" | "path" | "str" | "fusions" (`fusion`)
    default: str
    doc: str
    choices: tuple = ()


SETTINGS = {s.name: s for s in (
    Setting("DEEPINFER_HOME", "path", "", "where deepinfer-tiny is created (else $XDG_CACHE_HOME/deepinfer, "
            "else ~/.cache/deepinfer)"),
    Setting("DEEPINFER_BACKEND", "choice", "", "kernel backend when --backend is not given (default: triton "
            "on CUDA, else torch)", ("", "torch", "triton", "tilelang", "flaggems", "deepgemm")),
    Setting("DEEPINFER_OPS", "str", "", "per-op backends when --op is not given: op=backend,... (e.g. "
            "grouped_gemm=tilelang); ops not named run on the backend"),
    Setting("DEEPINFER_STRICT", "flag", "0", "any op without a kernel in the backend is an error (--strict)"),
    Setting("DEEPINFER_DEBUG", "flag", "0", "tracebacks instead of one-line errors (--debug)"),
    Setting("DEEPINFER_BRANCHES", "flag", "1", "decode issues independent work on side streams (CUDA); 0: "
            "everything on one stream"),
    Setting("DEEPINFER_KV_QAT", "flag", "", "deprecated (one warning line): 1 / 0 set official numerics' KV form as "
            "a SPEC's kv=fp8 / kv=bf16; unset, the release decides it (60d8d707: the no-RoPE dims and compressed "
            "entries FP8-rounded per 64, an FP8 cache; efc85512: bf16; docs/numerics.md)"),
    Setting("DEEPINFER_PREFILL_GRAPHS", "flag", "0", "prefill chunks of 256, 512, ... 8192 tokens (one row) replay "
            "as CUDA graphs per (length, start) where the decode step runs as graphs (opt-in: each captured key holds "
            "its outputs, and the graphs' pool holds a prefill's temporaries)"),
    Setting("DEEPINFER_POLICY", "choice", "official", "the numerics policy: official (kernels that accumulate as "
            "the official ones) or fast (prefill FP8 sums promoted to fp32 once per 128-K block: DEEPINFER_FP8_GEMM "
            "and DEEPINFER_TL_FP4 default to auto and fold where they are unset; cuBLASLt, FlagGems and DeepGEMM "
            "kernels allowed); a tuned op map (`--op @MAP`) must have been measured under the run's policy",
            ("official", "fast")),
    Setting("DEEPINFER_PDL", "flag", "1", "Triton launches use programmatic dependent launch on sm_90+; read "
            "when deepinfer_kernels.triton is imported"),
    Setting("DEEPINFER_FP8_GEMM", "choice", "exact", "prefill-sized FP8 GEMMs: exact (the Triton kernel, fp32 "
            "accumulation of exact products, as the official fp8_gemm: its outputs), exact-wgmma (the same exact products "
            "on f16 wgmma where the TMA prefill kernel runs, sm_90+; elsewhere exact's kernel; opt-in until "
            "measured), auto (sm_90: cuBLASLt's "
            "block-scaled GEMM, ~10 % faster prefill, fp32 promotion per 128-K block: ~7 % of outputs one bf16 ulp "
            "off the official kernel's), cublas (cuBLASLt on any CUDA GPU that has it), triton (the Triton kernel, "
            "promotion per 128-K block)", ("exact", "exact-wgmma", "auto", "cublas", "triton")),
    Setting("DEEPINFER_FP4_ASM", "flag", "1", "the FP4 expert GEMM's inline-PTX FP4 decode on sm_90 "
            "(0: the portable Triton decode)"),
    Setting("DEEPINFER_FP4_ONE_DOT", "flag", "0", "experimental, untimed: the prefill FP4 expert GEMM (Triton) "
            "multiplies each 128-K step as one dot of the decoded [64, 128] weight tile (low and high nibbles "
            "joined in registers) with its same bits, so no wgmma wait splits the step, at <= 168 registers "
            "(three programs an SM); 0: two chained dots, the shipped form"),
    Setting("DEEPINFER_ATTN_PREFILL_BK", "choice", "32", "experimental, untimed: kv slots per step of the Triton "
            "sparse attention at prefill (>= 256 query tokens, bf16 operands): 32 (the shipped tiles), or 64, "
            "the official kernel's block, so its running max and bf16 P round as the official one's (fewer "
            "instructions a slot, 88 B of spill at 64 heads x 512 dims offline)", ("32", "64")),
    Setting("DEEPINFER_TL_FP4", "choice", "bf16", "the TileLang backend's FP4 expert GEMM: bf16 (weights decoded "
            "to exact bf16 tiles, fp32 accumulation over the whole K in the tensor core), fold (the folded FP8 form at "
            "64- and 128-row blocks -- a 128-K block's four per-32 scales folded into one, e4m3 tiles, one FP8 MMA per "
            "128-K step promoted in fp32, a hand-written warp-specialised pipeline where N % 128 == 0 -- where every "
            "block's scales lie within 2^11, else bf16) or fp8 (kernel.py's "
            "fp4_gemm form: e4m3 tiles, one FP8 MMA per 32-K step, scales applied in fp32)", ("bf16", "fold", "fp8")),
    Setting("DEEPINFER_TL_ATTN", "choice", "ws", "the TileLang backend's bf16 sparse attention: ws "
            "(warp-specialised: a scorer warpgroup computes Q Kᵀ and the softmax while two warpgroups accumulate P V "
            "over the halves of D and gather the kv rows ahead by cp.async, 64 heads a program, only the 64-slot blocks "
            "that hold a valid slot, where D is 128, 256 or 512) or plain (one warpgroup gathers, then computes every "
            "block)", ("ws", "plain")),
    Setting("DEEPINFER_DECODE_FUSIONS", "fusions", "on", "on: the Triton kernels of the fused decode ops (the "
            "routed w2 computing its SwiGLU input, the q-norming attention, the post-mixes inside the next mix, the kv "
            "norm with its cache write, a step's position tables in one launch) fuse; off: each runs its two ops (the same values); "
            "-OP[+OP...] (e.g. -q_norm_sparse_attn_fp8): every one but those fuses. For an A/B in one run: "
            "`bench --against triton:DEEPINFER_DECODE_FUSIONS=off`"),
    Setting("TRITON_INTERPRET", "flag", "0", "Triton's own: run Triton kernels in its CPU interpreter; read "
            "by Triton when a kernel module is imported"),
)}


FAST_DEFAULTS = {"DEEPINFER_FP8_GEMM": "auto", "DEEPINFER_TL_FP4": "fold"}
"""The defaults DEEPINFER_POLICY=fast changes, where the variable itself is unset (a value set wins): the prefill's
FP8 GEMMs and the TileLang FP4 expert GEMM promote their tensor-core sums once per 128-K block, DeepGEMM's scheme,
instead of after every MMA as the official kernels. Both are read per call, so a policy applied around one
configuration (`deepinfer bench --against SPEC,policy=fast`) takes effect there. Decode-sized calls are the same
under either policy."""

PER_CALL = ("DEEPINFER_POLICY", "DEEPINFER_FP8_GEMM", "DEEPINFER_FP4_ONE_DOT", "DEEPINFER_ATTN_PREFILL_BK",
            "DEEPINFER_TL_FP4", "DEEPINFER_TL_ATTN", "DEEPINFER_DECODE_FUSIONS")
"""Settings the kernels read at each call (not at import): the ones a configuration may set around its own calls."""


def _raw(name: str) -> str:
    s = SETTINGS[name]
    if name in os.environ:
        return os.environ[name].strip()
    if name in FAST_DEFAULTS and os.environ.get("DEEPINFER_POLICY", "").strip().lower() == "fast":
        return FAST_DEFAULTS[name]
    return s.default


@contextlib.contextmanager
def applied(values: dict):
    """Set these settings (names of PER_CALL -> values, each checked as `check` does) for the block, and put the
    environment back as it was afterwards, also on an error."""
    for n in values:
        if n not in PER_CALL:
            raise ValueError(f"{n}: not a setting read per call; these are: {', '.join(PER_CALL)}")
    checked = {n: check(n, v) for n, v in values.items()}  # every value, before the environment changes
    before = {n: os.environ.get(n) for n in values}
    try:
        for n, v in checked.items():
            os.environ[n] = v
        yield
    finally:
        for n, v in before.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def is_set(name: str) -> bool:
    """Whether the variable is in the environment at all (a deprecated alias acts only where it is)."""
    return name in SETTINGS and name in os.environ


def flag(name: str) -> bool:
    """A flag: unset -> its default; "0" or "" -> off; "1" (or any other non-zero number) -> on."""
    v = _raw(name)
    if v in ("", "0"):
        return False
    if v.lower() in ("1", "true", "yes", "on") or v.isdigit():
        return True
    if v.lower() in ("false", "no", "off"):
        return False
    raise ValueError(f"{name}={v!r}: expected 0 or 1")


def check(name: str, v) -> str:
    """`v` as setting `name` would read it (a choice lower-cased), or a ValueError naming what is wrong."""
    s, v = SETTINGS[name], str(v).strip()
    if s.kind == "choice":
        if v.lower() not in s.choices:
            raise ValueError(f"{name}={v!r}: choose one of {', '.join(c for c in s.choices if c) or '(unset)'}")
        return v.lower()
    if s.kind == "fusions":
        _fusions_off(v)
        return v.lower()
    return v


def value(name: str) -> str:
    """A choice or fusions setting's value as read now (checked): what a report records as in effect."""
    return check(name, _raw(name))


def choice(name: str) -> str:
    """A choice setting's value, lower-cased and checked (`check`)."""
    assert SETTINGS[name].kind == "choice", f"{name} is not a choice setting"
    return check(name, _raw(name))


FUSED_DECODE_OPS = ("swiglu_grouped_gemm", "q_norm_sparse_attn_fp8", "hc_post_pre_quant",
                    "moe_combine_post_pre_quant", "moe_combine_post_head", "rms_norm_rope_store",
                    "decode_tables")
"""The registered decode ops whose Triton kernel fuses two ops' work, each switchable by DEEPINFER_DECODE_FUSIONS
(decode_tables: the model makes a step's position tables in one op up front, instead of each on first use)."""


def fusions_off() -> frozenset:
    """The fused decode ops DEEPINFER_DECODE_FUSIONS turns off: none (on), all (off), or the ones after "-" joined
    by "+" (a value without commas, so that it fits a `--against` entry)."""
    return _fusions_off(_raw("DEEPINFER_DECODE_FUSIONS"))


def _fusions_off(v: str) -> frozenset:
    v = v.strip().lower()
    if v == "on":
        return frozenset()
    if v == "off":
        return frozenset(FUSED_DECODE_OPS)
    names = [n.strip() for n in v[1:].split("+")] if v.startswith("-") else []
    bad = [repr(n) for n in names if n not in FUSED_DECODE_OPS]
    if not names or bad:
        raise ValueError(f"DEEPINFER_DECODE_FUSIONS={v!r}: expected on, off or -OP[+OP...] with OP one of "
                         f"{', '.join(FUSED_DECODE_OPS)}" + (f" (not {', '.join(bad)})" if bad else ""))
    return frozenset(names)


def fusion(op: str) -> bool:
    """Does the fused decode op `op` (one of FUSED_DECODE_OPS) fuse under DEEPINFER_DECODE_FUSIONS, read now."""
    assert op in FUSED_DECODE_OPS, f"{op}: not a fused decode op"
    return op not in fusions_off()


def path(name: str) -> str:
    return _raw(name)


def triton_interpreted() -> bool:
    """Is this process running Triton kernels in the CPU interpreter (TRITON_INTERPRET set and non-zero)?"""
    return flag("TRITON_INTERPRET")


def check_environment() -> list[str]:
    """Every DEEPINFER_* variable in the environment, checked when a command starts rather than when (or whether)
    a kernel reads it: a setting's value that its reader would refuse (a flag not 0 / 1, a choice outside its
    choices, a fusions list naming no fused op) raises that reader's ValueError, naming the variable. An unknown
    DEEPINFER_* name is not an error (an old script's variable does no harm) but would be ignored in silence, a
    typo included: it comes back as a warning line, with the closest setting's name where one is close."""
    warnings = []
    for name in sorted(n for n in os.environ if n.startswith("DEEPINFER_")):
        s = SETTINGS.get(name)
        if s is None:
            # matched without the shared prefix, which alone would make every name look close
            p = len("DEEPINFER_")
            close = difflib.get_close_matches(name[p:], [n[p:] for n in SETTINGS if n.startswith("DEEPINFER_")], 1)
            warnings.append(f"{name} is not a deepinfer setting and is ignored"
                            + (f" (did you mean DEEPINFER_{close[0]}?)" if close else ""))
        elif s.kind == "flag":
            flag(name)
        elif s.kind in ("choice", "fusions"):
            check(name, os.environ[name])
    return warnings


KERNEL_SETTINGS = ("DEEPINFER_POLICY", "DEEPINFER_FP8_GEMM", "DEEPINFER_FP4_ASM", "DEEPINFER_FP4_ONE_DOT",
                   "DEEPINFER_ATTN_PREFILL_BK", "DEEPINFER_TL_FP4", "DEEPINFER_TL_ATTN", "DEEPINFER_DECODE_FUSIONS",
                   "DEEPINFER_PDL", "DEEPINFER_BRANCHES")
"""Settings that choose among kernels, streams and launch modes: on the torch reference on a CPU they change
nothing (the reference computes the same numbers under either policy)."""


def unused_on_the_reference() -> list[str]:
    """The KERNEL_SETTINGS set in the environment to other than their defaults, as "NAME=value": what a run of
    only the torch reference on a CPU would ignore (`deepinfer_cli.common.setup` says so in one line)."""
    out = []
    for name in KERNEL_SETTINGS:
        v = os.environ.get(name)
        if v is not None and v.strip() and v.strip().lower() != SETTINGS[name].default:
            out.append(f"{name}={v.strip()}")
    return out


def snapshot() -> str:
    """The settings this process has set in its environment, "NAME=value" joined by spaces (dump fingerprints:
    what produced these numbers)."""
    return " ".join(f"{n}={os.environ[n].strip()}" for n in SETTINGS if n in os.environ)
