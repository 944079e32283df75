"""Simulated engine fleet: paged KV cache, step-time model, continuous batching, trace replay.

Two faces on one model: an in-process discrete-event replay in virtual time (``virtual``) that
drives the real :class:`kvplug.router.Router`, and a server (``server``) speaking OpenAI HTTP and
vLLM-format KV events over ZMQ. See ``docs/sim.md`` for the model and its assumptions.
"""
