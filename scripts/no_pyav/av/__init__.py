"""Stand-in for PyAV on a machine without it (scripts/gpu_bench.sh puts it on the path only then): mmspec_ray imports
PyAV at module level, so image-only runs need the name; any use of it fails, saying why."""


class FFmpegError(Exception):
    """The one name used in `except` clauses (never raised here)."""


class PyAVMissing(AttributeError):
    """Raised on any use (an AttributeError, so hasattr / getattr(av, name, default) behave; ImportError and
    AttributeError cannot share a class)."""


def __getattr__(name: str):
    raise PyAVMissing(f"PyAV is not installed on this machine (av.{name}): video workloads cannot run here")
