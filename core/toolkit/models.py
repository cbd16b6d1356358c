"""Models: resolving ``--model`` through the registered loaders, the embedded ``tiny-*`` presets and
loading the HF module a strategy trains (shared by the core's strategies and the plugins' engines).

Presets are built from configs with the tokenizer that ships with the package and materialised
once into a cache directory (deterministic weights), so every strategy sees an ordinary HF dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolkit.contracts import ModelSource
from toolkit.errors import ConfigError, ModelError

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"

_COMMON = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 768, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 3,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_COMMON},
    "tiny-mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **_COMMON, "sliding_window": None},
    "tiny-qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_COMMON, "tie_word_embeddings": True},
    "tiny-qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_COMMON},
    "tiny-mixtral": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], **_COMMON,
                     "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128},
    "tiny-qwen2-moe": {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], **_COMMON,
                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1, "norm_topk_prob": False},
    "tiny-qwen3-moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **_COMMON,
                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "decoder_sparse_step": 1, "norm_topk_prob": True},
}
_MLA = {**{k: v for k, v in _COMMON.items() if k != "head_dim"}, "num_key_value_heads": 4,
        "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "moe_intermediate_size": 64, "n_routed_experts": 8, "first_k_dense_replace": 1}
PRESETS.update({
    # multi-head latent attention with a query latent; sigmoid top-4 over 2 of 4 expert groups, 1 shared expert
    "tiny-deepseek-v3": {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **_MLA, "q_lora_rank": 64,
                         "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                         "routed_scaling_factor": 2.5, "norm_topk_prob": True},
    # V2-Lite's shape: no query latent, softmax greedy top-2, 2 shared experts
    "tiny-deepseek-v2": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], **_MLA, "q_lora_rank": None,
                         "n_shared_experts": 2, "num_experts_per_tok": 2, "topk_method": "greedy"},
})


def cache_root() -> Path:
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "toolkit"))


def preset_config(name: str, **overrides: Any) -> Any:
    """The ``transformers`` config of a preset (optionally overridden, e.g. ``num_hidden_layers=4``)."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ModelError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    values = {**PRESETS[name], **overrides}
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


PRESET_MANIFEST = "toolkit-preset.json"  # written last: its presence marks a complete cache entry


def materialize_preset(name: str, directory: Path | None = None, seed: int = 0, **overrides: Any) -> Path:
    """Write a preset as an HF directory (config, safetensors, tokenizer) and return it.

    Weights come from ``seed``, so the same preset is the same model on every machine. One
    process writes (under a file lock; under an initialised process group, rank 0, because
    transformers' ``save_pretrained`` writes weights only there) into a temporary folder that is
    renamed into place with a manifest of file hashes; every other caller waits for it. A cache
    entry is checked against its manifest whenever it is read.
    """
    spec = {"preset": PRESETS.get(name), "overrides": overrides, "seed": seed, "v": 2}
    encoded = json.dumps(spec, sort_keys=True)
    # the tokenizer's files, its chat template included, are part of the preset: a changed one is a new cache entry
    tokenizer = b"".join((TOKENIZER_DIR / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json"))
    digest = hashlib.sha256(encoded.encode() + tokenizer).hexdigest()[:12]
    target = directory or cache_root() / "presets" / f"{name}-{digest}"
    if (target / PRESET_MANIFEST).is_file():
        return _checked_preset(target, encoded)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return _wait_for_preset(target, encoded, dist.get_rank())
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if (target / PRESET_MANIFEST).is_file():
            return _checked_preset(target, encoded)
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()  # an empty folder the caller made for it
        if target.exists():
            raise ModelError(f"preset cache {target} exists but has no {PRESET_MANIFEST} (written by an older toolkit, or by hand): "
                             f"delete it (rm -rf {target}) and run again; it is rebuilt from the preset")
        _write_preset(name, target, seed, overrides, encoded)
    return target


def _write_preset(name: str, target: Path, seed: int, overrides: dict[str, Any], encoded: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from toolkit.writes import staged_directory

    config = preset_config(name, **overrides)
    with staged_directory(target) as staging:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(staging, safe_serialization=True)
        if not (staging / "model.safetensors").is_file():
            raise ModelError(f"transformers wrote no weights for preset {name!r} into {staging}; files: "
                             f"{', '.join(sorted(p.name for p in staging.iterdir())) or 'none'}")
        AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(staging)
        GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False).save_pretrained(staging)
        files = {p.name: _sha256(p) for p in sorted(staging.iterdir())}
        (staging / PRESET_MANIFEST).write_text(json.dumps({"spec": json.loads(encoded), "files": files}, indent=1, sort_keys=True))


def _checked_preset(target: Path, encoded: str) -> Path:
    """``target`` if it holds exactly the files its manifest lists, of this preset spec."""
    manifest = json.loads((target / PRESET_MANIFEST).read_text())
    problems = []
    if manifest.get("spec") != json.loads(encoded):
        problems.append(f"it holds {manifest.get('spec')}, not {json.loads(encoded)}")
    for file, expected in manifest.get("files", {}).items():
        if not (target / file).is_file():
            problems.append(f"{file} is missing")
        elif _sha256(target / file) != expected:
            problems.append(f"{file} was changed since it was written")
    if problems:
        raise ModelError(f"preset cache {target} is damaged: {'; '.join(problems)}. Delete it (rm -rf {target}) and run "
                         "again; it is rebuilt from the preset")
    return target


REMOTE_CODE_FLAG = "Remote code runs only when --trust-remote-code is given on this command line"


def check_remote_code(directory: Path, trust_remote_code: bool, remedy: str = REMOTE_CODE_FLAG) -> None:
    """Refuse a model whose config or tokenizer names its own Python code (``auto_map``) unless this command was
    given ``--trust-remote-code``: transformers would otherwise ask on a terminal (one "y" runs it) or fail
    with an EOFError without one. ``remedy`` ends the message (where no flag can allow it, what to do instead)."""
    if trust_remote_code:
        return
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(directory) / name
        try:
            data = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            continue  # an unreadable config is reported by the loader that reads it
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            values = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            names = [n for v in values for n in (v if isinstance(v, list) else [v]) if isinstance(n, str)]
            shown = ", ".join(sorted({name.split("--")[-1].split(".")[0] for name in names}))
            raise ModelError(f"{path} asks to run the model's own Python code ({shown or 'auto_map'}); it was not run. "
                             f"{remedy}")


def _wait_for_preset(target: Path, encoded: str, rank: int) -> Path:
    import time

    patience = float(os.environ.get("TOOLKIT_PRESET_WAIT_S", "600"))
    deadline = time.monotonic() + patience
    while not (target / PRESET_MANIFEST).is_file():
        if time.monotonic() > deadline:
            raise ModelError(f"rank {rank} waited {patience:.0f}s for rank 0 to write the preset cache {target}, which did "
                             "not appear. Every rank must ask for the same preset; on several nodes, set TOOLKIT_CACHE to a "
                             "shared filesystem (TOOLKIT_PRESET_WAIT_S sets the wait)")
        time.sleep(0.2)
    return _checked_preset(target, encoded)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl) held for the block: one writer per cache entry at a time."""
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_hf_directory(reference: str, directory: Path, trust_remote_code: bool = False) -> ModelSource:
    from transformers import AutoConfig, AutoTokenizer

    if not (directory / "config.json").is_file():
        raise ModelError(f"{directory} is not a Hugging Face model directory: config.json is missing")
    check_remote_code(directory, trust_remote_code)
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        found = ", ".join(sorted(p.name for p in directory.iterdir())) or "nothing"
        hint = " (.bin weights are not read: convert them to safetensors)" if list(directory.glob("*.bin")) else ""
        raise ModelError(f"model directory {directory} has no *.safetensors weights{hint}; found: {found}")
    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise ModelError(f"cannot read {directory / 'config.json'}: {exc}. If the model needs its own code, pass --trust-remote-code.") from None
    tokenizer_dir = directory if any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")) else None
    if tokenizer_dir is None:
        raise ModelError(f"model directory {directory} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    notice = mtp_notice(config, weights, directory)
    if notice and os.environ.get("RANK", "0") == "0":
        import sys

        print(f"toolkit: warning: {notice}", file=sys.stderr)
    return ModelSource(reference=reference, directory=directory, config=config, tokenizer=tokenizer,
                       weight_files=weights, trust_remote_code=trust_remote_code)


def mtp_notice(config: Any, weights: list[Path], directory: Path) -> str | None:
    """What becomes of a checkpoint's multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``,
    stored as ``model.layers.{num_hidden_layers}.*``): transformers does not build them (it drops them on load)
    and neither does the Megatron bridge, so they are not trained, and exports leave them out (their config says
    ``num_nextn_predict_layers: 0``). ``None`` when the checkpoint holds no such tensors (only headers are read)."""
    layers = getattr(config, "num_nextn_predict_layers", 0) or 0
    first = getattr(config, "num_hidden_layers", None)
    if not layers or not isinstance(first, int):
        return None
    from safetensors import safe_open

    extra = 0
    for path in weights:
        with safe_open(str(path), "pt") as handle:
            extra += sum(1 for key in handle.keys()
                         if key.startswith("model.layers.") and key.split(".")[2].isdigit() and int(key.split(".")[2]) >= first)
    if not extra:
        return None
    return (f"{directory}: {extra} tensors of {layers} multi-token-prediction layer(s) (num_nextn_predict_layers, "
            f"model.layers.{first}.*) are dropped: neither transformers nor the Megatron bridge builds them, so they "
            "do not train, and an export leaves them out and writes num_nextn_predict_layers: 0")


def resolve_model(reference: str, trust_remote_code: bool = False) -> ModelSource:
    """Turn ``--model`` into a :class:`ModelSource` through the registered loaders."""
    from toolkit.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("model_loader")
    for _, cls in registry.items():
        loader = cls(cls.Config())
        if loader.accepts(reference):
            return loader.load(reference, trust_remote_code=trust_remote_code)
    raise ModelError(
        f"cannot load model {reference!r}: it is neither a local directory nor a preset "
        f"({', '.join(PRESETS)}). This machine has no model hub access: download the model "
        "elsewhere and pass its directory."
    )


def wants_scores(recipe: Any) -> bool:
    """Whether the recipe's loss consumes per-sequence scores (reward modeling) instead of label log-probs."""
    from toolkit.plugins import get_plugin_manager

    return get_plugin_manager().get("loss", recipe.loss).consumes == "scores"


def softcaps_attention(config: Any) -> bool:
    """Whether the model of ``config`` soft-caps its attention scores (Gemma 2), which SDPA cannot do: it loads
    eager (:func:`attention_kwargs`), or runs transformers' ``flex_attention`` under ``--local-packed-attention flex``
    (toolkit.train.attention)."""
    return bool(getattr(config, "attn_logit_softcapping", None))


def attention_kwargs(config: Any) -> dict[str, str]:
    """``from_pretrained`` keywords for the attention a model must run: eager for one whose config soft-caps
    attention logits (Gemma 2), as only transformers' eager attention applies the cap; transformers 5.17 still
    let such a model run sdpa without it, silently (later releases refuse sdpa for Gemma 2). None otherwise."""
    return {"attn_implementation": "eager"} if softcaps_attention(config) else {}


def load_hf_model(source: Any, tuner: Any, recipe: Any, device: Any) -> Any:
    """The HF causal LM in fp32 master weights, with the tuner applied, on ``device``.

    For a loss that consumes scores it is the ``*ForSequenceClassification`` model with one label
    (the value head starts from the seeded initialisation; the LM head is dropped).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(recipe.seed)
    kwargs = {"dtype": torch.float32, **attention_kwargs(source.config), **tuner.model_load_kwargs()}
    placed_by_loader = "quantization_config" in kwargs  # bitsandbytes quantises onto its device while loading
    kwargs.update(decompress_kwargs(source, kwargs))
    if wants_scores(recipe):
        pad = source.tokenizer.pad_token_id if source.tokenizer.pad_token_id is not None else source.tokenizer.eos_token_id
        model = AutoModelForSequenceClassification.from_pretrained(
            source.directory, trust_remote_code=source.trust_remote_code, num_labels=1, pad_token_id=pad, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.directory, trust_remote_code=source.trust_remote_code, **kwargs)
    if not placed_by_loader:
        model.to(device)
    if recipe.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    set_router_coefficients(model.config, recipe)
    from toolkit.plugins import get_plugin_manager

    get_plugin_manager().patch_model(model, source, recipe)
    check_router_losses(model, recipe)
    torch.manual_seed(recipe.seed)
    return tuner.apply(model, source)


def set_router_coefficients(config: Any, recipe: Any) -> None:
    """``--router-aux-loss-coef`` / ``--router-z-loss-coef`` set the HF config keys of those names, which the
    HF path (``toolkit.train.logps.router_aux_loss``) and a plugin that patches the MoE blocks read."""
    for name, value in (("router_aux_loss_coef", recipe.router_aux_loss_coef),
                        ("router_z_loss_coef", recipe.router_z_loss_coef)):
        if value is not None:
            setattr(config, name, float(value))


def check_router_losses(model: Any, recipe: Any) -> None:
    """Refuse a router-loss coefficient the HF path would silently ignore, before training starts.

    A model whose MoE blocks a plugin patched (``toolkit_pop_aux_loss``) computes both losses; a plain HF
    MoE model that returns router logits has its load-balancing loss only, any other model neither."""
    if hasattr(model, "toolkit_pop_aux_loss"):
        return
    fix = ("train with --moe-enabled (toolkit-moe's routed experts, on local/fsdp/deepspeed) or --strategy megatron, "
           "which compute it")
    z = float(getattr(model.config, "router_z_loss_coef", 0.0) or 0.0)  # the flag's value, else the config's
    if z:
        given = (f"--router-z-loss-coef {recipe.router_z_loss_coef}" if recipe.router_z_loss_coef is not None
                 else f"the model config's router_z_loss_coef {z}")
        leave = "leave the flag out" if recipe.router_z_loss_coef is not None else "give --router-z-loss-coef 0"
        raise ConfigError(f"{given}: the HF model ({model.config.model_type}) does not compute a router z-loss; "
                          f"{fix}, or {leave}", source="--router-z-loss-coef")
    has_router = getattr(model.config, "output_router_logits", None) is not None
    if recipe.router_aux_loss_coef and not has_router:
        raise ConfigError(f"--router-aux-loss-coef {recipe.router_aux_loss_coef}: the HF model "
                          f"({model.config.model_type}) computes no load-balancing loss (a dense model, or an MoE whose "
                          f"transformers code returns no router logits); {fix}, or leave the flag out",
                          source="--router-aux-loss-coef")


def decompress_kwargs(source: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors base (a GPTQ, AWQ or FP8 export) loads decompressed into plain float weights,
    so any tuner trains on it and the result exports (and quantizes) again; its packed Linear modules
    have no ``weight`` to train or wrap."""
    quantization = getattr(source.config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    if str(method) != "compressed-tensors" or "quantization_config" in kwargs:
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(run_compressed=False)}


def autocast_dtype(precision: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
