"""disttune workloads: Triton kernels with host launchers and torch references."""
