"""firsttoken's top-level package `kernels` must be the only one: transformers 5.25 requires Hugging
Face's `kernels` distribution and imports from the top-level `kernels` at model load, which then finds
this repository's kernels/ (pyproject.toml pins transformers below 5.25 for it)."""

from __future__ import annotations

import importlib.metadata

import kernels


def test_no_other_distribution_installs_a_top_level_kernels() -> None:
    others = sorted({d for d in importlib.metadata.packages_distributions().get("kernels", []) if d != "firsttoken"})
    assert not others, (
        f"{others} install a top-level `kernels` package beside firsttoken's kernels/: transformers imports "
        "one and gets the other (see pyproject.toml's pin of transformers)"
    )
    assert kernels.__file__ is not None and kernels.__file__.endswith("kernels/__init__.py")


def test_transformers_loads_a_model_beside_our_kernels() -> None:
    """The import that failed on a fresh install with transformers 5.25 (its hub-kernels integration)."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) > 0, transformers.__version__
