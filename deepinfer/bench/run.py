"""`deepinfer bench`: measured prefill / decode speed against floors computed from the model's bytes and FLOPs.

What is measured (on the chosen device, in this process):

* TTFT: one prefill of a `prompt_len`-token prompt into cache row 0 (this engine prefills per prompt, so
  time to first token = one prefill + LM head), median of 3 after one warm-up call; prefill tokens/s.
* decode: for each batch size B, B rows are prefilled, then `gen_len` steps of
  `model.decode(ids [B, 1], positions [B], rows)` run back to back (2 warm-up steps first), timed with
  perf_counter between device synchronisations: ms/step and B*1000/ms tokens/s; peak device memory.
* guided decoding (`--guided`): per batch size, the step as the scheduler runs it (decode, then sample +
  logprobs + the tokens back to the host) without a mask, with the mask path and all-ones masks (host
  fill, pinned copy, `apply_token_bitmask`), and with an xgrammar JSON-grammar matcher per row (the host
  fill overlapping the decode step on CUDA): ms/step of each, the overheads, and the host fill time.
* peers in the same run (`--against triton`, `--against triton:sparse_attn_fp8=tilelang,...`): the same
  model, prompts, floors and batch sizes timed again with each other backend (and per-op map), TTFT and
  decode rows with their ratio to the main configuration's. A library backend alone (`--against deepgemm`) is
  its ops over the main configuration (registry.LIBRARY_BACKENDS), not every other op on the reference. An
  entry may also set the settings read per call around its own calls (`policy=fast`, `DEEPINFER_TL_FP4=fold`:
  `settings.PER_CALL`), and each entry's drift from the main configuration on the timed prompt is reported
  beside its times (`deepinfer.bench.drift`): what its speed costs in agreement.
* the device: copy bandwidth and dense matmul rate (`deepinfer.bench.rates`). Floors use these measured
  numbers, not specs.

Each row is held against its floor (`deepinfer.bench.floor`: bytes / bandwidth and FLOPs / matmul rate);
`--peer transformers` times transformers on the same weights and prompts (`deepinfer.bench.peer`).
This module runs the measurements and assembles the JSON-able report.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field

import torch

from deepinfer import settings
from deepinfer.bench.drift import drift, drift_logits
from deepinfer.bench.floor import floors, held_bytes, model_bytes
from deepinfer.bench.rates import measure_bandwidth, measure_fp8_matmul, measure_matmul, sync
from deepinfer.bench.timing import (GUIDED_MODES, count_decode_ops, count_prefill_ops, profile_decode, time_decode,
                                    time_guided, time_prefill)
from deepinfer.config import ModelConfig
from deepinfer.engine.loader import build_model
from deepinfer.engine.memory import check_model_fits
from deepinfer.model.transformer import Transformer
from deepinfer.ops import ops
from deepinfer.ops.registry import (LIBRARY_BACKENDS, BackendError, Dispatcher, backend_facts, library_op_map,
                                     op_map_str)
from deepinfer.quant.kv_layout import kv_packed_width



@dataclass
class BenchOptions:
    """Everything `run_bench` needs; the CLI fills it from its options."""

    preset: str | None = None
    model: str | None = None
    batches: tuple = (1, 8, 32, 64)
    prompt_len: int = 128
    gen_len: int = 32
    backend: str | None = None
    strict: bool = False
    op_map: str | None = None  # --op: per-op backends (None: DEEPINFER_OPS)
    numerics: str = "official"
    dtype: str = "bfloat16"
    device: str | None = None
    seed: int = 0
    peer: str | None = None
    eager: bool = False
    prefill_graphs: bool = False  # also time the prefill replayed as a CUDA graph (`engine.prefill_runner`)
    progress: bool = True
    profile: bool = False
    guided: bool = False
    speculate: int = 0  # > 0: also time speculative steps of K MTP drafts per batch size (`spec_bench`)
    against: tuple = ()  # --against: other configurations ("triton", "triton:op=b,...") timed in the same run
    notes: list = field(default_factory=list)


def device_name(device: torch.device) -> str:
    """The report's device line: the GPU's name, or the CPU's with its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} threads)"


# --------------------------------------------------------------------------- building the model


def build(opts: BenchOptions, device: torch.device, numerics) -> tuple[ModelConfig, Transformer, dict, str, float]:
    """(cfg, model, official-format state, source description, seconds to make the weights)."""
    t0 = time.perf_counter()
    if opts.model:
        from deepinfer.engine.loader import load_checkpoint

        cfg, state, model_dir, _ = load_checkpoint(opts.model, device, opts.progress, numerics=numerics)
        source = f"checkpoint {model_dir}"
    else:
        from deepinfer.engine.random_weights import random_state
        from deepinfer.presets import preset_config

        cfg = preset_config(opts.preset or "tiny")
        check_model_fits(cfg, numerics, device, f"--preset {opts.preset or 'tiny'}")
        state = random_state(cfg, device, opts.seed)
        source = f"preset {opts.preset or 'tiny'} (random weights, seed {opts.seed})"
    sync(device)
    t_weights = time.perf_counter() - t0
    model = build_model(cfg, state, numerics, device)  # as the loader builds it
    return cfg, model, state, source, t_weights


# --------------------------------------------------------------------------- the whole run


def _versions() -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = None
    return {"torch": torch.__version__, "triton": tv}


def _fp8_prefill_gemm(device: torch.device) -> str | None:
    """What ran the prefill-sized FP8 GEMMs (`fp8_gemm`, M >= 65) of the Triton backend: "cublaslt" or
    "triton: <why not cuBLASLt>"; None for other backends."""
    return backend_facts(ops.backend, device).get("fp8_prefill_gemm")


def parse_against(spec: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """An `--against` entry: `triton`, `triton:grouped_gemm=tilelang,...`, with settings among the entries
    (`triton:grouped_gemm=tilelang,policy=fast,DEEPINFER_TL_ATTN=plain`: `policy` is DEEPINFER_POLICY) and the
    routed experts' form (`experts=fp8`: requantised per 128 x 128 block for this entry, DeepGEMM's form) ->
    (backend, op map, settings, with "experts" among them where given). An unknown backend or op, a setting not
    read per call (`settings.PER_CALL`) or a bad value is a ValueError naming the valid ones."""
    from deepinfer.ops.registry import BACKENDS, parse_op_map

    from deepinfer.quant.requant import EXPERT_FORMS

    backend, _, rest = (x.strip() for x in spec.partition(":"))
    if backend not in BACKENDS:
        raise ValueError(f"--against {spec!r}: unknown backend {backend!r}; backends: {', '.join(BACKENDS)}")
    op_parts, values = [], {}
    parts = [rest] if rest.startswith("@") and "," not in rest else [p.strip() for p in rest.split(",")]
    for part in filter(None, parts):
        key, eq, val = (x.strip() for x in part.partition("="))
        if key.lower() == "experts":  # the routed experts' form for this entry (`deepinfer.engine.expert_form`)
            if val.lower() not in EXPERT_FORMS:
                raise ValueError(f"--against {spec!r}: {part!r}: choose experts={'|'.join(EXPERT_FORMS)}")
            values["experts"] = val.lower()
            continue
        name = "DEEPINFER_POLICY" if key == "policy" else key
        if not name.startswith("DEEPINFER_"):
            op_parts.append(part)
            continue
        if name not in settings.PER_CALL:
            raise ValueError(f"--against {spec!r}: {name} is not a setting read per call; an entry may set "
                             f"policy=official|fast, {', '.join(n for n in settings.PER_CALL if n != 'DEEPINFER_POLICY')}")
        choices = settings.SETTINGS[name].choices
        try:
            if not eq:
                raise ValueError(f"give {key}=VALUE")
            values[name] = settings.check(name, val)
        except ValueError as e:
            hint = f"choose {key}={'|'.join(c for c in choices if c)}" if choices else str(e)
            raise ValueError(f"--against {spec!r}: {part!r}: {hint}") from None
    per_call = {n: v for n, v in values.items() if n != "experts"}
    with settings.applied(per_call):  # a tuned map is checked against the entry's own policy, not the run's
        op_map = parse_op_map(",".join(op_parts), f"--against {spec!r}:")
    return backend, op_map, values


def peer_configs(opts: BenchOptions) -> list[tuple[str, str, dict, dict]]:
    """The `--against` entries as (spec, backend, op map, settings). A library backend named without ops
    (`deepgemm`, `deepgemm:policy=fast`) is its ops over the run's own backend and op map; a bad entry is an
    OptionError naming it."""
    from deepinfer.engine.loader import OptionError

    peers = []
    for spec in opts.against:
        try:
            backend, op_map, values = parse_against(spec)
            if backend in LIBRARY_BACKENDS and not op_map:
                main = Dispatcher().configure(opts.backend or None, False, opts.op_map)
                backend, op_map = main.backend, {**main.op_map, **library_op_map(backend)}
            peers.append((spec, backend, op_map, values))
        except (ValueError, BackendError) as e:
            raise OptionError(str(e)) from None
    return peers


def _graphs(device: torch.device, opts: BenchOptions, backend: str) -> bool:
    """Decode as CUDA graphs: CUDA, a kernel backend (the torch reference MoE syncs with the host), no --eager."""
    return device.type == "cuda" and not opts.eager and backend != "torch"


def time_against(model: Transformer, cfg: ModelConfig, opts: BenchOptions, spec: str, backend: str,
                 op_map: dict[str, str], main: dict, device, batches: list[int], log, values: dict | None = None,
                 main_logits: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """Prefill and decode timed again with `backend`, `op_map` and the settings `values` (the `--against` entry
    `spec`), against the same floors as the main rows (`main`: the report so far) -> {spec, backend, op_map,
    settings, fallbacks, prefill, drift, decode_drift, decode}; the dispatch is left on it (the caller restores the
    main one), the settings are put back. drift / decode_drift: against `main_logits` (the main configuration's
    `drift_logits`; `deepinfer.bench.drift`), where given."""
    from deepinfer.engine.expert_form import held_as
    from deepinfer.quant.requant import summary as requant_summary

    values = dict(values or {})
    form = values.pop("experts", None)
    with settings.applied(values), held_as(model, form or "fp4", log) as reports:
        out = _time_against(model, cfg, opts, spec, backend, op_map, main, device, batches, log, values,
                            main_logits)
    if form:
        out["experts"], out["requant"] = form, requant_summary(reports)
    return out


def _time_against(model, cfg, opts, spec, backend, op_map, main, device, batches, log, values, main_logits) -> dict:
    ops.configure(backend, opts.strict if opts.strict else None, op_map)
    graphs = _graphs(device, opts, backend)
    log(f"against {spec}: prefill 1 x {opts.prompt_len} tokens ...")
    model.allocate(1, opts.prompt_len + 1)
    pf = time_prefill(model, cfg, opts.prompt_len, device, opts.seed)
    dr = ddr = None
    if main_logits is not None:
        prompt, step_logits = drift_logits(model, cfg, opts.prompt_len, device, opts.seed)
        dr, ddr = drift(prompt, main_logits[0]), drift(step_logits, main_logits[1])
    floor_pf = main["prefill"]["floor"]["floor_ms"]
    pf.update(ratio=pf["ttft_ms"] / floor_pf, vs_main=pf["ttft_ms"] / main["prefill"]["ttft_ms"])
    pf_graphs = _prefill_graphs(model, cfg, opts, device, graphs, {**pf, "floor": main["prefill"]["floor"]}, log) \
        if opts.prefill_graphs else None
    time_decode(model, cfg, batches[0], min(opts.prompt_len, 16), 2, device, opts.seed, graphs=False)  # compiles
    rows = []
    main_dec = {d["batch"]: d for d in main["decode"]}
    for B in batches:
        log(f"against {spec}: decode batch {B} ...")
        d = time_decode(model, cfg, B, opts.prompt_len, opts.gen_len, device, opts.seed, graphs=graphs)
        m = main_dec[B]
        d.update(ratio=d["ms_per_step"] / m["floor"]["floor_ms"], vs_main=d["ms_per_step"] / m["ms_per_step"])
        rows.append(d)
    return {"spec": spec, "backend": backend, "op_map": op_map_str(op_map), "settings": dict(values),
            "settings_in_effect": {n: settings.value(n) for n in settings.PER_CALL},
            "fp8_prefill_gemm": _fp8_prefill_gemm(device), "fallbacks": sorted(ops.fallbacks),
            "prefill": pf, "drift": dr, "decode_drift": ddr, "prefill_graphs": pf_graphs, "decode": rows}


def _prefill_graphs(model, cfg, opts: BenchOptions, device, graphs: bool, eager: dict, log) -> dict:
    """The prefill replayed as a CUDA graph, against the eager row `eager` (its floor) of the same configuration;
    {"skipped": why} where decode graphs are off (not CUDA, the torch reference, --eager)."""
    if not graphs:
        return {"skipped": "prefill graphs need CUDA, a kernel backend and no --eager"}
    log(f"prefill as a CUDA graph: 1 x {opts.prompt_len} tokens ...")
    g = time_prefill(model, cfg, opts.prompt_len, device, opts.seed, graphs=True)
    g.update(ratio=g["ttft_ms"] / eager["floor"]["floor_ms"], vs_eager=g["ttft_ms"] / eager["ttft_ms"])
    return g


def check_expert_forms(model: Transformer, cfg: ModelConfig, opts: BenchOptions, peers, numerics, batches,
                       device) -> None:
    """Refuse (MemoryRefused, with the numbers) an `experts=fp8` entry whose FP8 expert stacks, held beside the
    FP4 ones while it runs (`engine.expert_form.held_as`), would not fit with the largest decode batch's caches,
    before anything is timed: otherwise the main rows would be measured and then lost to an out-of-memory error."""
    from deepinfer.bench.workload import WARMUP_STEPS
    from deepinfer.engine.expert_form import fp8_bytes
    from deepinfer.engine.loader import OptionError
    from deepinfer.engine.memory import MemoryRefused, available_bytes, cache_bytes, fmt_bytes

    specs = [spec for spec, *_, values in peers if values.get("experts") == "fp8"]
    if not specs:
        return
    extra = fp8_bytes(model)
    if not extra:
        raise OptionError(f"--against {specs[0]}: this model holds no FP4 routed experts to requantise "
                          f"({numerics.name} numerics; exact numerics dequantise them at load): experts=fp8 applies "
                          "to official numerics")

    def grouped_on_deepgemm(backend: str, op_map: dict) -> bool:
        g = op_map.get("grouped_gemm", backend)
        return "deepgemm" in (set(g.values()) if isinstance(g, dict) else {g})

    # DeepGEMM keeps its own per-128 FP8 copy of each FP4 expert stack it ran (`deepgemm._common.requantised`), for
    # the rest of the process: an entry sending grouped_gemm there holds that much more by the time this one runs
    if any(grouped_on_deepgemm(b, m) for _, b, m, _ in peers):
        extra *= 2
    caches = cache_bytes(cfg, max(batches) + 1, opts.prompt_len + WARMUP_STEPS + opts.gen_len + 1, numerics.dtype,
                         numerics.official)
    have = available_bytes(device)
    if extra + caches > 0.9 * have:
        raise MemoryRefused(f"--against {specs[0]}: the experts' per-128 FP8 form needs {fmt_bytes(extra)} beside "
                            f"the FP4 one, with {fmt_bytes(caches)} of caches, but {fmt_bytes(have)} is available on "
                            f"{device}: a smaller preset, fewer or smaller batches, or leave experts=fp8 out")


class BenchCutOff(Exception):
    """Raised into a running bench (the CLI raises it on SIGTERM, as `timeout` sends): the measurements stop and
    the report holds what finished, with "cut_off" naming the step that was running."""


def run_bench(opts: BenchOptions, log=lambda msg: None) -> dict:
    """Run every measurement of `deepinfer bench`; returns the JSON-able report. A BenchCutOff raised during the
    measurements returns the report so far, with "cut_off": the step it stopped in (the last `log` message)."""
    partial: dict = {"step": "set-up"}  # the report once it exists, and the step running (the last log line)

    def logged(msg: str) -> None:
        partial["step"] = msg
        log(msg)

    try:
        return _run_bench(opts, logged, partial)
    except BenchCutOff as e:
        if "report" not in partial:  # cut off before any measurement: nothing to report
            raise
        partial["report"]["cut_off"] = f"{e or 'cut off'} during: {partial['step']}"
        return partial["report"]


def _check_run_fits(cfg: ModelConfig, opts: BenchOptions, batches: list[int], numerics, device) -> None:
    """Refuse (OptionError, with the numbers) a run past the model's context, or whose weights plus the caches of
    its largest batch cannot fit in the memory `device` has free, before anything is built or measured."""
    from deepinfer.bench.workload import WARMUP_STEPS
    from deepinfer.engine.loader import OptionError
    from deepinfer.engine.memory import available_bytes, cache_bytes, fmt_bytes, model_build_bytes

    positions = opts.prompt_len + WARMUP_STEPS + max(opts.gen_len, opts.speculate + 1) + 4  # decode's allocation
    if positions > cfg.max_position_embeddings:
        raise OptionError(f"--prompt-len {opts.prompt_len} and --gen-len {opts.gen_len}: {positions} positions with "
                          f"the warm-up exceed the model's context of {cfg.max_position_embeddings}")
    check_model_fits(cfg, numerics, device, f"--preset {opts.preset or 'tiny'}")  # the model alone, named so first
    B = max(batches)
    loaded, own = model_build_bytes(cfg, numerics.official, numerics.dtype, None)
    caches = cache_bytes(cfg, B + 1, positions, numerics.dtype, numerics.official)
    have = available_bytes(device)
    if loaded + own + caches > 0.9 * have:
        raise OptionError(f"--batch {B} at --prompt-len {opts.prompt_len}: the model ({fmt_bytes(loaded + own)}) and "
                          f"the caches of {B + 1} rows of {positions} positions ({fmt_bytes(caches)}) need "
                          f"{fmt_bytes(loaded + own + caches)}, but {fmt_bytes(have)} is available on {device}")


def _run_bench(opts: BenchOptions, log, partial: dict) -> dict:
    from deepinfer.engine.loader import OptionError, resolve_device, resolve_numerics

    device = resolve_device(opts.device)
    numerics = resolve_numerics(opts.numerics, opts.dtype)
    batches = sorted(set(int(b) for b in opts.batches))
    if not batches or batches[0] < 1:
        raise OptionError(f"--batch {opts.batches}: batch sizes must be >= 1")
    if opts.prompt_len < 1 or opts.gen_len < 1:
        raise OptionError("--prompt-len and --gen-len must be >= 1")
    if opts.peer not in (None, "", "transformers"):
        raise OptionError(f"--peer {opts.peer!r}: only 'transformers' is supported")
    if opts.speculate < 0:
        raise OptionError(f"--speculate {opts.speculate}: must be at least 1 (draft tokens per step)")
    peers = peer_configs(opts)
    for _, backend, op_map, _ in peers:  # importable and complete enough before anything is built
        ops.configure(backend, opts.strict if opts.strict else None, op_map)
        ops.check_device(device, opts.dtype, "--against")
    ops.configure(opts.backend or None, opts.strict if opts.strict else None, opts.op_map)
    ops.check_device(device, opts.dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mem0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    graphs = _graphs(device, opts, ops.backend)
    if not opts.model:  # a bad --preset, or a run it cannot hold, is refused before the first progress line
        from deepinfer.presets import preset_config

        _check_run_fits(preset_config(opts.preset or "tiny"), opts, batches, numerics, device)
    log(f"building the model on {device} ...")
    cfg, model, state, source, t_weights = build(opts, device, numerics)
    if opts.speculate:
        from deepinfer.engine.speculative import check_speculate

        try:
            check_speculate(model, opts.speculate)
        except ValueError as e:
            raise OptionError(str(e)) from None
    if opts.peer != "transformers":
        state = None  # the model holds what it uses; the stacked experts are its own copies, so this frees them
    check_expert_forms(model, cfg, opts, peers, numerics, batches, device)
    held = (torch.cuda.memory_allocated(device) - mem0) if device.type == "cuda" else None
    mb = model_bytes(cfg, model)
    log("measuring device bandwidth and matmul rate ...")
    bw = measure_bandwidth(device)
    rate, rate_what = measure_matmul(device)
    fp8_rate = measure_fp8_matmul(device)
    cache_elem = torch.empty((), dtype=numerics.dtype).element_size()
    kv_entry = kv_packed_width(cfg.head_dim, cfg.rope_head_dim, numerics.dtype) if model.attentions()[0].fp8_kv else None

    report = {
        "model": cfg.name, "source": source, "config_fingerprint": cfg.fingerprint(), "device": str(device),
        "device_name": device_name(device), **_versions(), "backend": ops.backend,
        "op_map": op_map_str(ops.op_map), "numerics": numerics.name,
        "settings": {n: settings.value(n) for n in settings.PER_CALL},  # as the main rows ran (policy and its defaults)
        "dtype": opts.dtype, "eager": not graphs, "cuda_graphs": graphs,
        "layers": cfg.n_layers, "attn_kinds": list(cfg.attn_kinds[:cfg.n_layers]),
        "weights_s": t_weights, "engine_weight_bytes": held_bytes(model),
        "device_bytes_after_build": held,
        "checkpoint_bytes_main": sum(mb.ckpt_dense) + sum(mb.ckpt_expert) * cfg.n_routed_experts + mb.ckpt_head,
        "bandwidth_Bps": bw, "matmul_flops": rate, "matmul_measured": rate_what, "matmul_fp8_flops": fp8_rate,
        "prompt_len": opts.prompt_len, "gen_len": opts.gen_len,
    }
    partial["report"] = report  # what run_bench returns if the measurements are cut off
    log(f"prefill: 1 x {opts.prompt_len} tokens ...")
    model.allocate(1, opts.prompt_len + 1)
    pf = time_prefill(model, cfg, opts.prompt_len, device, opts.seed)
    pf["floor"] = floors(cfg, mb, list(range(opts.prompt_len)), bw, rate, cache_elem, head_tokens=1,
                         kv_entry_bytes=kv_entry)
    pf["ratio"] = pf["ttft_ms"] / pf["floor"]["floor_ms"]
    report["prefill"] = pf
    if opts.prefill_graphs:
        report["prefill_graphs"] = _prefill_graphs(model, cfg, opts, device, graphs, pf, log)

    report["decode"] = []
    # one untimed decode of the first batch size: first-call costs (allocator growth, thread pools, the
    # CPU reference's weight working copies, compiles) must not land in the first row's ms/step
    time_decode(model, cfg, batches[0], min(opts.prompt_len, 16), 2, device, opts.seed, graphs=False)
    for B in batches:
        log(f"decode: batch {B}, {opts.gen_len} steps ...")
        d = time_decode(model, cfg, B, opts.prompt_len, opts.gen_len, device, opts.seed, graphs=graphs)
        if d["graph_error"]:
            log(f"CUDA graph capture failed, timed eagerly: {d['graph_error']}")
        d["floor"] = floors(cfg, mb, [round(d["mean_position"])] * B, bw, rate, cache_elem,
                                kv_entry_bytes=kv_entry)
        d["ratio"] = d["ms_per_step"] / d["floor"]["floor_ms"]
        d["ratio_engine_bytes"] = d["ms_per_step"] / d["floor"]["floor_engine_ms"]
        report["decode"].append(d)
    if peers:
        main_cfg = (ops.backend, ops.strict, dict(ops.op_map))
        main_fallbacks = dict(ops.fallbacks)
        report["against"] = []
        log("the main configuration's logits on the timed prompt (the entries' drift is against them) ...")
        main_logits = drift_logits(model, cfg, opts.prompt_len, device, opts.seed)
        try:
            for spec, backend, op_map, values in peers:
                report["against"].append(time_against(model, cfg, opts, spec, backend, op_map, report, device,
                                                      batches, log, values, main_logits))
        finally:
            ops.configure(*main_cfg)
            ops.fallbacks.update(main_fallbacks)
    if opts.guided:
        from deepinfer.engine.guided import GuideCompiler
        from deepinfer.tokenizer import V4Tokenizer

        log("guided decoding: compiling the JSON grammar against the vocabulary ...")
        compiler = GuideCompiler(V4Tokenizer.from_model_dir(opts.model), cfg.vocab_size)
        report["guided"] = []
        for B in batches:
            log(f"guided decode: batch {B}, {opts.gen_len} steps x {len(GUIDED_MODES)} modes ...")
            report["guided"].append(time_guided(model, cfg, B, opts.prompt_len, opts.gen_len, device, opts.seed,
                                                compiler, graphs=graphs))
    if opts.speculate:
        from deepinfer.bench.speculative import time_speculative

        plain = {d["batch"]: d["ms_per_step"] for d in report["decode"]}
        report["speculative"] = []
        for B in batches:
            log(f"speculative: batch {B}, K = {opts.speculate}, {opts.gen_len} steps ...")
            report["speculative"].append(time_speculative(model, cfg, B, opts.prompt_len, opts.gen_len, opts.speculate,
                                                          device, opts.seed, plain[B], graphs=graphs))
        if not opts.model:
            report["notes"] = report.get("notes", []) + [
                "speculative: random weights -- the MTP block is not trained to predict the main model, so the "
                "measured acceptance is near 0 and says nothing about a real checkpoint; read the projection"]
    log(f"counting the registry ops of one decode step at batch {batches[0]} ...")
    report["decode_ops"] = count_decode_ops(model, cfg, batches[0], min(opts.prompt_len, 16), device, opts.seed)
    log(f"counting the launches of one eager {opts.prompt_len}-token prefill ...")
    report["prefill_launches"] = count_prefill_ops(model, cfg, opts.prompt_len, device, opts.seed)
    if opts.profile:
        log(f"profiling one eager decode step at batch {batches[0]} ...")
        counts: dict = {}
        report["profile"] = profile_decode(model, cfg, batches[0], opts.prompt_len, device, opts.seed,
                                           out_counts=counts)
        report["decode_ops"].update(counts)
        if device.type == "cuda":
            from deepinfer.bench.oprates import profile_prefill

            log(f"timing every op of one {opts.prompt_len}-token prefill ...")
            report["prefill_ops"] = profile_prefill(model, cfg, opts.prompt_len, device, opts.seed, fp8_rate, rate,
                                                    bw)
    report["fallbacks"] = sorted(ops.fallbacks)
    report["fp8_prefill_gemm"] = _fp8_prefill_gemm(device)
    if device.type == "cuda":
        report["peak_mem_bytes"] = max([d.get("peak_mem_bytes", 0) for d in report["decode"]]
                                       + [torch.cuda.max_memory_allocated(device)])
    if opts.peer == "transformers":
        from deepinfer.bench.peer import run_peer  # transformers is imported only when asked for

        log("transformers peer ...")
        model.allocate(1, 1)  # release the engine's big caches; the weights stay (same tensors as `state`)
        ours = {d["batch"]: d["ms_per_step"] for d in report["decode"]}
        report["peer"] = run_peer(cfg, state, device, batches, opts.prompt_len, opts.gen_len, opts.seed, ours)
    del model, state
    return report
