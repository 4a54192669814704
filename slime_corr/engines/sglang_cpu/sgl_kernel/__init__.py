"""Stand-in for ``sgl_kernel`` on CPU (see ``../sitecustomize.py``): importable, registers no op, and any op
raises. sglang then finds no Intel AMX kernels (``cpu_has_amx_support()`` is False) and runs torch-native layers."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the CPU stand-in has no kernels (slime_corr/engines/sglang_cpu)")

    return unavailable
