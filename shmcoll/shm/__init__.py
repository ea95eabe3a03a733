"""Shared memory: segments, the arena layout, atomics and futexes."""
