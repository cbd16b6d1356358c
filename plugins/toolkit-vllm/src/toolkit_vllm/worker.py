"""``python -m toolkit_vllm.worker``: generate in the interpreter that has vLLM.

Reads one JSON request on stdin (model_dir, prompts, backend config, generation options) and
prints one JSON line: ``[{"text": ..., "token_ids": [...]}, ...]``. Lets a toolkit installed
beside a newer transformers drive vLLM from its own environment.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from toolkit.errors import ToolkitError
    from toolkit_vllm.backend import VLLMBackend

    request = json.loads(sys.stdin.read())
    backend = VLLMBackend(VLLMBackend.Config(**request["config"], python=""))
    try:
        results = backend.generate_with_ids(request["model_dir"], request["prompts"], request["options"])
    except ToolkitError as exc:  # a refusal with its fix, for the caller to show: no traceback
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
    sys.stdout.write(json.dumps([{"text": text, "token_ids": ids} for text, ids in results]) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
