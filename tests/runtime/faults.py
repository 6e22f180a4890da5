"""Fault injection shared by the runtime and server tests."""

from __future__ import annotations


def poison_backend(engine, poison_token: int, times: int = 1):
    """Make ``engine.backend.run`` raise on a batch holding a prompt that starts with
    ``poison_token`` (at most ``times`` times); returns the list of failures raised."""
    run, raised = engine.backend.run, []

    def flaky(batch):
        if len(raised) < times and any(s.token_ids[0] == poison_token for s in batch.seqs):
            raised.append(batch)
            raise RuntimeError("injected backend failure")
        return run(batch)

    engine.backend.run = flaky
    return raised
