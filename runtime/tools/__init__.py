"""The tools, controller half (the worker halves sit under `worker/` with the same names): the profiler,
trace merging, memory snapshots and the script debugger."""
