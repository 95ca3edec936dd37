"""The raw mechanism the process tier is measured against: bubblewrap with every namespace
unshared, running the same ``print(1)``. Imports nothing of stockade, so that
``cold_versions.py``'s workers can take it before importing their own version."""

RAW_BWRAP = [
    "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
    "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
    "--uid", "1000", "--gid", "1000", "--clearenv",
]  # fmt: skip
PRINT1 = ["/usr/bin/python3", "-c", "print(1)"]
