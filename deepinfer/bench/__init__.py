"""Benchmarking: `deepinfer bench` and the rates `ab --bench` holds kernels against.

`run` assembles the report; `timing` times the engine's prefill, decode and guided steps, `speculative` its
speculative step, `peer` transformers on the same weights; `floor` computes each row's floor from the model's
bytes and FLOPs, `rates` measures the device's bandwidth and matmul rates those floors use, `oprates` the
per-op FLOP counts and rates of a prefill. Layering: `deepinfer_cli` and `deepinfer.debug` import this
package; it imports the engine, the model, the registry and `deepinfer.hf`, never the toolkit or a backend.
"""
