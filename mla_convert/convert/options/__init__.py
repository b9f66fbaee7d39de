"""Options and their resolution for a source: the cache size, the RoPE split's prior and candidates, engine shapes and what each export target accepts (config only: no weights)."""
