"""Monarch's Kubernetes jobs: not available here (each raises, naming what to use instead: `SlurmJob`, `LocalJob`)."""

from monarch.runtime.job.unavailable import ImageSpec, KubeConfig, KubernetesJob

__all__ = ["ImageSpec", "KubernetesJob", "KubeConfig"]
