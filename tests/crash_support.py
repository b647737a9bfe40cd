"""Facts shared by the crash-detector tests (no tests here)."""

# The categories the rules file must cover (the logs issue names them).
REQUIRED_CATEGORIES = frozenset(
    {
        "cudagraph_tls",
        "cuda_oom",
        "illegal_memory_access",
        "device_assert",
        "nccl_timeout",
        "nan_loss",
        "compile_error",
        "segfault",
        "killed",
        "thread_exception",
        "python_exception",
    }
)
