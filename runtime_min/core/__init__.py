"""Generation over a bundle's executables: the runner that owns the executables and state rows
(runner.py), the scheduler's one decode loop (scheduler.py), bucket selection (select.py), the
checks of a generation's inputs (checks.py), sampling (sampling.py), the prefix cache
(prefix_cache.py) and speculative decoding (speculative.py). No HTTP and no tokenizer; of
runtime_min it imports the executors and the bundle layer only."""
