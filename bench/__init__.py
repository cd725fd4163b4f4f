"""Benchmarks: measured as ratios against a baseline from the same run, through public interfaces only."""
