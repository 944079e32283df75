"""SGLang integration: KV events over ZMQ, ``/server_info`` discovery, ``/v1/loads`` metrics and
the PD bootstrap transform. See ``docs/sglang.md``."""
