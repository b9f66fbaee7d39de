"""The math of one layer: the partial-RoPE plan, the factorization, assembly, the NoPE-width reduction, the o_proj refit, and the per-layer converter that composes them."""
