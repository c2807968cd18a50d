"""Packaging: the folders map into one import package, `monarch` (metadata in pyproject.toml).

Each folder's subpackages are found here, not listed by hand: a new subpackage ships in the wheel without
anyone editing a list (a hand list once left `monarch.runtime.simulator.backend` out of every non-editable
install). `tests/test_packaging.py` installs the wheel and imports every module.
"""

from setuptools import Extension, find_packages, setup

FOLDERS = {
    "monarch": "monarch",  # the public face
    "monarch.runtime": "runtime",
    "monarch.kernel": "kernel",
    "monarch.extension": "extension",
    "monarch.widgets": "widgets",
}
"""Import name -> the folder that holds it."""

FASTWIRE = Extension("monarch.runtime.wire._fastwire", ["runtime/wire/_fastwire.c"], optional=True)
"""The signed one-frame message in compiled code (`runtime/wire/_fastwire.c`). Optional: where no C compiler or
Python headers are found, the install goes on and the Python versions in `codec.py` serve."""

setup(
    package_dir=FOLDERS,
    ext_modules=[FASTWIRE],
    packages=[
        pkg for name, folder in FOLDERS.items() for pkg in (name, *(f"{name}.{p}" for p in find_packages(folder)))
    ],
)
