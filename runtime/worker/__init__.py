"""Code that runs in worker processes. It imports shared leaves and the transport, never controller code."""
