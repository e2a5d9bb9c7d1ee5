"""The engine's steps built for a model: its decode runner and speculative step, with their CUDA graphs.

They belong to the engine, not to the model (`Transformer` holds weights and caches only): this module keeps
them per model, keyed weakly, so a model that nothing else refers to is freed with its steps, caches and
graphs. A step refers to its model weakly for the same reason (`DecodeRunner.model`, `SpecStep.model`); a
strong reference from a step would keep the key, and so everything, alive.
"""

from __future__ import annotations

import weakref

_held: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def steps_of(model) -> dict:
    """The steps built for `model`: {"decode": DecodeRunner, "speculative": SpecStep} as far as made."""
    d = _held.get(model)
    if d is None:
        d = _held[model] = {}
    return d


def model_ref(model):
    """A weak reference to `model` whose call raises, naming `what`, once the model is gone."""
    ref = weakref.ref(model)

    def get():
        m = ref()
        if m is None:
            raise RuntimeError("the model this step was built for has been freed: build a new step")
        return m
    return get
