"""The runtime: what runs a bundle, without the compiler. Its layers, each importing only those
below it:

    serving/      `dsneuron serve`: HTTP, the OpenAI protocol, the chat format, the engine thread
    session.py    the tokenize-and-generate front (`dsneuron run`, the Python API); sharded.py runs
                  one Session per rank of a sharded bundle
    core/         the scheduler, the runner, input checks, sampling, bucket selection, prefix cache,
                  speculative decoding
    executors/    one bucket's executables on each target, the collectives
    bundle/       the bundle format, opening and verifying a bundle, signatures
"""
