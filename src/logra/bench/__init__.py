"""Benchmarks behind `logra bench <name>`: each module has `main(argv)` and prints tables."""
