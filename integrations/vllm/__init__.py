"""vLLM integration: KV-event wire format, subscriber with replay, metrics, discovery, P/D."""
