"""Serving our own ``mla`` checkpoints in other engines (vLLM: :mod:`mla_convert.serve.vllm_plugin`)."""
