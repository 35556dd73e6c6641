"""The model's recommended sampling settings, read as vLLM reads them: from its
generation_config.json (the fields it sets away from transformers' defaults), for requests
that leave a setting unset. `generation_config="vllm"` ignores the model's file, a folder path
reads that folder's instead; `override_generation_config` sets fields on top of either. A model
without generation_config.json falls back to the generation fields of its config.json, as
vLLM's does. Served requests have their max_tokens capped as vLLM's server caps them
(`max_tokens_cap`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.models.loader import ResolvedModel
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's name -> SamplingParams' (vLLM reads these six).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}

SamplingDefaults = tuple[tuple[str, Any], ...]  # (SamplingParams field, value) pairs


def sampling_defaults(resolved: ResolvedModel, generation_config: str = "auto",
                      override: Mapping[str, Any] | None = None) -> SamplingDefaults:
    """The (field, value) pairs a request without its own value takes; ValueError naming
    `generation_config` or `override_generation_config` when they do not make valid params."""
    if not isinstance(generation_config, str):
        raise ValueError(f"generation_config: expected 'auto', 'vllm' or a folder, got "
                         f"{generation_config!r}")
    if override is not None and not isinstance(override, Mapping):
        raise ValueError(f"override_generation_config: expected a dict, got {override!r}")
    found: dict[str, Any] = {}
    if generation_config != "vllm":
        folder = resolved.path if generation_config == "auto" else generation_config
        found = _read(folder, generation_config != "auto")
    found.update(override or {})
    pairs = tuple((FIELDS[k], v) for k, v in found.items() if k in FIELDS and v is not None)
    try:
        SamplingParams(**dict(pairs))
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config: the model's sampling settings are not valid "
                         f"({e})") from None
    if pairs:
        logger.info("sampling defaults from the generation config: %s (vLLM's "
                    "generation_config='vllm' ignores them)", dict(pairs))
    return pairs


def max_tokens_cap(defaults: SamplingDefaults, generation_config: str = "auto",
                   override: Mapping[str, Any] | None = None) -> int | None:
    """The most tokens a served request may ask for, as vLLM's server: a generation config
    read from a folder the user named, or an override's max_new_tokens, caps even an explicit
    max_tokens; the model's own file only fills an unset one. None: no cap."""
    named = generation_config not in ("auto", "vllm")
    if not named and (override or {}).get("max_new_tokens") is None:
        return None
    return dict(defaults).get("max_tokens")


def _read(folder: str, asked: bool) -> dict[str, Any]:
    """What generation_config.json in `folder` (or, without one, config.json's generation
    fields) sets away from transformers' defaults ({} when there is neither: a .gguf model,
    unless the folder was asked for)."""
    from transformers import GenerationConfig

    if (Path(folder) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder, local_files_only=True).to_diff_dict()
    if (Path(folder) / "config.json").is_file():
        # NOTE: read as a dict: a config class may drop the sampling fields it does not use
        try:
            model_config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config: config.json in {folder!r} is not "
                             f"readable JSON ({e})") from None
        if not isinstance(model_config, dict):
            raise ValueError(f"generation_config: config.json in {folder!r} is not an object")
        defaults = GenerationConfig().to_dict()  # what differs from these, as to_diff_dict
        return {k: v for k, v in model_config.items()
                if k in FIELDS and v is not None and v != defaults.get(k)}
    if asked:
        raise ValueError(f"generation_config: no generation_config.json or config.json in "
                         f"{folder!r}")
    return {}
