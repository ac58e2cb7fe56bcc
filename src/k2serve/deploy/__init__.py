"""Deployment files (Kubernetes, SLURM, systemd) rendered from a `k2serve plan --json` file."""
