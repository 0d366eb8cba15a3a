"""Benchmarks: decode step throughput against peers and the bandwidth floor."""
