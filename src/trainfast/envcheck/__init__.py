"""Pre-flight checks (CPUs, shared memory, open files, CUDA settings, database handles) and `trainfast env`."""

from trainfast.envcheck.checks import (
    Check,
    Status,
    cpu_check,
    cuda_alloc_conf_check,
    cuda_versions_check,
    db_handles_check,
    nvml_check,
    open_files_check,
    read_cuda_alloc_conf,
    read_driver_version,
    read_open_files_limit,
    read_shm_bytes,
    read_tf32_settings,
    shm_check,
    tf32_check,
    versions_check,
)
from trainfast.envcheck.environment import (
    CONTRACT_FIELDS,
    bug_report_block,
    environment,
    estimate_batch_bytes,
    loader_settings,
    preflight,
    tensors_batch_bytes,
)
from trainfast.envcheck.handles import find_handles

__all__ = ["CONTRACT_FIELDS", "Check", "Status", "bug_report_block", "cpu_check", "cuda_alloc_conf_check",
           "cuda_versions_check", "db_handles_check", "environment", "estimate_batch_bytes", "find_handles",
           "loader_settings", "nvml_check", "open_files_check", "preflight", "read_cuda_alloc_conf",
           "read_driver_version", "read_open_files_limit", "read_shm_bytes", "read_tf32_settings", "shm_check",
           "tensors_batch_bytes", "tf32_check", "versions_check"]
