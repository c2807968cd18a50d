"""Packaging: the folders map into one import package, `monarch` (metadata in pyproject.toml).

Each folder's subpackages are found here, not listed by hand: a new subpackage ships in the wheel without
anyone editing a list (a hand list once left `monarch.runtime.simulator.backend` out of every non-editable
install). `tests/test_packaging.py` installs the wheel and imports every module.
"""

from setuptools import find_packages, setup

FOLDERS = {
    "monarch": "monarch",  # the public face
    "monarch.runtime": "runtime",
    "monarch.kernel": "kernel",
    "monarch.extension": "extension",
    "monarch.widgets": "widgets",
}
"""Import name -> the folder that holds it."""

setup(
    package_dir=FOLDERS,
    packages=[
        pkg for name, folder in FOLDERS.items() for pkg in (name, *(f"{name}.{p}" for p in find_packages(folder)))
    ],
)
