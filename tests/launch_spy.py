"""A stand-in for a @triton.jit kernel that records each launch's keyword arguments, then launches the kernel:
what tests use to see which form or tile a wrapper chose (monkeypatch the module's kernel with it)."""

from __future__ import annotations


class LaunchSpy:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch
