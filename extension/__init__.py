"""IPython magics (`%%mesh`, `%mesh`); arrive with the kernel issue."""
