"""The pipeline: the one pass order, the streamed passes and their work folder, the RoPE split search, the factor job and the in-memory conversion."""
