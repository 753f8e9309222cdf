"""Parallelism: device meshes, sharding rules, expert and pipeline parallelism."""
