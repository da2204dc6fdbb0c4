"""The benchmarks every figure in README and docs/ comes from, each run as `python -m dsneuron.bench.NAME`."""
