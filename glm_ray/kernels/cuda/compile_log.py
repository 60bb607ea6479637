"""Which Triton kernels compiled, and how long each took: a record of JIT compiles in this process.

A Triton kernel compiles on its first launch with a new specialization (constexprs, launch options, the
classes of its integer arguments). On the GPU path that is seconds inside a step — a stall that looks like
a slow request. `CompileLog` hooks Triton's JIT (`triton.knobs.runtime.jit_cache_hook`, called before a
compile or a load from the on-disk cache, and `jit_post_compile_hook`, after) and keeps one `Compile` per
event; `install_logging()` (`GLM_RAY_LOG_TRITON_COMPILES=1`, at kernel-backend start-up) logs each one.
Triton without these knobs (< 3.4): nothing is recorded.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class Compile:
    kernel: str                 # the @triton.jit function's name
    signature: str              # Triton's repr: launch options and each argument's specialization
    start: float                # time.perf_counter() when Triton decided to compile (or load) it
    seconds: float | None = None   # until the compiled kernel was ready (None: no post-compile hook)


@dataclass
class CompileLog:
    """Records Triton JIT compiles while installed (`with CompileLog() as log:` or install/uninstall)."""

    compiles: list[Compile] = field(default_factory=list)
    on_compile: object = None   # optional callable(Compile) called when one finishes
    _saved: tuple | None = None

    def _pre(self, *, key, repr, fn, **_kw):
        self.compiles.append(Compile(kernel=getattr(fn, "name", str(fn)), signature=repr, start=time.perf_counter()))
        return False            # never skip the compile

    def _post(self, *, key, repr, fn, **_kw):
        name = getattr(fn, "name", str(fn))
        for c in reversed(self.compiles):
            if c.kernel == name and c.seconds is None:
                c.seconds = time.perf_counter() - c.start
                if callable(self.on_compile):
                    self.on_compile(c)
                break

    def install(self) -> "CompileLog":
        try:
            from triton import knobs  # noqa: PLC0415 (only where Triton is used)
        except ImportError:
            return self
        rt = knobs.runtime
        self._saved = (rt.jit_cache_hook, getattr(rt, "jit_post_compile_hook", None))
        rt.jit_cache_hook = self._pre
        if hasattr(rt, "jit_post_compile_hook"):
            rt.jit_post_compile_hook = self._post
        return self

    def uninstall(self) -> None:
        if self._saved is None:
            return
        from triton import knobs  # noqa: PLC0415
        knobs.runtime.jit_cache_hook = self._saved[0]
        if hasattr(knobs.runtime, "jit_post_compile_hook"):
            knobs.runtime.jit_post_compile_hook = self._saved[1]
        self._saved = None

    def __enter__(self) -> "CompileLog":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def summary(self) -> str:
        """One line per compile: seconds, kernel, its specialization."""
        return "\n".join(f"{'?' if c.seconds is None else f'{c.seconds:6.2f}'} s  {c.kernel}  {c.signature}"
                         for c in self.compiles)


def install_logging() -> CompileLog:
    """Log every Triton compile of this process (kernel, seconds, specialization) at INFO."""
    return CompileLog(on_compile=lambda c: logger.info("triton compile: %s took %.2f s: %s", c.kernel,
                                                       c.seconds, c.signature)).install()


__all__ = ["Compile", "CompileLog", "install_logging"]
