"""Benchmarks that compare side by side in one run and print ratios; the soak."""
