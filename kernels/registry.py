"""Model families by HF `model_type`: each module offers Config.from_hf, pack_params, forward."""

from __future__ import annotations

from types import ModuleType

from kernels import llama, qwen3_moe

_FAMILIES: dict[str, tuple[ModuleType, type]] = {
    **{mt: (llama, llama.LlamaConfig) for mt in llama.MODEL_TYPES},
    **{mt: (qwen3_moe, qwen3_moe.Qwen3MoeConfig) for mt in qwen3_moe.MODEL_TYPES},
}


def family_for(model_type: str | None) -> tuple[ModuleType, type]:
    """(module, config class) for a model_type; ValueError naming it when unsupported."""
    if model_type not in _FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {sorted(_FAMILIES)})"
        )
    return _FAMILIES[model_type]
