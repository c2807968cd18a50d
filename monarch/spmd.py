"""Code written for torchrun, on a mesh: `from monarch.spmd import setup_torch_elastic_env`."""

from monarch.runtime.actors.spmd import setup_torch_elastic_env

__all__ = ["setup_torch_elastic_env"]
