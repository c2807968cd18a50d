"""What the tests share that is not a test: the harnesses and stand-ins they drive.

- `kernel_client`: a real Monarch kernel driven through jupyter_client, with its kernelspec in a private prefix.
- `browser_lab`: JupyterLab in isolated temp dirs, Debian's Chromium, and /proc helpers (tests/test_browser.py).
- `perfetto_tp`: Perfetto's own trace processor (WebAssembly, in headless Chromium) reading our traces.
- `agent_job`: host agents on this machine, started by the test instead of Slurm.
- `slurm_cluster`: a real Slurm with extra hosts faked by network namespaces (root only).
- `attacker`: what another user on the machine tries against our sockets (tests/test_hardening.py runs it
  as `nobody`, in a fresh interpreter started from tests/).
- `tutorial_ddp`: the tutorial's DDP code, shared by tests/test_simulator.py and benchmarks/simulator.py.

The tests import them as ``helpers.<name>``: pytest puts tests/ (the test files' folder, which is not a
package) first on sys.path, as it does for conftest; benchmarks put tests/ on sys.path themselves.
"""
