"""An in-process `dsneuron serve` for tests that reach into it: the app of runtime_min/serving/server.py on
uvicorn in a thread, at 127.0.0.1 on a free port, with create_app's request_hook as the test hook
that scripts what a request samples (with random weights a model writes no tool-call markup)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import openai
import torch

TIMEOUT = 60.0  # seconds any one client call may take before the test fails


class Script:
    """A request constraint (the test hook) that makes it sample `ids`, then EOS (ids None: any
    token), each token `delay` seconds late (a slow model)."""

    def __init__(self, ids: list[int] | None, eos: int, vocab: int, delay: float = 0.0):
        self.ids, self.eos, self.vocab, self.delay, self.k = ids, eos, vocab, delay, 0

    def allowed(self):
        time.sleep(self.delay)
        if self.ids is None:
            return None
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[self.ids[self.k] if self.k < len(self.ids) else self.eos] = True
        return mask

    def accept(self, token: int) -> None:
        self.k += 1


@contextmanager
def served(session, script: str | None = None, delay: float = 0.0, prefix_cache_bytes: int = 0, speculation=None,
           **limits):
    """An in-process server of `session` (127.0.0.1, a free port; `limits`: runtime_min/serving/server.py
    Limits fields; prefix_cache_bytes: its prefix cache, 0 for none; speculation: the scheduler's,
    runtime_min/core/speculative.py) whose requests sample `script` (when given), `delay` seconds a
    token; yields (base URL, the Requests it queued)."""
    from dsneuron.runtime_min.serving.engine import Engine
    from dsneuron.runtime_min.serving.server import Limits, create_app

    seen = []

    def hook(r):
        seen.append(r)
        if script is not None or delay:
            ids = None if script is None else session.tokenizer.encode(script, add_special_tokens=False).ids
            r.constraint = Script(ids, session.manifest.tokenizer.eos_token_id, session.vocab_size, delay)

    engine = Engine(session, 8, prefix_cache_bytes=prefix_cache_bytes, speculation=speculation)
    app = create_app(engine, "bundle", limits=Limits(**limits), request_hook=hook)
    with running(engine, app) as url:
        yield url, seen


@contextmanager
def running(engine, app):
    """`app` on uvicorn in a thread at 127.0.0.1 on a free port, with `engine` started; yields the
    base URL and stops both (the server's thread joined) when the block ends."""
    import uvicorn

    from dsneuron.runtime_min.serving.server import listen

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    engine.start()
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()
        sock.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="none", timeout=TIMEOUT, max_retries=0)
