"""transformers interop: `model` builds transformers' DeepseekV4ForCausalLM with the engine's weights (the peer
that `bench --peer transformers` times, `dump --engine transformers` taps and `verify` compares against).
The checkpoint reader's name map for transformers-layout files stays with the reader
(`deepinfer.checkpoint.reader._from_transformers`), which this package inverts rather than repeats."""
