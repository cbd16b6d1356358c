"""``toolkit export SRC --to gguf``: one GGUF file for llama.cpp and Ollama (with a Modelfile), written by the
``gguf`` package (llama.cpp's own gguf-py: its tensor-name map, writer, vocabulary helper and Q8_0 quantizer).

What llama.cpp's ``convert_hf_to_gguf.py`` does beyond those pieces is repeated here, because that script is
not a library: the hyper-parameter keys of each family, the vocabulary of a byte-level BPE tokenizer, and the
rotary permutation of Llama's q/k rows (llama.cpp rotates interleaved pairs, HF halves).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

from toolkit.config import option
from toolkit.contracts import ExportModel
from toolkit.errors import ToolkitError
from toolkit.plugins import install_hint

# HF model_type -> (gguf architecture, q/k rows permuted for llama.cpp's rotary layout)
FAMILIES = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False)}
FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}


@dataclasses.dataclass(kw_only=True)
class GGUFConfig:
    dtype: Literal["f32", "f16", "bf16", "q8_0"] = option(
        "f16", help="Matrix storage: f32, f16, bf16 or q8_0 (8-bit blocks of 32, llama.cpp's Q8_0); norms stay f32.")
    modelfile: bool = option(True, help="Write an Ollama Modelfile next to model.gguf (FROM, chat TEMPLATE, stop tokens).")


def require_gguf() -> Any:
    if importlib.util.find_spec("gguf") is None:
        raise ToolkitError(f"--to gguf needs the gguf package, which is not installed: {install_hint('toolkit-quantize', 'gguf')}")
    import gguf

    return gguf


def family_of(config: Any) -> tuple[str, bool]:
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ToolkitError(f"--to gguf writes {', '.join(FAMILIES)} models; this one is {config.model_type!r}. Convert it "
                           "with llama.cpp's convert_hf_to_gguf.py from an HF export (toolkit export --to hf)")
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind not in (None, "default"):
        raise ToolkitError(f"--to gguf: rope scaling {kind!r} (config.json rope_scaling) is not written by this exporter; "
                           "convert an HF export with llama.cpp's convert_hf_to_gguf.py")
    return family


def rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def permute_qk(weight: Any, heads: int) -> Any:
    """HF's rotary halves -> llama.cpp's interleaved pairs (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_hparams(writer: Any, config: Any, dtype: str, gguf: Any) -> None:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[dtype]))


def write_vocab(writer: Any, tokenizer: Any, config: Any, gguf: Any) -> None:
    """A byte-level BPE vocabulary as llama.cpp's ``gpt2`` tokenizer model (convert_hf_to_gguf ``get_vocab_base``)."""
    if not getattr(tokenizer, "is_fast", False) or tokenizer.backend_tokenizer.model.__class__.__name__ != "BPE":
        raise ToolkitError("--to gguf writes byte-level BPE tokenizers (Llama 3, Qwen, GPT-2 style); this tokenizer is "
                           f"{type(tokenizer).__name__}: convert with llama.cpp's convert_hf_to_gguf.py")
    vocab = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    special = set(tokenizer.all_special_tokens)
    tokens, types = [], []
    for index in range(config.vocab_size):
        token = vocab.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if token in special else
                         gguf.TokenType.USER_DEFINED if token in added else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)  # SpecialVocab reads merges, special ids and the chat template from disk
        special_vocab = gguf.SpecialVocab(tmp, load_merges=True, n_vocab=config.vocab_size)
    if "bos" not in special_vocab.special_token_ids and tokenizer.eos_token_id is not None:
        # no BOS (Qwen-style): name the end-of-text token, as Qwen's GGUFs do, and never prepend it; readers
        # such as transformers <= 5.17 need a bos id to build the tokenizer
        special_vocab.special_token_ids["bos"] = tokenizer.eos_token_id
        special_vocab.add_special_token["bos"] = False
    special_vocab.add_to_gguf(writer)


def gguf_tensors(model: ExportModel, dtype: str, gguf: Any) -> Iterator[tuple[str, Any, Any]]:
    """(gguf name, numpy data, raw dtype or None) for each HF tensor of ``model``."""
    import torch

    config = model.source.config
    _, permute = family_of(config)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, family_of(config)[0]), config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for name, tensor in model.tensors():
        if tied and name == "lm_head.weight":
            continue  # llama.cpp reads the embedding matrix when output.weight is absent
        if "rotary_emb" in name:
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ToolkitError(f"--to gguf: no GGUF name for tensor {name!r} of a {config.model_type} model")
        tensor = tensor.detach().to("cpu", torch.float32)
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else (config.num_key_value_heads or config.num_attention_heads)
            tensor = permute_qk(tensor, heads)
        yield target, *encode(tensor, dtype, gguf)


def encode(tensor: Any, dtype: str, gguf: Any) -> tuple[Any, Any]:
    import torch

    if tensor.ndim < 2 or dtype == "f32":
        return tensor.numpy(), None
    if dtype == "q8_0" and tensor.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        kind = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(tensor.numpy(), kind), kind
    if dtype == "bf16":
        kind = gguf.GGMLQuantizationType.BF16
        return gguf.quants.quantize(tensor.numpy(), kind), kind
    return tensor.to(torch.float16).numpy(), None


CHATML_TEMPLATE = '''{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
'''


def modelfile(tokenizer: Any) -> str:
    """Ollama's Modelfile: the chat template when it is ChatML (the toolkit's default), else the FROM line and a note."""
    lines = ["FROM ./model.gguf"]
    template = getattr(tokenizer, "chat_template", None) or ""
    if "<|im_start|>" in template:
        lines += [f'TEMPLATE """{CHATML_TEMPLATE}"""', 'PARAMETER stop "<|im_end|>"']
    else:
        lines.append("# the model's chat template is not ChatML: write its TEMPLATE in Ollama's Go syntax here")
    return "\n".join(lines) + "\n"


class GGUFExporter:
    """One ``model.gguf`` (llama.cpp, Ollama, LM Studio) and an Ollama ``Modelfile``."""

    name: ClassVar[str] = "gguf"
    Config: ClassVar[type] = GGUFConfig

    def __init__(self, config: GGUFConfig | None = None):
        self.config = config or GGUFConfig()

    def export(self, model: ExportModel, output: Path, options: GGUFConfig) -> Path:
        gguf = require_gguf()
        config = model.source.config
        arch = family_of(config)[0]
        writer = gguf.GGUFWriter(str(output / "model.gguf"), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
        writer.add_name(Path(str(model.source.reference)).name)
        write_hparams(writer, config, options.dtype, gguf)
        write_vocab(writer, model.source.tokenizer, config, gguf)
        for name, data, raw_dtype in gguf_tensors(model, options.dtype, gguf):
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if options.modelfile:
            (output / "Modelfile").write_text(modelfile(model.source.tokenizer))
        return output
