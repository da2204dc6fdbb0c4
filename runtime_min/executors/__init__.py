"""The executors: one bucket's executables run on each target (executor_cpu.py, executor_neuron.py
with the NEFF checks of neff.py, executor_stablehlo.py), and the collectives a sharded bundle's
compiled stages call (collectives.py). They read the bundle layer only."""
