"""The Monarch Jupyter kernel (an ipykernel subclass); arrives with the kernel issue."""
