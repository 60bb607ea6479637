"""kernels/cuda/compile_log.py: the Triton JIT hooks record a compile with its kernel, specialization and
duration, chain nothing else, and are restored on uninstall (the hooks are Triton's own knobs; on the CPU
no kernel compiles, so the test drives them the way Triton's JITFunction._call_hook does)."""
import pytest

knobs = pytest.importorskip("triton").knobs

from glm_ray.kernels.cuda.compile_log import CompileLog  # noqa: E402


class _Fn:                       # Triton's JitFunctionInfo: module, name, jit_function
    name = "_rms_norm_kernel"


def test_hooks_record_a_compile_and_restore():
    before = knobs.runtime.jit_cache_hook
    seen = []
    with CompileLog(on_compile=seen.append) as log:
        assert knobs.runtime.jit_cache_hook == log._pre
        # what Triton calls around one compile
        assert knobs.runtime.jit_cache_hook(key=(), repr="_rms_norm_kernel[num_warps=4](T: i32)", fn=_Fn(),
                                            compile={}, is_manual_warmup=False, already_compiled=False) is False
        knobs.runtime.jit_post_compile_hook(key=(), repr="_rms_norm_kernel[num_warps=4](T: i32)", fn=_Fn(),
                                            compile={}, is_manual_warmup=False, already_compiled=False)
    assert knobs.runtime.jit_cache_hook is before
    assert [c.kernel for c in log.compiles] == ["_rms_norm_kernel"] and seen == log.compiles
    assert log.compiles[0].seconds is not None and log.compiles[0].seconds >= 0
    assert "_rms_norm_kernel" in log.summary() and "T: i32" in log.summary()
