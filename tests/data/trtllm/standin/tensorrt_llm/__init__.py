"""A stand-in for the ``tensorrt_llm`` package (which needs CUDA): just the modules kvplug's
router hook touches, written by kvplug to the interface of NVIDIA/TensorRT-LLM at
00895e31dc5f9865c6bdfd2dd0508a9d6d964e9d (before ``remote_http``). Not TRT-LLM's code."""
