"""How a run computes: the numerics mode, and for `official` which release of DeepSeek's inference code it follows.

`official` is what DeepSeek's own inference code (`inference/model.py` + its TileLang `kernel.py`) computes;
`exact` is what transformers' `DeepseekV4ForCausalLM` computes (dequantised weights, nothing simulated).

DeepSeek has published two releases of that code for DeepSeek-V4-Flash (the Pro repository's current files are
the same as Flash's current ones). They differ in two hunks, each a numerics change (docs/numerics.md):

* `kernel.py`, `act_quant_kernel`'s inplace branch. The initial release casts `T.Cast(out_dtype, T.clamp(...))`
  with `out_dtype` the input's bf16, so `act_quant(kv[..., :-rd], 64, ..., True)` returns the KV unchanged; the
  current one casts through `FP8`, so the KV no-RoPE dims and the compressed entries are rounded to e4m3 per 64
  (ue8m0 scales): the QAT the checkpoint was trained with, which our cache then holds in its FP8 layout.
* `model.py`, `MoE.__init__`: the initial release builds the shared expert without `swiglu_limit`; the current
  one clamps it as the routed experts (transformers clamps it too).

`Numerics("official")` follows the current release; `official@efc85512` the initial one. The files are known by
their sha256 (`OFFICIAL_RELEASES`): `deepinfer verify --against official` reads them before it runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUMERICS = ("official", "exact")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Release:
    """One release of DeepSeek-V4-Flash's `inference/` code: the Hugging Face revision, its files' sha256 and
    the two numerics choices that differ between releases."""

    revision: str  # the Hugging Face commit, first 12 hex digits (its first 8 name it)
    label: str
    model_sha256: str
    kernel_sha256: str
    kv_qat: bool  # act_quant(inplace=True) rounds the KV no-RoPE dims and compressed entries to e4m3 per 64
    shared_clamp: bool  # the shared expert's SwiGLU clamped at swiglu_limit

    @property
    def short(self) -> str:
        return self.revision[:8]


OFFICIAL_RELEASES = {r.short: r for r in (
    Release("60d8d70770c6", "current", "ce962f1face79d4f633d36436576214057a7e11443c9789935e1deb5c6cd1d71",
            "59b325083d7103975cba025bd0d60ea343bb82d8fff53088afb7c04bd380c0c2", kv_qat=True, shared_clamp=True),
    Release("efc855127ecb", "initial", "6380e70f3690227155ae17fa40b99c8e6900623d00925fd8a8ccc9588e02e818",
            "c4dc859a2208f9182ae00f6267cf8655deba51dcd92dfd14d0e65401658593e4", kv_qat=False, shared_clamp=False),
)}
CURRENT_RELEASE = "60d8d707"

# What changed between the releases and what each change does to a comparison (docs/numerics.md says it longer);
# `deepinfer verify --against official` prints the lines of the release it found.
RELEASE_QUIRKS = {
    "60d8d707": (
        "kernel.py's act_quant(inplace=True) rounds the KV no-RoPE dims and the compressed entries to e4m3 per 64 "
        "(ue8m0 scales); efc85512 returned them unchanged. Measured against the other release's rounding: 1.7-2.0 % "
        "on the kv projection and entries, 3.5-4.0 % on each attention output (deepinfer-tiny, H100, 2026-12-05)",
        "model.py clamps the shared expert's SwiGLU at swiglu_limit as the routed experts'; efc85512 did not (no "
        "change where |w1 x|, |w3 x| stay under the limit, as in deepinfer-tiny's MoE at its prompts: 0.000 %)",
        "the sparse attention reads the cache in bf16 (the FP8 values cast back): our FP8 layout holds the same "
        "values, so its rounding is the release's, not an extra one",
    ),
    "efc85512": (
        "kernel.py's act_quant(inplace=True) casts x / s to the input dtype (bf16) for inplace and returns the KV "
        "unchanged (0 of 28 672 elements changed, H200, 2026-12-02): official@efc85512 keeps a bf16 cache",
        "model.py builds the shared expert without swiglu_limit: official@efc85512 leaves it unclamped",
    ),
}


def release_choices() -> str:
    """The `--numerics` values, for error messages."""
    rel = ", ".join(f"official@{r.short} ({r.label}{', the default' if r.short == CURRENT_RELEASE else ''})"
                    for r in OFFICIAL_RELEASES.values())
    return f"official, {rel} or exact"


def find_release(rev: str) -> Release | None:
    """A release by a prefix of its revision (at least 7 hex digits), else None."""
    rev = rev.lower()
    if len(rev) < 7:
        return None
    hits = [r for r in OFFICIAL_RELEASES.values() if r.revision.startswith(rev) or rev.startswith(r.revision)]
    return hits[0] if len(hits) == 1 else None


def parse_numerics(text: str) -> tuple[str, str | None]:
    """`official`, `official@REV` or `exact` -> (mode, release short name or None); ValueError naming the choices."""
    mode, at, rev = (text or "").strip().partition("@")
    if mode not in NUMERICS or (at and mode != "official"):
        raise ValueError(f"{text!r}: choose {release_choices()}")
    if mode == "exact":
        return mode, None
    if not at:
        return mode, CURRENT_RELEASE
    r = find_release(rev)
    if r is None:
        raise ValueError(f"{text!r}: unknown release {rev!r} of DeepSeek's inference code; choose {release_choices()}")
    return mode, r.short


@dataclass(frozen=True)
class Numerics:
    """How a run computes: `mode` official|exact, `dtype` the activation / compute dtype, `release` the official
    release followed (short revision; None for exact, the current release by default), `kv_qat` whether the KV
    cache's no-RoPE dims and compressed entries are FP8-rounded (None: the release's choice; always False for
    exact, which keeps a float cache). An override that differs from the release shows in `name`."""

    mode: str = "official"
    dtype: torch.dtype = torch.bfloat16
    release: str | None = None
    kv_qat: bool | None = None

    def __post_init__(self):
        if self.mode not in NUMERICS:
            raise ValueError(f"numerics {self.mode!r}: choose {release_choices()}")
        if self.mode == "exact":
            if self.release is not None:
                raise ValueError("exact numerics follow transformers, not a release of DeepSeek's code")
            if self.kv_qat:
                raise ValueError("the KV QAT (kv=fp8) is official numerics'; exact numerics keep a float cache")
            object.__setattr__(self, "kv_qat", False)
            return
        rel = find_release(self.release or CURRENT_RELEASE)
        if rel is None:
            raise ValueError(f"official@{self.release}: unknown release; choose {release_choices()}")
        object.__setattr__(self, "release", rel.short)
        if self.kv_qat is None:
            object.__setattr__(self, "kv_qat", rel.kv_qat)

    @classmethod
    def parse(cls, text: str, dtype: torch.dtype = torch.bfloat16, kv_qat: bool | None = None) -> "Numerics":
        mode, rel = parse_numerics(text)
        return cls(mode, dtype, rel, kv_qat)

    @property
    def official(self) -> bool:
        return self.mode == "official"

    @property
    def official_release(self) -> Release | None:
        return OFFICIAL_RELEASES[self.release] if self.official else None

    @property
    def shared_clamp(self) -> bool:
        """Whether the shared expert's SwiGLU is clamped: the release's choice, and transformers' (exact)."""
        return self.official_release.shared_clamp if self.official else True

    @property
    def kv_form(self) -> str:
        """The KV cache's form: "fp8" (QAT, the FP8 layout) or "bf16" (kept as computed, a float cache)."""
        return "fp8" if self.kv_qat else "bf16"

    @property
    def name(self) -> str:
        """`official@60d8d707`, `exact`, or with a KV form other than the release's: `official@60d8d707+kv=bf16`."""
        if not self.official:
            return "exact"
        base = f"official@{self.release}"
        return base if self.kv_qat == self.official_release.kv_qat else f"{base}+kv={self.kv_form}"
