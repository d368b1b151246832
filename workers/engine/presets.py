"""Random-weight model presets for tests and benchmarks."""

from __future__ import annotations

from workers.engine.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # 2 layers, tiny widths: CPU tests and the README's first command
    "tiny": ModelConfig(
        architecture="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        bos_token_id=256,
        eos_token_ids=(257,),
        dtype="float32",
    ),
    # the Llama-3.1-8B shape, llama3 rope scaling included
    "llama3-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        dtype="bfloat16",
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset's config; raises ValueError naming the known presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
