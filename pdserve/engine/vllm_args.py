"""vLLM's engine arguments on this backend: the values pdserve cannot honour raise ValueError
naming the argument, and each argument that does not apply here logs one line, once per
process, saying so and why (logger `pdserve`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdserve.models.loader import TOKENIZER_MODES, ResolvedModel

logger = logging.getLogger("pdserve")
_logged: set[str] = set()  # the ignored arguments already logged in this process

# Arguments accepted and ignored: name -> (whether the value asks for something, why not).
_IGNORED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "enforce_eager": (bool, "pdserve always runs the model eagerly (it captures no CUDA "
                            "graphs)"),
    "max_seq_len_to_capture": (lambda v: v is not None, "pdserve captures no CUDA graphs"),
    "compilation_config": (lambda v: v is not None,
                           "pdserve neither torch.compiles the model nor captures CUDA graphs"),
    "disable_custom_all_reduce": (bool, "one engine runs on one device: there is no "
                                        "all-reduce"),
    "swap_space": (lambda v: v is not None,
                   "preempted requests are recomputed, never swapped to CPU memory"),
    "cpu_offload_gb": (bool, "weights are not offloaded (on CPU they live in CPU memory "
                             "already)"),
    "trust_remote_code": (bool, "pdserve runs its own code for the architectures it supports, "
                                "never code shipped with a checkpoint"),
    "download_dir": (lambda v: v is not None,
                     "nothing is downloaded: models load from a path, the local Hugging Face "
                     "cache or the bundled package"),
}
# (argument, the values accepted): the others raise ValueError naming the argument.
_ACCEPTED = {
    "kv_cache_dtype": (("auto",), "the KV cache has the model's dtype"),
    "load_format": (("auto", "safetensors", "gguf"),
                    "pdserve loads safetensors and .gguf files"),
}


def ignored_names() -> list[str]:
    """The arguments accepted and ignored on this backend."""
    return list(_IGNORED)


def log_ignored(args: Any) -> None:
    """One warning per ignored argument that was set, the first time it is seen."""
    for name, (is_set, why) in _IGNORED.items():
        value = getattr(args, name)
        if is_set(value) and name not in _logged:
            _logged.add(name)
            logger.warning("%s=%r is ignored: %s", name, value, why)


def check_args(args: Any, resolved: ResolvedModel) -> None:
    """ValueError, naming the argument, for a value this backend cannot honour."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(args, name)
        if value != 1 or isinstance(value, bool):
            raise ValueError(f"{name}: only 1 is supported (one engine runs on one device; "
                             f"scale out with more prefill/decode instances), got {value!r}")
    if args.quantization is not None and not (args.quantization == "gguf"
                                              and resolved.gguf_file):
        raise ValueError(f"quantization: {args.quantization!r} is not supported (pdserve "
                         f"loads unquantized safetensors, and dequantizes .gguf files: None, "
                         f"or 'gguf' for a .gguf model)")
    for name, (accepted, why) in _ACCEPTED.items():
        if getattr(args, name) not in accepted:
            raise ValueError(f"{name}: {getattr(args, name)!r} is not supported ({why}: "
                             f"{', '.join(accepted)})")
    has = "gguf" if resolved.gguf_file else "safetensors"
    if args.load_format not in ("auto", has):
        raise ValueError(f"load_format: {args.load_format!r}, but the model's weights are "
                         f"{has}")
    if args.skip_tokenizer_init:
        raise ValueError("skip_tokenizer_init: True is not supported (the engine uses the "
                         "tokenizer for EOS, stop strings and bad_words)")
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode: {args.tokenizer_mode!r} is not supported "
                         f"(choose {', '.join(TOKENIZER_MODES)})")
    if not _is_int(args.max_logprobs) or args.max_logprobs < -1:
        raise ValueError(f"max_logprobs must be -1 (no cap) or a non-negative int, "
                         f"got {args.max_logprobs!r}")
    for name in ("swap_space", "cpu_offload_gb"):
        value = getattr(args, name)
        if value is not None and (not _is_number(value) or value < 0):
            raise ValueError(f"{name} must be a non-negative number, got {value!r}")
    hf = args.hf_overrides
    if hf is not None and not (isinstance(hf, Mapping) or callable(hf)):
        raise ValueError(f"hf_overrides must be a dict of config attributes or a function "
                         f"of the config, got {hf!r}")


def refuse_unsupported(**options: Any) -> None:
    """ValueError naming the first vLLM call argument given a value pdserve cannot honour
    (None and empty values are fine: generic vLLM code passes them)."""
    for name, value in options.items():
        if value is not None and value != {}:
            raise ValueError(f"{name}: not supported by pdserve (LoRA adapters, multimodal "
                             f"inputs, tokenizer options and cache resets of running "
                             f"requests are not implemented); got {str(value)[:60]!r}")


def served_names(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """vLLM's served_model_name (a name or a list of names) as a tuple; () when not set."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else value
    if (not isinstance(names, (list, tuple)) or not names
            or not all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"served_model_name must be a non-empty name or list of names, "
                         f"got {value!r}")
    return tuple(names)


def load_chat_template(value: str | Path | None) -> str | None:
    """A chat template's text from vLLM's `chat_template`: a path to a file, or the Jinja
    template itself; ValueError if it is neither or does not compile."""
    if value is None:
        return None
    if not isinstance(value, (str, Path)):
        raise ValueError(f"chat_template must be a Jinja template or a file path, "
                         f"got {type(value).__name__}")
    text = None
    try:
        path = Path(value).expanduser()
        if path.is_file():
            text = path.read_text()
    except OSError:  # not a path at all (e.g. a template too long for a file name)
        pass
    if text is None:
        if isinstance(value, Path) or not any(c in value for c in "{}\n"):
            raise ValueError(f"chat_template: {str(value)!r} looks like a file path, but "
                             f"there is no such file")
        text = value
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # NOTE: private in transformers; without it errors surface in chat
        return text
    try:
        _compile_jinja_template(text)
    except Exception as e:  # jinja2.TemplateSyntaxError and friends
        raise ValueError(f"chat_template: not a valid Jinja template: {e}") from e
    return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
