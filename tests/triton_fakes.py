"""Stand-ins for compiled Triton kernels, to count a GPU path's launches on CPU tensors.

Labelled fakes (no kernel can run here): `FakeJit` replaces a ``@triton.jit`` kernel, its
``[grid](...)`` records a JIT launch (Triton's ``JITFunction.run``) and returns a `FakeCompiled`,
whose ``run`` records a direct launch (the compiled launcher `triton_launch.launch` calls after
the first launch of a specialisation). Neither writes anything: the bits are other tests'
business. `direct_launches_on` turns `triton_launch`'s direct path on for these fakes, as on a
GPU with a Triton version it was read against.
"""

from __future__ import annotations

from types import SimpleNamespace

from nemo_jetrl.fp8 import triton_launch


class FakeCompiled:
    """What Triton's JITFunction.run returns: launcher (``run``), function handle, metadata."""

    def __init__(self, launches: list) -> None:
        self.launches, self.function, self.packed_metadata = launches, object(), (4, 1, 0)

    def run(self, *args) -> None:  # type: ignore[no-untyped-def]
        self.launches.append(("direct", args[:3], args[6:9]))


class FakeJit:
    """A compiled ``@triton.jit`` kernel's stand-in: ``[grid](...)`` records a JIT launch."""

    def __init__(self, real, launches: list) -> None:  # type: ignore[no-untyped-def]
        self.arg_names, self.__name__ = real.arg_names, real.__name__
        self.launches, self.compiled = launches, FakeCompiled(launches)
        self.pre_run_hooks: list = []

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.launches.append(("jit", grid, kwargs.get("enable_reflect_ftz")))
            return self.compiled

        return run


def direct_launches_on(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`triton_launch.launch`'s direct path on for `FakeJit` kernels, with an empty cache of
    compiled launchers and a launch hook that asks for no calls (as Triton's default)."""
    hooks = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=None)
    for key, value in dict(on=True, why="test", types=(FakeJit,), runtime=hooks,
                           device=lambda: 0, stream=lambda device: 0).items():  # fmt: skip
        monkeypatch.setitem(triton_launch._DIRECT, key, value)
    monkeypatch.setattr(triton_launch, "_COMPILED", {})
