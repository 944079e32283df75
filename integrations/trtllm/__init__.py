"""TensorRT-LLM integration: the draining ``POST /kv_cache_events`` poller, metrics and the
``disaggregated_params`` transforms. See ``docs/trtllm.md``."""
