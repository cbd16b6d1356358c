"""Reference log-probs computed once before training and cached on disk (``--precompute-reference``).

Every sequence's summed reference log-prob is stored in ``Sequence.meta['reference_logps']``; the
collator carries it into ``sequence_meta`` and engines then skip the per-step reference forward,
and may free the reference model. The cache file is keyed by the model and the encoded data.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

META_KEY = "reference_logps"


def cache_key(source: Any, examples: list, recipe: Any) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"model": str(Path(source.directory).resolve()), "precision": recipe.precision,
                              "files": [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in source.weight_files]},
                             sort_keys=True).encode())
    for example in examples:
        for seq in example.sequences:
            digest.update(json.dumps([seq.input_ids, seq.labels]).encode())
    return digest.hexdigest()[:16]


def precompute_reference_logps(engine: Any, examples: list, recipe: Any, source: Any, run_dir: Path) -> Path:
    """Fill ``reference_logps`` for every sequence of ``examples`` (from the cache when it matches).

    Every rank computes every example in the same order, so strategies whose reference forward is
    collective (tensor or pipeline parallel) stay in step; the main rank writes the cache.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from toolkit.contracts import member
    from toolkit.data.pipeline import collate

    path = run_dir / "reference-logps" / f"{cache_key(source, examples, recipe)}.safetensors"
    if path.is_file():
        values = load_file(str(path))[META_KEY]
    else:
        pad_id = source.tokenizer.pad_token_id if source.tokenizer.pad_token_id is not None else 0
        chunks = []
        step = max(recipe.micro_batch_size, 1)
        for start in range(0, len(examples), step):
            batch = collate(examples, [[i] for i in range(start, min(start + step, len(examples)))], pad_id, packing=False)
            chunks.append(engine.reference_logps(batch).detach().float().cpu())
        values = torch.cat(chunks)
        if engine.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".tmp-{os.getpid()}")
            save_file({META_KEY: values.contiguous()}, str(partial))
            os.replace(partial, path)
        engine.barrier()
    index = 0
    for example in examples:
        for seq in example.sequences:
            seq.meta[META_KEY] = float(values[index])
            index += 1
    if index != values.numel():
        raise RuntimeError(f"reference cache {path} holds {values.numel()} values for {index} sequences")
    release = member(engine, "engine", "release_reference")
    if release is not None:
        release()
    return path
