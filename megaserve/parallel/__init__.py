"""Parallelism across devices: meshes, parallel configs (tensor parallelism first)."""
