"""Small bases of every architecture the lora recipe takes, as toyharness.architectures.example_file's
arguments: one table for the tests that run each architecture end to end (fuse, sampling)."""

ARCH_EXAMPLES = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "llama3": dict(arch="llama", rope_factors=True, rope_base=500000.0),       # rope_freqs
    "qwen3": dict(arch="qwen3", head_dim=32),
    "gemma3": dict(arch="gemma3", head_dim=32, n_layer=6, n_head=2, n_kv_head=1, window=4, rope_base=1e6),
    "phi3": dict(arch="phi3", rope_dims=8, window=64),
}
